"""A thin NIXL agent wrapper: the only module that imports ``nixl``.

The agent is created *without* NIXL's own progress thread: that thread spins
a full core even when idle. kvpush's engine thread drives progress instead by
calling ``state`` and ``notifs`` while work is in flight, and sleeps
otherwise. Every call on one agent comes from one thread (the engine's), so
no NIXL thread-safety mode is needed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.backends.base import MemRegistration
from kvpush.core.errors import ConfigError, KVPushError, MemoryKindError
from kvpush.core.indexed import INDEX_US, INDEX_US_ENTRIES, expand, list_fits
from kvpush.core.nixl_backends import DEFAULTS, TESTED_NIXL, told, traits
from kvpush.core.outcome import XferState
from kvpush.core.peer_loads import LoadNew, PeerLoads, TakenBack, Unload
from kvpush.core.surface import Need, Surface, Verdict, read_class, read_params, start_verdict, unmet

log = logging.getLogger(__name__)

EARLY_NOTIFS_MAX = 4096
"""Notifications ``progress`` keeps for ``notifs`` at most (P expects none: a bound, not a queue)."""

NOTIF_FLUSH_S = 0.05
"""How long after a ``send_notif`` the engine keeps progressing the agent (``flushing``): a notification
is queued until the backend progresses, and one to a peer this agent never wrote to also waits for the
connection to be set up (on UCX, several progress calls on both sides)."""

NIXL_INSTALL = "pip install 'nixl>=1.3.2' (after torch, so pip does not pull a CUDA torch)"
"""How to install a NIXL kvpush supports (pyproject.toml's ``nixl>=1.3.2``; tested: ``TESTED_NIXL``)."""


def _call(name: str, why: str, *params: str, keywords: tuple[str, ...] = ()) -> Need:
    return Need("nixl_agent", (name,), "call", why, params=params, keywords=keywords)


NIXL_NEEDS: tuple[Need, ...] = (
    _call("__init__", "starts an agent", "agent_name", "nixl_conf"),
    Need(
        "nixl_agent_config",
        ("__init__",),
        "call",
        "starts an agent without NIXL's progress and listen threads",
        keywords=("enable_prog_thread", "enable_listen_thread", "backends"),
    ),
    _call("get_plugin_list", "finds the backends' plugins"),
    _call("create_backend", "starts a backend", "backend"),
    _call("get_backend_mem_types", "learns which memory a backend registers", "backend"),
    _call("get_reg_descs", "describes the memory it registers", "descs", "mem_type"),
    _call("register_memory", "registers the KV and staging", "reg_list"),
    _call("deregister_memory", "deregisters them", "dereg_list"),
    _call("get_agent_metadata", "hands its metadata to peers"),
    _call("add_remote_agent", "loads a peer", "metadata"),
    _call("remove_remote_agent", "unloads a peer", "agent"),
    _call("send_notif", "notifies a peer", "remote_agent_name", "notif_msg"),
    _call("get_new_notifs", "reads notifications"),
    _call("get_xfer_descs", "describes a WRITE", "descs", "mem_type"),
    _call("initialize_xfer", "makes a WRITE", "operation", "local_descs", "remote_descs", "remote_agent", "notif_msg"),
    _call("prep_xfer_dlist", "prepares a peer's blocks once", "agent_name", "xfer_list", "mem_type"),
    _call(
        "make_prepped_xfer",
        "makes a WRITE of prepared blocks",
        "operation",
        "local_xfer_side",
        "local_indices",
        "remote_xfer_side",
        "remote_indices",
        "notif_msg",
    ),
    _call("transfer", "posts a WRITE", "handle", "notif_msg"),
    _call("check_xfer_state", "polls a WRITE", "handle"),
    _call("release_xfer_handle", "releases a WRITE", "handle"),
)
"""What kvpush calls of NIXL's Python API (``nixl._api``), with the arguments it passes."""

SETTLE_MAX_ERRORS = 4096
"""Most failed completions one ``Agent._settle_errors`` reads (a dead peer leaves one per descriptor)."""


WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")
"""NIXL's wheels (the ``nixl`` meta package imports one of them), in the meta package's order."""


def _torch_without_cuda_on_disk() -> bool:
    """True when torch is installed but not imported and its build has no CUDA.

    Read from ``torch/version.py`` alone, so that answering costs no torch import.
    """
    if "torch" in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        vspec = importlib.util.spec_from_file_location("_kvpush_torch_version", Path(spec.origin).parent / "version.py")
        if vspec is None or vspec.loader is None:
            return False
        mod = importlib.util.module_from_spec(vspec)
        vspec.loader.exec_module(mod)
    except Exception:
        return False
    return getattr(mod, "cuda", "unknown") is None


def _nixl() -> Any:
    """NIXL's agent classes.

    The ``nixl`` meta package picks its wheel (``nixl_cu13``/``nixl_cu12``/
    ``nixl_rocm``) from torch's CUDA version; with a CPU-only torch that is not
    imported yet it imports torch just to learn there is no CUDA, which costs
    seconds per process on a small host (every test and benchmark process;
    docs/benchmarks-log.md, "Figures behind code defaults"). In
    exactly that case the meta package then takes the first installed wheel in
    that order, so kvpush imports that wheel itself; otherwise it defers to
    ``nixl``.
    """
    try:
        if "nixl._api" not in sys.modules and _torch_without_cuda_on_disk():
            for wheel in WHEELS:
                try:
                    api = importlib.import_module(f"{wheel}._api")
                    return api.nixl_agent, api.nixl_agent_config
                except ModuleNotFoundError as exc:
                    if exc.name not in (wheel, f"{wheel}._api"):
                        raise
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on install
        raise KVPushError(f"NIXL is not importable ({exc}); install it with: {NIXL_INSTALL}") from None
    return nixl_agent, nixl_agent_config


def nixl_wheel() -> str:
    """The NIXL wheel module this process imported (``nixl_cu13``, …; ``nixl`` for a build without wheels),
    empty while NIXL is not imported."""
    return next((w for w in (*WHEELS, "nixl") if f"{w}._api" in sys.modules), "")


@functools.cache
def nixl_version() -> str:
    """The version of the NIXL this process runs (imported by :func:`_nixl`), from the wheel it imported,
    which is what runs; the meta package's version where the wheel has no metadata, else ``"unknown"``.
    The backends' traits depend on it (:mod:`kvpush.core.nixl_backends`). Read once a process: a loaded
    NIXL does not change, and reading package metadata scans the path."""
    from importlib.metadata import PackageNotFoundError, version

    _nixl()
    for dist in (nixl_wheel().replace("_", "-"), "nixl"):
        try:
            return version(dist) if dist else "unknown"
        except PackageNotFoundError:
            continue
    return "unknown"


def check_nixl(version: str, surface: Surface, backends: Sequence[str]) -> Verdict:
    """Whether kvpush starts an agent with ``backends`` on this NIXL (``kvpush.core.surface.start_verdict``):
    every call of ``NIXL_NEEDS`` fits its API, and on a NIXL newer than tested (or of an unreadable version)
    kvpush can tell each backend's traits (``nixl_backends.told``). A newer NIXL otherwise starts with one
    warning naming the tested range."""
    problems = unmet(surface, NIXL_NEEDS)
    if TESTED_NIXL.standing(version) in ("newer", "unreadable"):
        problems += [
            f"kvpush cannot tell how to drive NIXL backend {b} on this NIXL (it knows the traits of "
            f"{', '.join(DEFAULTS)} on any version, kvpush/core/nixl_backends.py)"
            for b in backends
            if not told(b, version)
        ]
    return start_verdict(TESTED_NIXL, version, problems)


@functools.cache
def read_nixl_surface() -> dict[str, dict[str, Any]]:
    """The running NIXL's ``Surface``: its agent class and its agent config's parameters."""
    nixl_agent, nixl_agent_config = _nixl()
    return {"nixl_agent": read_class(nixl_agent), "nixl_agent_config": {"__init__": read_params(nixl_agent_config)}}


@functools.cache
def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process says it (every engine starts agents)."""
    log.warning("%s", message)


def start_on_nixl(backends: Sequence[str]) -> None:
    """Refuse (``KVPushError``) or warn once as ``check_nixl`` says for the running NIXL."""
    verdict = check_nixl(nixl_version(), read_nixl_surface(), backends)
    if verdict.refusal:
        raise KVPushError(f"{verdict.refusal}; install one with: {NIXL_INSTALL}")
    if verdict.warning:
        warn_once(verdict.warning)


STRIDED_LISTS = (1, 5)
"""The first NIXL whose ``prep_xfer_dlist`` takes a list in its strided form (one N x 5 row per strip); an
older one is given the list one row per entry."""
STRIDED_CORE = (1, 4)
"""The first NIXL that holds a prepared list as strides (consecutive equally spaced entries in one row), so that
naming an entry by index reads a few rows instead of an entry of a list larger than the cache."""


def _at_least(version: str, first: tuple[int, int]) -> bool:
    """Whether NIXL ``version`` is ``first`` or later; a version it cannot read is not."""
    try:
        parts = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return parts >= first


def takes_strided_lists(version: str) -> bool:
    """Whether NIXL ``version`` prepares strided lists (``STRIDED_LISTS``)."""
    return _at_least(version, STRIDED_LISTS)


def index_cost_us(version: str) -> float:
    """Host work per index of a by-index WRITE on NIXL ``version`` (``kvpush.core.indexed``: ``INDEX_US`` where
    it holds lists as strides, ``STRIDED_CORE``, else ``INDEX_US_ENTRIES``)."""
    return INDEX_US if _at_least(version, STRIDED_CORE) else INDEX_US_ENTRIES


def imports_torch() -> bool:
    """Whether the running NIXL's Python API imports torch when loaded (NIXL 1.3.2 does: seconds and hundreds
    of MiB per process on a small host); later versions only look for a torch already imported. Read from
    the API module, not the version number."""
    api = sys.modules.get(f"{nixl_wheel()}._api")
    return api is not None and not hasattr(api, "_is_torch_tensor") and hasattr(api, "torch")


def _pairs(new: dict[Any, list[Any]]) -> list[tuple[str, bytes]]:
    """NIXL's ``{peer: [message, ...]}`` as ``(peer, message)`` pairs, peer names as ``str``."""
    out: list[tuple[str, bytes]] = []
    for peer, msgs in new.items():
        p = peer.decode() if isinstance(peer, bytes) else peer
        out.extend((p, bytes(m)) for m in msgs)
    return out


@dataclass
class _Kept:
    """A prepared descriptor list the agent keeps: NIXL's handle and what its maker attached to it
    (``Agent.kept``)."""

    handle: Any
    note: Any


class Agent:
    """One NIXL agent with the backends named in configuration."""

    def __init__(self, name: str, backends: tuple[str, ...] | list[str] = ("UCX",)) -> None:
        """Start a NIXL agent ``name`` with ``backends`` (without NIXL's progress and listen threads)."""
        nixl_agent, nixl_agent_config = _nixl()
        if not backends:
            raise ConfigError("nixl_backends is empty: name at least one NIXL backend (UCX, LIBFABRIC)")
        start_on_nixl(backends)
        conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        inner = nixl_agent(name, conf)
        available = set(inner.get_plugin_list())
        for b in backends:
            if b not in available:
                raise ConfigError(
                    f"NIXL backend {b!r} is not available on this host (plugins found: {sorted(available)}); "
                    "run `kvpush doctor` for why"
                )
            try:
                inner.create_backend(b)
            except Exception as exc:
                raise KVPushError(f"NIXL backend {b} failed to start: {exc}") from None
        self._wrap(name, inner, tuple(backends), nixl_version())

    @classmethod
    def over(cls, name: str, inner: Any, backends: tuple[str, ...], version: str) -> Agent:
        """An agent over ``inner``, a NIXL agent object already started with ``backends`` on NIXL ``version``
        (what ``__init__`` builds once it started NIXL's). Its rules over the version's traits (which peers
        stay loaded, which are greeted) are then checked against any object with NIXL's agent methods."""
        agent = cls.__new__(cls)
        agent._wrap(name, inner, backends, version)
        return agent

    def _wrap(self, name: str, inner: Any, backends: tuple[str, ...], version: str) -> None:
        self.name = name
        self._agent = inner
        self.backends = backends
        self.nixl_version = version
        self.traits = traits(self.backends, self.nixl_version)
        self._mem_types = {b: set(inner.get_backend_mem_types(b)) for b in self.backends}
        self._regs: list[Any] = []
        self._loads = PeerLoads(self.traits.reloads_live_peer, self.traits.dead_peer_writes_end)
        """Which peers are loaded, in use or given up but kept (``kvpush.core.peer_loads``: the rules)."""
        self._early: list[tuple[str, bytes]] = []
        self._flush_until = 0.0  # progress until then: a notification may still be queued
        self._writes: dict[int, str] = {}
        """WRITEs made and not yet released: ``id`` of the handle -> the peer written to."""
        self._lists: dict[str, _Kept] = {}
        """Prepared descriptor lists kept for by-index WRITEs, by peer ("": this agent's own memory)."""
        self.strided_lists = takes_strided_lists(version)
        """Whether NIXL prepares a list from one row per strip; otherwise it is given one row per entry."""

    def peers(self) -> tuple[str, ...]:
        """The peers in use (loaded with ``add_peer``, not given up with ``remove_peer``)."""
        return tuple(self._loads.in_use)

    @property
    def stuck_grace_s(self) -> float:
        """How long a peer given up with WRITEs that would not end if it died stays loaded for them
        (``kvpush.core.peer_loads``; the engine sets ``peer_dead_s``)."""
        return self._loads.grace_s

    @stuck_grace_s.setter
    def stuck_grace_s(self, seconds: float) -> None:
        self._loads.grace_s = seconds

    def unreleased_writes(self) -> int:
        """WRITEs made with ``prepare_write`` and not yet given back with ``release``."""
        return len(self._writes)

    def register(self, regs: list[MemRegistration]) -> None:
        """Register buffers (all of one memory kind per call)."""
        if not regs:
            return
        kinds = {r.mem for r in regs}
        for kind in kinds:
            self.check_takes(str(kind))
            arr = np.array([(r.addr, r.size, r.device_id) for r in regs if r.mem == kind], dtype=np.int64)
            descs = self._agent.get_reg_descs(arr, str(kind))
            self._agent.register_memory(descs)
            self._regs.append(descs)

    def check_takes(self, kind: str) -> None:
        """Refuse memory no started backend takes, before NIXL fails on it with a bare status.

        A backend's memory kinds are known only once it started: NIXL's LIBFABRIC plugin takes
        device memory only when it found an accelerator runtime, which it looks for on efa alone.
        """
        if any(f"{kind}_SEG" in mems for mems in self._mem_types.values()):
            return
        took = "; ".join(f"{b} takes {sorted(m) or 'nothing'}" for b, m in self._mem_types.items())
        hint = ""
        if kind == "VRAM" and "LIBFABRIC" in self._mem_types:
            hint = (
                " (NIXL's LIBFABRIC plugin takes device memory only where it found an accelerator"
                " runtime, which it looks for on the efa provider alone, never on tcp or sockets;"
                " push device memory over efa or UCX, or give the backend host staging: cuda staging=host)"
            )
        raise MemoryKindError(f"no NIXL backend of this agent registers {kind} memory: {took}{hint}")

    def deregister_all(self) -> None:
        for descs in self._regs:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:  # pragma: no cover - teardown best effort
                log.warning("deregister failed on %s: %s", self.name, exc)
        self._regs.clear()

    @property
    def registered(self) -> int:
        return len(self._regs)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, name: str = "", greeting: bytes = b"") -> str:
        """Load a peer's metadata; returns its agent name. ``name``: the name the peer says it has.

        Metadata of a peer still loaded (given up but kept) takes it back without loading anything; a peer
        kept under ``name`` with other metadata (it restarted) is unloaded first (``kvpush.core.peer_loads``).

        ``greeting``: a notification for a peer known to progress its agent now (it just said hello),
        sent as it is loaded where loading does not connect to it (``traits.connects_on_load`` False):
        the send connects, so that no WRITE's post has to, which would block for as long as a peer dead
        by then never accepts. Returns once the peer accepted; a failed send unloads the peer and raises."""
        verdict = self._loads.add(metadata, name)
        if isinstance(verdict, TakenBack):
            return verdict.name
        assert isinstance(verdict, LoadNew)
        self._carry_out(verdict.unload_first)
        loaded = self._agent.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if greeting and not self.traits.connects_on_load:
            try:
                self._agent.send_notif(loaded, greeting)
            except Exception:
                self._unload(loaded)
                raise
        self._loads.loaded(loaded, metadata)
        return loaded

    def remove_peer(self, name: str, now: float | None = None) -> None:
        """Give a peer up: nothing of it is posted any more. Whether it is unloaded now, kept loaded for its
        metadata's return, kept until its WRITEs in flight end by themselves (unloading would not stop what the
        transport queued for them), or kept for ``stuck_grace_s`` because WRITEs to it would not end if it died,
        is ``kvpush.core.peer_loads``' rule. Without ``now`` (the caller keeps no time) a peer kept for WRITEs
        that would not end is unloaded at once. Its prepared list goes now, whether or not its metadata stays
        loaded: nothing is posted to it any more, and its next hello prepares a list again (``keep_list``)."""
        self._drop_list(name)
        self._carry_out(self._loads.remove(name, name in self._writes.values(), now))

    def expire(self, now: float) -> None:
        """Unload the peers given up with WRITEs that would not end whose ``stuck_grace_s`` ran out with those
        WRITEs still unreleased (they then end, failed), and those kept until their WRITEs ended, once they have
        (where a live peer can be reloaded; else they stay retired)."""
        if self._loads.waiting():
            self._carry_out(self._loads.expire(now, set(self._writes.values())))

    def _carry_out(self, unloads: tuple[Unload, ...] | list[Unload]) -> None:
        for u in unloads:
            self._unload(u.name)

    def _unload(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # pragma: no cover
            log.debug("remove_remote_agent(%s): %s", name, exc)

    def prepare_write(
        self,
        local: np.ndarray,
        local_mem: str,
        remote: np.ndarray,
        remote_mem: str,
        peer: str,
        notif: bytes,
    ) -> Any:
        """Create, not post, a WRITE (``post`` it later): the descriptor lists and the request are built
        off the critical path. An unposted handle is given back with ``release``."""
        ld = self._agent.get_xfer_descs(np.ascontiguousarray(local, dtype=np.int64), local_mem)
        rd = self._agent.get_xfer_descs(np.ascontiguousarray(remote, dtype=np.int64), remote_mem)
        handle = self._agent.initialize_xfer("WRITE", ld, rd, peer, notif)
        self._writes[id(handle)] = peer
        return handle

    # -- prepared lists and by-index WRITEs ------------------------------------
    def keep_list(self, peer: str, rows: np.ndarray, mem: str, note: Any = None) -> bool:
        """Prepare NIXL's descriptor list over ``peer``'s memory (``peer`` empty: this agent's own) from
        ``rows``, in the strided form (``kvpush.core.indexed.list_rows``: one (address, entry bytes, device,
        stride, count) row per strip), and keep it for by-index WRITEs until the peer is given up (this agent's
        own: until ``close``). A list kept for the peer before is released first, whatever it was made from:
        the caller prepares a peer's list at each hello, so a peer that restarted (the same name, other
        metadata, perhaps its memory at the same addresses) never keeps one made over its previous load.
        Returns whether a list is kept: False where the peer is not in use, the list is too large for this
        NIXL (``list_fits``) or NIXL refused it (logged)."""
        self._drop_list(peer)
        if peer and peer not in self._loads.in_use:
            return False
        if not list_fits(rows, self.strided_lists):
            who = peer or "this agent"
            log.info("%s: %s's KV is too large for a prepared list on NIXL %s", self.name, who, self.nixl_version)
            return False
        given = np.ascontiguousarray(rows if self.strided_lists else expand(rows), dtype=np.int64)
        try:
            handle = self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", given, mem)
        except Exception as exc:
            who = peer or "this agent"
            log.warning(
                "%s: NIXL refused a prepared list over %s's KV (WRITEs built per request): %s", self.name, who, exc
            )
            return False
        self._lists[peer] = _Kept(handle, note)
        return True

    def kept(self, peer: str) -> Any:
        """The note given with the list kept for ``peer`` ("": this agent's own), or None where none is kept."""
        kept = self._lists.get(peer)
        return kept.note if kept is not None else None

    def _drop_list(self, peer: str) -> None:
        kept = self._lists.pop(peer, None)
        if kept is None:
            return
        try:
            self._agent.release_dlist_handle(kept.handle)
        except Exception as exc:  # pragma: no cover - teardown best effort
            log.debug("release_dlist_handle(%s): %s", peer, exc)

    def prepare_by_index(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Any:
        """Create, not post, a WRITE of entries ``local`` of this agent's kept list to entries ``remote`` of
        ``peer``'s (int32, pairwise), carrying ``notif``. Raises ``KVPushError`` where a list is not kept."""
        mine, theirs = self._lists.get(""), self._lists.get(peer)
        if mine is None or theirs is None:
            raise KVPushError(f"no prepared list kept for {'this agent' if mine is None else peer}")
        handle = self._agent.make_prepped_xfer("WRITE", mine.handle, local, theirs.handle, remote, notif)
        self._writes[id(handle)] = peer
        return handle

    def prepare_lists(
        self, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str, peer: str
    ) -> tuple[Any, Any]:
        """NIXL's prepared descriptor lists over these local buffers and ``peer``'s (rows of address, length,
        device), made once and reused: a WRITE then names their entries by index
        (``prepare_indexed_write``, the same entry of each side) instead of building descriptors per request:
        ``kvpush_tools.cuda.p_driver``'s handles posted again. The engine's lists are ``keep_list``'s."""
        mk = self._agent.prep_xfer_dlist
        return mk("NIXL_INIT_AGENT", local, local_mem), mk(peer, remote, remote_mem)

    def prepare_indexed_write(self, lists: tuple[Any, Any], indices: list[int], notif: bytes) -> Any:
        """Create, not post, a WRITE of entries ``indices`` of ``prepare_lists``' lists (the same entry of
        each side). Such a handle can be posted again, each time with a new notification (``post``)."""
        local, remote = lists
        return self._agent.make_prepped_xfer("WRITE", local, indices, remote, indices, notif)

    def post(self, handle: Any, notif: bytes = b"") -> XferState:
        """Post a WRITE made by ``prepare_write`` (or ``prepare_indexed_write``, ``prepare_by_index``); returns
        the post state. ``notif``: a new notification for a handle posted again (empty: the one it was made
        with)."""
        self._settle_errors()
        return XferState.of(self._agent.transfer(handle, notif))

    def state(self, handle: Any) -> XferState:
        """The WRITE's state; a NIXL exception (peer gone mid-WRITE) is ``ERR``, not a raise,
        so one broken transfer cannot stall the engine loop that polls all of them."""
        self._settle_errors()
        try:
            state = XferState.PROC
            for _ in range(self.traits.drain_calls):  # each call reaps a bounded number of completions
                state = XferState.of(self._agent.check_xfer_state(handle))
                if state is not XferState.PROC:
                    break
            return state
        except Exception as exc:
            log.warning("%s: transfer failed: %s", self.name, exc)
            return XferState.ERR

    def release(self, handle: Any) -> None:
        self._writes.pop(id(handle), None)
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # pragma: no cover
            log.debug("release_xfer_handle: %s", exc)

    def _settle_errors(self) -> None:
        """Where a failed completion fails whichever call reads it (``traits.peer_errors_isolated`` is
        False), read the pending ones with calls of our own before a post or a poll: each is charged to
        its own transfer as it is read, so the post or poll that follows is not failed by another
        peer's error. A dead peer leaves one per descriptor it had in flight. Notifications these calls
        bring are kept for ``notifs``."""
        if self.traits.peer_errors_isolated:
            return
        for _ in range(SETTLE_MAX_ERRORS):
            try:
                self._early.extend(_pairs(self._agent.get_new_notifs()))
                return
            except Exception as exc:
                log.debug("%s: read a failed completion: %s", self.name, exc)

    def progress(self) -> None:
        """Progress the backend once without taking notifications (kept for ``notifs``): a notification sent
        with ``send_notif`` leaves only as the sender's agent progresses, which a P with no WRITE in flight
        otherwise never does."""
        try:
            got = _pairs(self._agent.get_new_notifs())
        except Exception as exc:
            log.debug("%s: progress: %s", self.name, exc)
            return
        if got:
            self._early.extend(got)
            del self._early[:-EARLY_NOTIFS_MAX]

    def notifs(self, drain: bool = False) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as ``(peer agent, message)``. ``drain``: a
        transfer is being written to us, so progress the backend as many times as it needs for that
        (``traits.drain_calls``; one call on UCX)."""
        out, self._early = self._early, []
        for _ in range(self.traits.drain_calls if drain else 1):
            try:
                out.extend(_pairs(self._agent.get_new_notifs()))
            except Exception as exc:
                log.warning("%s: reading notifications failed: %s", self.name, exc)
                break
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a notification without a WRITE. It leaves only as this agent progresses: the engine calls
        ``progress`` while ``flushing`` says so (no WRITE of its own may be in flight to do it)."""
        self._agent.send_notif(peer, msg)
        self._flush_until = time.monotonic() + NOTIF_FLUSH_S
        self.progress()

    def flushing(self, now: float) -> bool:
        """Whether a notification sent lately may still be queued (``NOTIF_FLUSH_S``)."""
        return now < self._flush_until

    def close(self) -> None:
        for peer in list(self._lists):
            self._drop_list(peer)
        self._carry_out(self._loads.close())
        self.deregister_all()
        self._agent = None
