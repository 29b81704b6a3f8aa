"""``kvpush bench transfer``: what one large request costs to push, per plan and block pattern.

A push's cost is set less by its bytes than by its descriptor count: UCX posts
each descriptor for microseconds, so the same megabytes cost milliseconds when
they are contiguous and far more when D's blocks are scattered. This benchmark
moves one request shaped like a long prompt of a Qwen3-32B TP8 rank (64 layers
x K/V, 1 KV head x 128 dims, 2-byte elements, 16-token blocks: 4 KiB per block
and layer) between two processes over real NIXL agents, for

- block patterns (both sides draw their block ids independently): ``shuffled``
  (random ids), ``runs16`` (random runs of 16 consecutive ids), ``contiguous``;
- plans: ``per-block`` (one descriptor per block and layer, what a connector
  without coalescing posts; built here from the layouts and posted with
  ``Agent.write``), ``coalesced`` (the engine, ``plan="direct"``), ``staged``
  (the engine, ``plan="staged"``: pack, one WRITE, unpack, through one slot of
  a region sized to the push), ``rounds`` (staged in rounds through a small
  region's ring) and ``auto`` (the engine's cost model choosing); their
  settings: ``kvpush_tools.bench.transfer_plans``.

Engine plans run in each ``--orders`` (the order in which P's prefill and D's
registration meet; every total ends at D's result):

- ``registered`` (the default): D registered first, then P's prefill is
  handed over finished; from the hand-over (P plans then);
- ``finished``: what a sequential router does (P answers, then the router
  sends D): P's finished prefill is parked, then D registers; from D's
  register call, so D's and P's planning are on it;
- ``ahead``: D registered while P computes: P announces the prefill, pairs
  and plans before its KV is ready; from "KV ready" (``forward_done``).

``--tree PATH`` (repeatable) runs each kvpush tree's engines in their own
pair of processes, side by side with the same cases (an A/B against another
checkout or an old commit); ``--push-parts`` with ``--min-part-bytes`` cuts a
small staged push into parts, so per-part costs show without large copies.
``--busy-gil`` and ``--switch-intervals`` add GIL modes that take turns (a busy
Python thread in each process, as vLLM's engine loop: ``busy_gil``);
``--sizes`` runs the cases at several push sizes (``transfer_sizes``).
Each row also carries P's and D's stage times after the order's start
(``at_<side>_<stage>_s_median``) and the CPU time of each engine thread per
transfer (``p_cpu_s``, ``d_cpu_s``), which a loaded host does not inflate.

Each case runs one warm-up and ``--iters`` measured transfers, the cases
taking turns; the medians are printed, saved as JSON and drawn as a bar chart. D's cache is
zeroed before every case and compared with P's bytes after it, so a plan that
is fast because it moved the wrong bytes fails loudly.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvpush_tools.bench import busy_gil, stages, transfer_plans, transfer_plot, transfer_sizes

PATTERNS = ("shuffled", "runs16", "contiguous")
PLANS = ("per-block", "coalesced", "staged", "rounds", "auto")
ORDERS = ("registered", "finished", "ahead")
RUN = 16


@dataclass(frozen=True)
class Shape:
    """One rank's KV geometry and the request length; elements are ``dtype_bytes`` wide.

    Not ``kvpush.core.geometry.KVGeometry``, on purpose: a shape is sent to the side processes, which with
    ``--tree`` import another checkout's ``kvpush`` (an old commit's, for an A/B), where that type may not
    exist; so the shape is this module's own, and nothing of ``kvpush`` is imported here at module level.
    """

    tokens: int = 4096
    layers: int = 64
    kv_heads: int = 1
    head_dim: int = 128
    dtype_bytes: int = 2
    block_size: int = 16
    pool_factor: float = 2.0

    @property
    def blocks(self) -> int:
        return math.ceil(self.tokens / self.block_size)

    @property
    def pool(self) -> int:
        """Blocks per side: ``pool_factor`` times the request (rounded to runs), by default twice, so patterns
        have room to scatter (1: a shuffled request takes every block, in random order)."""
        return max(RUN, math.ceil(self.pool_factor * self.blocks / RUN) * RUN)

    @property
    def token_bytes(self) -> int:
        return self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def request_bytes(self) -> int:
        return self.tokens * self.token_bytes * self.layers * 2


def block_ids(pattern: str, n: int, pool: int, rng: np.random.Generator) -> list[int]:
    """``n`` distinct block ids out of ``pool`` laid out as ``pattern``."""
    if pattern == "contiguous":
        return list(range(n))
    if pattern == "shuffled":
        return [int(b) for b in rng.permutation(pool)[:n]]
    if pattern == "runs16":
        starts = rng.permutation(pool // RUN)[: math.ceil(n / RUN)] * RUN
        return [int(s + i) for s in starts for i in range(RUN)][:n]
    raise ValueError(f"unknown block pattern {pattern!r}; choose from {', '.join(PATTERNS)}")


# -- the two processes --------------------------------------------------------------------


def _cache(shape: Shape, seed: int | None) -> np.ndarray:
    dims = (shape.layers, 2, shape.pool, shape.block_size, shape.kv_heads, shape.head_dim * shape.dtype_bytes)
    if seed is None:
        arr = np.zeros(dims, dtype=np.uint8)
        arr.fill(0)  # its pages now, not in the first unpack (a GiB of first touches takes seconds)
        return arr
    n = math.prod(dims)
    if n % 8:
        return np.random.default_rng(seed).integers(0, 256, dims, dtype=np.uint8)
    # Random 64-bit words: several times faster than bytes, which a cache of gigabytes notices.
    return np.random.default_rng(seed).bit_generator.random_raw(n // 8).view(np.uint8).reshape(dims)


def _digest(arr: np.ndarray, blocks: list[int], tokens: int) -> str:
    """Hash of the request's tokens in token order: equal on P and D iff every byte arrived in place. Layer
    by layer: a copy of the whole request at once would double a large cache's memory."""
    h = hashlib.blake2b(digest_size=16)
    for layer in arr:
        sel = layer[:, blocks]
        h.update(np.ascontiguousarray(sel.reshape(2, -1, *sel.shape[3:])[:, :tokens]).data)
    return h.hexdigest()


def per_block_descriptors(src: Any, dst: Any, sblocks: list[int], dblocks: list[int], tokens: int) -> tuple:
    """One descriptor per (block, region): the uncoalesced push a naive connector posts.

    Both layouts must share block geometry (the benchmark's P and D do).
    """
    assert (src.block_size, src.block_bytes, src.order) == (dst.block_size, dst.block_bytes, dst.order)
    n = math.ceil(tokens / src.block_size)
    lens = np.full(n, src.block_bytes, dtype=np.int64)
    lens[-1] = (tokens - (n - 1) * src.block_size) * src.token_bytes
    sb, db = np.asarray(sblocks[:n], np.int64), np.asarray(dblocks[:n], np.int64)
    local = np.empty((len(src.regions) * n, 3), dtype=np.int64)
    remote = np.empty_like(local)
    for i, (rs, rd) in enumerate(zip(src.regions, dst.regions, strict=True)):
        rows = slice(i * n, (i + 1) * n)
        local[rows, 0], local[rows, 1], local[rows, 2] = rs.base + sb * src.block_stride, lens, rs.device_id
        remote[rows, 0], remote[rows, 1], remote[rows, 2] = rd.base + db * dst.block_stride, lens, rd.device_id
    return local, remote


def _core(name: str) -> ModuleType:
    """``kvpush.core.NAME`` in the side's tree, or ``kvpush.NAME`` in a tree from before the package layout
    (``--tree`` A/B against an older commit: its modules lay flat in ``kvpush/``)."""
    try:
        return importlib.import_module(f"kvpush.core.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"kvpush.{name}")


class _Side:
    """State of the P or D process: its cache, the engine or raw agent of the current plan."""

    def __init__(
        self, role: str, shape: Shape, seed: int | None, nixl_backends: tuple[str, ...], knobs: dict[str, int]
    ) -> None:
        from kvpush.backends.base import CacheSpec
        from kvpush.backends.host import HostBackend

        self.role, self.shape, self.nixl_backends, self.knobs = role, shape, nixl_backends, knobs
        if knobs.get("min_part_bytes") is not None:
            # A bench knob: lets small payloads be cut into parts, so per-part costs show without big copies.
            # kvpush.core.parts holds it; trees before that module, kvpush.core.plan or kvpush.plan.
            try:
                _core("parts").MIN_PART_BYTES = knobs["min_part_bytes"]
            except ModuleNotFoundError:
                _core("plan").MIN_PART_BYTES = knobs["min_part_bytes"]
        self.cache = _cache(shape, seed)
        self.backend = HostBackend()
        spec = CacheSpec(shape.block_size, shape.kv_heads, shape.head_dim * shape.dtype_bytes, "bfloat16")
        self.layout = self.backend.describe({f"layer{i}": self.cache[i] for i in range(shape.layers)}, spec)
        self.engines: dict[str, Any] = {}
        self.busy = busy_gil.BusyLoop()
        self.agent: Any = None
        self.peer = ""
        self.peer_layout: Any = None

    def _config(self, plan: str) -> Any:
        from kvpush.config import Config

        keys = transfer_plans.config_keys(Config)
        flat = transfer_plans.flat_config(plan, self.shape.request_bytes, self.nixl_backends, self.knobs, keys)
        return Config.from_dict(flat)

    def op_start(self, plan: str) -> Any:
        from kvpush.engine import Receiver, Sender
        from kvpush.transport.nixl_agent import Agent

        if plan == "per-block":
            self.agent = Agent(f"bench-{self.role}-{os.getpid()}", self.nixl_backends)
            self.agent.register(self.backend.registrations(self.layout))
            return self.agent.metadata(), _enc(self.layout)
        cls = Sender if self.role == "P" else Receiver
        name = f"bench{self.role}{plan.replace(':', '')}"
        self.engines[plan] = engine = cls(self._config(plan), self.backend, self.layout, name)
        if self.role == "D" and plan == "staged":
            transfer_plans.one_slot(engine)
        return getattr(engine, "address", None)

    def op_gil(self, kind: str, interval_ms: float) -> None:
        """Switch this process to a GIL mode (``busy_gil``): which busy loop runs, the switch interval."""
        busy_gil.apply(self.busy, kind, interval_ms)

    def op_stop(self) -> None:
        self.busy.stop()
        for e in self.engines.values():
            e.close()
        if self.agent is not None:
            self.agent.close()
        self.engines, self.agent = {}, None

    def op_raw_peer(self, metadata: bytes, layout: bytes) -> None:
        KVLayout = _core("layout").KVLayout

        self.peer = self.agent.add_peer(metadata)
        self.peer_layout = _dec(layout, KVLayout)

    def op_pump(self, seconds: float) -> None:
        """Progress the raw agent for a while: over LIBFABRIC's tcp provider, loading this agent's metadata
        on P completes only once this agent has progressed (docs/libfabric.md)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.agent.notifs()
            time.sleep(0.001)

    def op_clear(self) -> None:
        self.cache.fill(0)

    def op_digest(self, blocks: list[int]) -> str:
        return _digest(self.cache, blocks, self.shape.tokens)

    # P ----------------------------------------------------------------------
    def op_push(self, plan: str, tid: str, blocks: list[int], timeout: float, order: str) -> dict[str, Any]:
        """Wait until D's registration is here, then (``registered``) hand the prefill over, or (``ahead``)
        announce it, wait until P paired and planned, and report its KV ready; wait for the release."""
        engine = self.engines[plan]
        deadline = time.monotonic() + timeout
        self._until(engine, "waiting_registrations", tid, "D's registration never reached P", deadline)
        self.cpu0 = _engine_cpu(engine)
        if order == "ahead":
            engine.prefill_started(tid, tid, [blocks], self.shape.tokens)
            self._until(engine, "in_flight", tid, "P never paired the registration", deadline)
            t0 = time.monotonic()
            if hasattr(engine, "forward_done"):
                engine.forward_done([tid])
            else:  # a kvpush tree before forward_done (``--tree`` A/B against an old commit)
                engine.kv_ready([tid], len(self.layout.regions))
        else:
            t0 = time.monotonic()
            engine.prefill_finished(tid, tid, [blocks], self.shape.tokens)
        return {"t0": t0, **self.op_released(plan, tid, deadline - time.monotonic())}

    def op_park(self, plan: str, tid: str, blocks: list[int], timeout: float) -> None:
        """Hand over a finished prefill nobody registered for yet, and wait until P parked it."""
        engine = self.engines[plan]
        engine.prefill_finished(tid, tid, [blocks], self.shape.tokens)
        self._until(engine, "parked_prefills", tid, "P never parked the prefill", time.monotonic() + timeout)
        self.cpu0 = _engine_cpu(engine)

    def op_released(self, plan: str, tid: str, timeout: float) -> dict[str, Any]:
        """P's result for ``tid`` once it let go of the blocks."""
        engine = self.engines[plan]
        deadline = time.monotonic() + timeout
        while True:
            for r in engine.poll():
                if r.transfer_id == tid:
                    cpu = _engine_cpu(engine) - getattr(self, "cpu0", 0.0)
                    times = {**_times(r.times, "p_"), **stages.part_times(r.times, "p_")}
                    out = {"ok": r.ok, "reason": r.reason, "times": times, "cpu": cpu}
                    return {**out, **_record(r.stats)}
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tid}: P never released the request")
            time.sleep(0.0005)

    @staticmethod
    def _until(engine: Any, gauge: str, tid: str, what: str, deadline: float) -> None:
        while engine.stats()[gauge] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tid}: {what}")
            time.sleep(0.0002)

    def op_raw_push(self, tag: str, sblocks: list[int], dblocks: list[int], timeout: float) -> dict[str, Any]:
        XferState = _core("outcome").XferState

        t0 = time.monotonic()
        c0 = time.perf_counter()
        local, remote = per_block_descriptors(self.layout, self.peer_layout, sblocks, dblocks, self.shape.tokens)
        c1 = time.perf_counter()
        handle = self.agent.prepare_write(local, "DRAM", remote, "DRAM", self.peer, tag.encode())
        state = self.agent.post(handle)
        c2 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while state is XferState.PROC:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: WRITE still in progress after {timeout}s")
            time.sleep(0.0002)
            state = self.agent.state(handle)
        c3 = time.perf_counter()
        self.agent.release(handle)
        nbytes = int(local[:, 1].sum())
        return {
            "t0": t0,
            "ok": state is XferState.DONE,
            "reason": "" if state is XferState.DONE else f"WRITE state {state.value}",
            "plan_s": c1 - c0,
            "pack_s": 0.0,
            "post_s": c2 - c1,
            "complete_s": c3 - c2,
            "bytes": float(nbytes),
            "pieces": float(local.shape[0]),
            "descriptors": float(local.shape[0]),
            "plan": "per-block",
        }

    # D ----------------------------------------------------------------------
    def op_register(self, plan: str, tid: str, peer: tuple[str, int], blocks: list[int]) -> float:
        """Register; returns when it was asked (the start of a ``finished`` transfer)."""
        from kvpush.engine import PeerAddress

        try:
            from kvpush.transport.key_set import session_capability
        except ModuleNotFoundError:  # a tree from before the key set had its own module
            from kvpush.transport.auth import session_capability

        cap = session_capability(tid)  # the harness plays the router
        self.cpu0 = _engine_cpu(self.engines[plan])
        t0 = time.monotonic()
        self.engines[plan].register(
            tid, tid, PeerAddress(peer[0], peer[1], 1), [blocks], self.shape.tokens, capability=cap
        )
        return t0

    def op_wait(self, plan: str, tid: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in self.engines[plan].poll():
                if r.transfer_id == tid:
                    done = _times(r.times, "").get("result") or time.monotonic()
                    times = {**_times(r.times, "d_"), **stages.part_times(r.times, "d_")}
                    out = {"t_done": done, "t_sent": times.get("d_sent"), "ok": r.ok, "reason": r.reason}
                    out["cpu"] = _engine_cpu(self.engines[plan]) - getattr(self, "cpu0", 0.0)
                    return {**out, **_record(r.stats), "times": times}
            time.sleep(0.0002)
        counts = {k: v for k, v in self.engines[plan].stats().items() if v}
        raise TimeoutError(f"{tid}: D saw no result in {timeout}s; D's engine: {counts}")

    def op_wait_notif(self, tag: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, msg in self.agent.notifs(drain=True):  # a WRITE is in flight to us
                if msg == tag.encode():
                    return {"t_done": time.monotonic(), "ok": True, "reason": ""}
            time.sleep(0.0002)
        raise TimeoutError(f"{tag}: D saw no notification in {timeout}s")


def _engine_cpu(engine: Any) -> float:
    """CPU seconds the engine's thread has used (its host work, whatever the load on the host). The thread is
    found by the name every tree's engine gives it (``kvpush-`` and the engine's name), not in its fields."""
    name = f"kvpush-{engine.name}"
    thread = next((t for t in threading.enumerate() if t.name == name), None)
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        return 0.0


def _record(rec: Any) -> dict[str, Any]:
    """A result's stats as a dict (typed records since the redesign, plain dicts before). With the part count:
    ``as_dict`` leaves ``parts`` out (meant for the per-part times, it drops the stats' count too)."""
    if isinstance(rec, dict):
        return dict(rec)
    parts = getattr(rec, "parts", None)
    return {**rec.as_dict(), **({"parts": parts} if isinstance(parts, int) else {})}


def _times(rec: Any, prefix: str) -> dict[str, float]:
    """A result's stage times (``time.monotonic()``) that are set, their names prefixed."""
    d = dict(rec) if isinstance(rec, dict) else rec.as_dict()
    return {prefix + k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and v}


def _enc(obj: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(obj)


def _dec(data: bytes, typ: type) -> Any:
    import msgspec

    return msgspec.msgpack.decode(data, type=typ)


def _side_main(
    conn: Connection,
    role: str,
    shape: Shape,
    seed: int | None,
    nixl_backends: tuple[str, ...],
    knobs: dict[str, int],
) -> None:
    """Process entry: build the side, then answer ``(op, args)`` commands until ``exit``."""
    import traceback

    try:
        side = _Side(role, shape, seed, nixl_backends, knobs)
        conn.send(("ok", None))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        op, args = conn.recv()
        if op == "exit":
            side.op_stop()
            conn.send(("ok", None))
            conn.close()
            # Everything is closed; skip the interpreter's slow teardown of NIXL/UCX globals (~3 s).
            os._exit(0)
        try:
            conn.send(("ok", getattr(side, f"op_{op}")(*args)))
        except Exception:
            conn.send(("err", f"{role}.{op}:\n{traceback.format_exc()}"))


class _Proc:
    """Handle on one side's process; ``send``/``recv`` split a call so both sides can wait at once."""

    def __init__(
        self,
        role: str,
        shape: Shape,
        seed: int | None,
        nixl_backends: tuple[str, ...],
        knobs: dict[str, int] | None = None,
        tree: str | None = None,
    ) -> None:
        from kvpush_tools.demo.servers import export_temp_keys

        export_temp_keys()  # the side's engines authenticate (the spawned process inherits the variable)
        ctx = mp.get_context("spawn")
        self.role = role
        self.conn, child = ctx.Pipe()
        args = (child, role, shape, seed, nixl_backends, knobs or {})
        self.proc = ctx.Process(target=_side_main, args=args, daemon=True)
        # A spawned process starts with this one's sys.path: with ``tree`` first, it imports that kvpush.
        saved = list(sys.path)
        if tree is not None:
            sys.path.insert(0, os.path.abspath(tree))
        try:
            self.proc.start()
        finally:
            sys.path[:] = saved

    def send(self, op: str, *args: Any) -> None:
        self.conn.send((op, args))

    def recv(self, timeout: float = 600.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.role} process did not answer in {timeout:.0f}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5.0)
            raise RuntimeError(f"{self.role} process died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"{self.role} process failed: {value}")
        return value

    def call(self, op: str, *args: Any, timeout: float = 600.0) -> Any:
        self.send(op, *args)
        return self.recv(timeout)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=30.0)
        except Exception:
            pass
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()


# -- orchestration ------------------------------------------------------------------------


def _one(
    p: _Proc, d: _Proc, case: tuple[str, str], tid: str, sblocks: list[int], dblocks: list[int], addr: Any
) -> dict:
    """One measured transfer of ``case`` (plan, order); times are seconds, ``total_s`` from the order's
    start (P's hand-over, D's register call, or P's KV ready) to D's result."""
    plan, order = case
    timeout = 120.0
    if plan == "per-block":
        d.send("wait_notif", tid, timeout)
        ps = p.call("raw_push", tid, sblocks, dblocks, timeout)
        ds = d.recv()
    elif order == "finished":
        p.call("park", plan, tid, sblocks, timeout)
        t0 = d.call("register", plan, tid, addr, dblocks)
        d.send("wait", plan, tid, timeout)
        ps = {"t0": t0, **p.call("released", plan, tid, timeout)}
        ds = d.recv()
    else:
        d.call("register", plan, tid, addr, dblocks)
        d.send("wait", plan, tid, timeout)
        ps = p.call("push", plan, tid, sblocks, timeout, order)
        try:
            ds = d.recv()
        except RuntimeError as exc:  # D saw nothing: what P said of the same push
            keep = ("ok", "reason", "plan", "parts", "descriptors", "bytes")
            raise RuntimeError(f"{exc}\nP's result: { ({k: ps.get(k) for k in keep}) }") from None
    if not (ps["ok"] and ds["ok"]):
        raise RuntimeError(f"{tid} failed: P: {ps.get('reason')!r}, D: {ds.get('reason')!r}")
    return {
        "plan_chosen": str(ps.get("plan", "?")),
        "bytes": int(ps["bytes"]),
        "pieces": int(ps["pieces"]),
        "descriptors_posted": int(ps["descriptors"]),
        "parts": int(ps.get("parts") or 0),
        "prep_s": ps.get("plan_s", 0.0),
        "pack_s": ps.get("pack_s", 0.0),
        "post_s": ps.get("post_s", 0.0),
        "complete_s": ps.get("complete_s", 0.0),
        "unpack_s": ds.get("unpack_s", 0.0),
        # finished: D's work from its register call to the Register leaving (on the path in that order only)
        "register_s": max(0.0, ds["t_sent"] - ps["t0"]) if order == "finished" and ds.get("t_sent") else 0.0,
        "total_s": ds["t_done"] - ps["t0"],
        # CPU time of P's engine thread (from the hand-over, the registration, or the announce, to the
        # release) and D's (from the register call to the result): host work, not waiting
        "p_cpu_s": ps.get("cpu", 0.0),
        "d_cpu_s": ds.get("cpu", 0.0),
        # P's and D's stage times after the order's start (the H200 bench's ``timeline_median``)
        **{f"at_{k}_s": v - ps["t0"] for k, v in {**ps.get("times", {}), **ds.get("times", {})}.items()},
    }


def _summary(pattern: str, case: tuple[str, str], runs: list[dict], shape: Shape, verified: bool) -> dict[str, Any]:
    keys = dict.fromkeys(k for r in runs for k in r if k.endswith("_s"))
    med = {k: statistics.median(r[k] for r in runs if k in r) for k in keys}
    total = med["total_s"]
    blocks_layers = shape.blocks * shape.layers * 2
    return {
        "pattern": pattern,
        "plan": case[0],
        "order": case[1],
        "plan_chosen": runs[-1]["plan_chosen"],
        "bytes": runs[-1]["bytes"],
        "descriptors_before": blocks_layers,
        "descriptors_after": runs[-1]["descriptors_posted"],
        "pieces": runs[-1]["pieces"],
        "parts": runs[-1].get("parts", 0),
        **{f"{k}_median": v for k, v in med.items()},
        "total_s_min": min(r["total_s"] for r in runs),
        "total_s_max": max(r["total_s"] for r in runs),
        "gbps": runs[-1]["bytes"] / total / 1e9 if total > 0 else float("inf"),
        # the run whose total is the median: its phases add up, unlike per-phase medians
        "median_run": sorted(runs, key=lambda r: r["total_s"])[(len(runs) - 1) // 2],
        "verified": verified,
        "iters": runs,
    }


def _progress(total: int, quiet: bool) -> Any:
    """A tqdm bar when tqdm is installed, else a one-line counter on stderr."""
    if quiet:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="xfer", file=sys.stderr, leave=False)
    except ImportError:

        class _Line:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"\r{self.n}/{total} transfers", end="", file=sys.stderr, flush=True)

            def set_description(self, s: str) -> None:
                pass

            def close(self) -> None:
                print(file=sys.stderr)

        return _Line()


def transports(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The NIXL backend sets to compare: one per ``--nixl-backend``, else the agents' ``--nixl-backends``."""
    return [(b,) for b in args.nixl_backend] if args.nixl_backend else [tuple(args.nixl_backends)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (transport, pattern, plan) case, each transport in its own two fresh processes; return the report.

    Cases are interleaved round-robin (transports, patterns, plans, GIL modes), so that load from other
    processes on a shared host spreads over every case instead of biasing whichever ran then."""
    pool = 2.0 if args.pool_factor is None else args.pool_factor
    shape = Shape(args.tokens, args.layers, args.kv_heads, args.head_dim, args.dtype_bytes, args.block_size, pool)
    rng = np.random.default_rng(args.seed)
    patterns = {
        pat: (block_ids(pat, shape.blocks, shape.pool, rng), block_ids(pat, shape.blocks, shape.pool, rng))
        for pat in args.patterns
    }
    nets = transports(args)
    knobs = {"push_parts": args.push_parts, "min_part_bytes": args.min_part_bytes, "part_cost_us": args.part_cost_us}
    knobs |= {"ring_bytes": args.ring_bytes, "ring_slots": args.ring_slots, "peer_dead_s": args.peer_dead_s}
    modes = busy_gil.modes(args)
    # A lane: one transport in one kvpush tree (``--tree``: this checkout's engine against another's, side by side)
    lanes = [(tree, t) for tree in (args.tree or [None]) for t in nets]
    load_start = os.getloadavg()
    pairs = {
        (tree, t): (_Proc("P", shape, args.seed, t, knobs, tree), _Proc("D", shape, None, t, knobs, tree))
        for tree, t in lanes
    }
    kinds = [(plan, "") if plan == "per-block" else (plan, o) for plan in args.plans for o in args.orders]
    ms = modes or [None]
    cases = [(t, pat, kind, m) for t in lanes for pat in patterns for kind in dict.fromkeys(kinds) for m in ms]
    bar = _progress(len(cases) * (args.iters + args.warmup + 1), args.quiet)
    runs: dict[tuple[Any, str, tuple[str, str], Any], list[dict[str, Any]]] = {c: [] for c in cases}
    addrs: dict[tuple[Any, str], Any] = {}
    now: dict[Any, busy_gil.Mode] = {}  # each lane's GIL mode
    p_digests: dict[tuple[Any, str], str] = {}
    try:
        for p, d in pairs.values():
            p.recv(300.0)
            d.recv(300.0)
        for t, (p, d) in pairs.items():
            for plan in args.plans:
                addrs[t, plan] = p.call("start", plan)
                d_start = d.call("start", plan)
                if plan == "per-block":
                    d.send("pump", 1.0)
                    p.call("raw_peer", *d_start)
                    d.recv()
        for i in range(args.warmup + args.iters):
            for t, pat, kind, m in cases:
                p, d = pairs[t]
                sblocks, dblocks = patterns[pat]
                name = "-".join(x for x in (*kind, pat, m.label if m else "") if x)
                if bar is not None:
                    bar.set_description(f"{_lane(t)} {name}")
                busy_gil.switch((p, d), now, t, m)
                r = _one(p, d, kind, f"{name}-{i}", sblocks, dblocks, addrs[t, kind[0]])
                if i >= args.warmup:
                    runs[t, pat, kind, m].append(r)
                if bar is not None:
                    bar.update(1)
        # One more, unmeasured transfer per case into a zeroed cache, then
        # compare: a plan that is fast because it moved the wrong bytes fails.
        for t, pat, kind, m in cases:
            p, d = pairs[t]
            sblocks, dblocks = patterns[pat]
            busy_gil.switch((p, d), now, t, m)
            d.call("clear")
            name = "-".join(x for x in (*kind, pat, m.label if m else "") if x)
            _one(p, d, kind, f"{name}-verify", sblocks, dblocks, addrs[t, kind[0]])
            if (t, pat) not in p_digests:
                p_digests[t, pat] = p.call("digest", sblocks)
            if d.call("digest", dblocks) != p_digests[t, pat]:
                raise RuntimeError(f"{_lane(t)} {name}: D's bytes differ from P's after the transfer")
            if bar is not None:
                bar.update(1)
        for p, d in pairs.values():
            p.call("stop")
            d.call("stop")
    finally:
        if bar is not None:
            bar.close()
        for p, d in pairs.values():
            p.close()
            d.close()
    results = [
        {"nixl": _lane(t), **(m.fields() if m else {}), **_summary(pat, kind, runs[t, pat, kind, m], shape, True)}
        for t, pat, kind, m in cases
    ]
    order_ratios(results)
    return {
        "benchmark": "kvpush bench transfer",
        "command": " ".join(["kvpush bench transfer", *args.argv]),
        "shape": {**asdict(shape), "blocks": shape.blocks, "pool_blocks": shape.pool, "bytes": shape.request_bytes},
        "iters": args.iters,
        "warmup": args.warmup,
        "nixl_backends": list(dict.fromkeys(b for t in nets for b in t)),
        "transports": ["+".join(t) for t in nets],
        "trees": {_lane(lane): os.path.abspath(lane[0]) for lane in lanes if lane[0]},
        "push_parts": args.push_parts,
        "min_part_bytes": args.min_part_bytes,
        "ring_bytes": args.ring_bytes or transfer_plans.RING_BYTES,
        "peer_dead_s": args.peer_dead_s,
        "gil_modes": [m.label for m in modes or []],
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "nixl": _version("nixl"),
            "note": "P and D are two processes per transport on one host (loopback); NIXL progress thread off",
            # other work on the host skews every number: say how busy it was
            "loadavg_1m_start": load_start[0],
            "loadavg_1m_end": os.getloadavg()[0],
        },
        "time_unix": time.time(),
        "results": results,
    }


def _lane(lane: tuple[str | None, tuple[str, ...]]) -> str:
    """A lane's label: its transport, and the kvpush tree it runs when several are compared."""
    tree, t = lane
    return "+".join(t) + (f"@{Path(tree).resolve().name}" if tree else "")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def table(report: dict[str, Any]) -> str:
    """The report as a fixed-width text table (medians; times in ms)."""
    head = (
        f"{'nixl':<11}{'pattern':<11}{'plan':<11}{'order':<11}{'chosen':<8}{'MiB':>7}{'desc before':>12}{'after':>8}"
        f"{'prep':>8}{'pack':>8}{'post':>8}{'done':>8}{'unpack':>8}{'total':>9}{'GB/s':>7}"
    )
    gil = any("gil" in r for r in report["results"])
    head += f"{'  GIL mode':<13}" if gil else ""
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        ms = {k: 1e3 * r[f"{k}_s_median"] for k in ("prep", "pack", "post", "complete", "unpack", "total")}
        lines.append(
            f"{r.get('nixl', '+'.join(report['nixl_backends'])):<11}"
            f"{r['pattern']:<11}{r['plan']:<11}{r.get('order', ''):<11}{r['plan_chosen']:<8}{r['bytes'] / 2**20:>7.0f}"
            f"{r['descriptors_before']:>12}{r['descriptors_after']:>8}"
            f"{ms['prep']:>8.1f}{ms['pack']:>8.1f}{ms['post']:>8.1f}{ms['complete']:>8.1f}{ms['unpack']:>8.1f}"
            f"{ms['total']:>9.1f}{r['gbps']:>7.2f}" + (f"  {r.get('gil', '')}" if gil else "")
        )
    for r in report["results"]:
        if "x_ahead" in r:
            lines.append(
                f"{r.get('nixl', '')} {r['pattern']} {r['plan']}: D registering after P finished takes "
                f"{r['x_ahead']:.2f}x the time of D registered ahead ({1e3 * r['total_s_median']:.2f} ms)"
            )
    return "\n".join(lines)


def timeline_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """Each engine case's median stage times (ms after its start), labelled, for ``stages``."""
    rows = []
    for r in report["results"]:
        marks = stages.medians_ms(r)
        if marks:
            label = f"{r.get('nixl', '')} {r['pattern']} {r['plan']}/{r.get('order', '')} ({r['plan_chosen']})"
            label += f" {r['gil']}" if "gil" in r else ""
            rows.append((label.strip(), marks))
    return rows


def order_ratios(results: list[dict[str, Any]]) -> None:
    """Mark each ``finished`` case with its total over the ``ahead`` case of the same transport, pattern, plan
    and GIL mode."""
    ahead = {
        (r.get("nixl"), r["pattern"], r["plan"], r.get("gil")): r["total_s_median"]
        for r in results
        if r.get("order") == "ahead"
    }
    for r in results:
        key = (r.get("nixl"), r["pattern"], r["plan"], r.get("gil"))
        if r.get("order") == "finished" and ahead.get(key):
            r["x_ahead"] = r["total_s_median"] / ahead[key]


def _csv(kind: tuple[str, ...]) -> Any:
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in kind]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(kind)} (got {s!r})")
        return items

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush bench transfer",
        description="Push one long-prompt request between two processes over real NIXL, per plan and block pattern.",
    )
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096: 128 MiB per request)")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=1, help="KV heads on this rank (Qwen3-32B TP8: 1)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element (bf16: 2)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--patterns", type=_csv(PATTERNS), default=list(PATTERNS))
    ap.add_argument("--plans", type=_csv(PLANS), default=list(PLANS))
    ap.add_argument(
        "--orders",
        type=_csv(ORDERS),
        default=["registered"],
        help="when D registers: registered (before P's prefill is handed over; P plans then), finished (after "
        "it: a sequential router), ahead (while P computes: P plans before the KV is ready); several compare",
    )
    ap.add_argument("--iters", type=int, default=5, help="measured transfers per case (medians reported)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured transfers per case first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--nixl-backends", type=lambda s: s.split(","), default=["UCX"], help="the agents' NIXL backends (default UCX)"
    )
    ap.add_argument(
        "--nixl-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="compare NIXL backends: every case over each (repeatable, e.g. --nixl-backend UCX --nixl-backend "
        "LIBFABRIC; LIBFABRIC needs its libraries on LD_LIBRARY_PATH: tools/libfabric/setup.sh --ld-path)",
    )
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="PATH",
        help="run the engine of this kvpush tree (repeatable: trees side by side, cases taking turns)",
    )
    ap.add_argument("--push-parts", type=int, default=None, help="the engines' push_parts (default: kvpush's)")
    ap.add_argument(
        "--min-part-bytes",
        type=int,
        default=None,
        help="smallest part of a staged push (config min_part_bytes; lower it to cut small payloads into parts)",
    )
    ap.add_argument(
        "--part-cost-us",
        type=float,
        default=None,
        help="the cost model's fixed cost of a part (config part_cost_us; 0: always --push-parts parts)",
    )
    transfer_plans.add_arguments(ap)
    busy_gil.add_arguments(ap)
    transfer_sizes.add_arguments(ap)
    ap.add_argument("--out", type=Path, default=Path("results/bench_transfer"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpush bench transfer``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.tokens < 1 or args.iters < 1:
        print("--tokens and --iters must be >= 1", file=sys.stderr)
        return 2
    args.argv = argv
    args.plans = transfer_plans.expand(args.plans, args.ring_parts)
    if args.sizes:
        return transfer_sizes.main(args, run)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer_{args.tokens}tok"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    print("\nstage timeline (median ms after the start; ahead: P's KV ready, else the order's first call):")
    rows = timeline_rows(report)
    for label, marks in rows:
        print("\n".join(stages.lines(label, marks)))
    h = report["host"]
    print(f"(host load average {h['loadavg_1m_start']:.1f} -> {h['loadavg_1m_end']:.1f} on {h['cpus']} CPUs)")
    print(f"\nwrote {args.out / (stem + '.json')}", end="")
    if not args.no_plot:
        transfer_plot.plot(report, args.out / f"{stem}.png")
        stages.plot(rows, args.out / f"{stem}_timeline.png", f"kvpush bench transfer: {args.tokens} tokens, stages")
        print(f" and {args.out / (stem + '.png')}, {stem}_timeline.png", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
