"""P and D worker processes for the two-process part of the suite.

A worker hosts any number of kvpush engines (``Sender``s and ``Receiver``s),
each with its own backend instance and test cache, and runs the commands the
test process sends over a queue. One P and one D worker serve the whole
suite: the first NIXL agent of a process costs seconds (UCX start-up) while
later ones cost milliseconds, so a process per case would blow the budget.

Commands are ``(op, args)``; each runs ``Worker.op_<op>(*args)`` and answers
``("ok", value)`` or ``("err", traceback)``, so a failure inside a worker is
a test failure with the worker's traceback, not a hang. Workers are spawned
(never forked: a device runtime initialised in the test process must not be
inherited) and end by returning from ``worker_main``, so a backend that
leaves a non-daemon thread or crashes in interpreter teardown shows up as a
worker that does not exit 0.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.conformance.model import Geom, payload
from kvpush.conformance.target import Target
from kvpush.transport import key_set


class _Capture(logging.Handler):
    """Keeps exceptions that escaped into an engine loop (``log.exception``): always a bug."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.crashes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is not None:
            exc = "".join(traceback.format_exception(*record.exc_info))
            self.crashes.append(f"{record.name}: {record.getMessage()}\n{exc}")


@dataclass
class Rank:
    """One engine with the backend and cache it runs on (no engine: a peer copy's backend-only rank)."""

    engine: Any
    backend: Any
    kv: dict[str, Any]
    geom: Geom


class Worker:
    """State of one worker process."""

    def __init__(self, name: str, target: Target) -> None:
        self.name = name
        self.target = target
        self.ranks: dict[str, Rank] = {}
        self.capture = _Capture()
        logging.getLogger("kvpush").addHandler(self.capture)
        from kvpush.transport.nixl_agent import Agent

        self.warmup = Agent(f"conformance-warmup-{name}-{id(self)}", target.nixl_backends)
        """An agent started here to pay UCX's start-up in both workers at once, not in the first test; the
        NIXL backends, version and traits this worker's agents get are read from it."""

    def rank_backend(self, reference: bool) -> Any:
        """The backend a new rank runs on: the host backend for a reference rank, else the target's."""
        if reference:
            from kvpush.backends.host import HostBackend

            return HostBackend()
        return self.target.make()

    def rank_cache(self, backend: Any, geom: Geom, device: int, seed: int | None) -> dict[str, Any]:
        """The cache of a new rank, filled from ``seed``. A subclass may build
        its own (the engine tests' workers give D a sentinel, ``seed=None``)."""
        if seed is None:
            raise ValueError("the conformance worker fills every cache from a seed")
        kv = backend.make_test_cache(geom.spec(), geom.layers, geom.num_blocks, device)
        if len(kv) != geom.layers:
            raise AssertionError(f"make_test_cache gave {len(kv)} tensors for {geom.layers} layers")
        self._fill(backend, kv, geom, seed)
        # Setup, not a prefill: the cache holds its bytes before any engine sees it (D's blocks in particular
        # are never written by the model while P writes into them); only the ordering case writes late.
        # read_bytes returns after all earlier device work, and needs no describe first (record_ready may).
        for t in kv.values():
            backend.read_bytes(t)
        return kv

    @staticmethod
    def _fill(backend: Any, kv: dict[str, Any], geom: Geom, seed: int) -> None:
        data = payload(geom, seed)
        for i, t in enumerate(kv.values()):
            backend.write_bytes(t, data[i].reshape(-1))

    def engine_config(self, cfg: dict[str, Any]) -> Any:
        """A rank's engine configuration: ``cfg`` over this worker's NIXL backends and a free port."""
        from kvpush.config import Config

        # A free port per P rank unless the test names one: the default is vLLM's fixed 5600.
        return Config.from_dict({"nixl_backends": list(self.target.nixl_backends), "side_channel_port": 0, **cfg})

    def start_rank(
        self, key: str, kind: str, geom: Geom, cfg: dict[str, Any], engine_id: str, seed: int | None, ref: bool
    ) -> Any:
        """Start rank ``key``: a ``kind`` engine (``sender``/``receiver``) over a new cache of ``geom``."""
        from kvpush.engine import Receiver, Sender

        backend = self.rank_backend(ref)
        device = 0 if ref else (self.target.p_device if kind == "sender" else self.target.d_device)
        kv: dict[str, Any] = {}
        try:
            kv = self.rank_cache(backend, geom, device, seed)
            layout = backend.describe(kv, geom.spec())
            cls = Sender if kind == "sender" else Receiver
            engine = cls(self.engine_config(cfg), backend, layout, engine_id, rank=geom.tp_rank, tp_size=geom.tp_size)
        except BaseException:
            backend.free_test_cache(kv)
            backend.close()
            raise
        self.ranks[key] = Rank(engine, backend, kv, geom)
        return engine

    # -- ops -------------------------------------------------------------------
    def op_sender(
        self, key: str, geom: Geom, cfg: dict[str, Any], engine_id: str, seed: int, ref: bool = False
    ) -> tuple[str, int]:
        """A P rank over a cache filled from ``seed``; returns its side-channel address."""
        return self.start_rank(key, "sender", geom, cfg, engine_id, seed, ref).address

    def op_receiver(
        self, key: str, geom: Geom, cfg: dict[str, Any], engine_id: str, seed: int, ref: bool = False
    ) -> None:
        self.start_rank(key, "receiver", geom, cfg, engine_id, seed, ref)

    def op_prefill(self, key: str, tid: str, rid: str, blocks: list[int], n: int, rewrite: int | None = None) -> None:
        """Hand a finished prefill to P, with the marker the connector would take.

        ``rewrite``: first overwrite the whole cache with the payload of that
        seed, then record the marker and hand over at once: the ordering case.
        """
        r = self.ranks[key]
        if rewrite is not None:
            self._fill(r.backend, r.kv, r.geom, rewrite)
        marker = r.backend.record_ready()
        r.engine.prefill_finished(tid, rid, [blocks], n, ready=marker)

    def op_layered_prefill(self, key: str, tid: str, rid: str, blocks: list[int], n: int, rewrite: int) -> int:
        """Announce a prefill, then write the cache layer by layer, each followed by its marker and ``layer_written``.

        What the vLLM connector does in layer-wise mode: the payload of
        ``rewrite`` is written one layer at a time (queued like a model
        kernel), and after each layer P is told that layer's regions are ready
        under the marker recorded right after the write. Returns the layers.
        """
        r = self.ranks[key]
        data = payload(r.geom, rewrite)
        r.engine.prefill_started(tid, rid, [blocks], n)
        for i, t in enumerate(r.kv.values()):
            r.backend.write_bytes(t, data[i].reshape(-1))
            r.engine.layer_written([tid], i, r.backend.record_ready())
        return len(r.kv)

    def op_register(
        self, key: str, tid: str, rid: str, peer: tuple[str, int, int], blocks: list[int], n: int, start: int
    ) -> None:
        from kvpush.engine import PeerAddress

        cap = key_set.session_capability(tid)  # the harness plays the router
        self.ranks[key].engine.register(tid, rid, PeerAddress(*peer), [blocks], n, start, capability=cap)

    def op_results(self, key: str, count: int, timeout: float) -> list[Any]:
        """Up to ``count`` results within ``timeout`` s (fewer on timeout)."""
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out.extend(self.ranks[key].engine.poll())
            if len(out) < count:
                time.sleep(0.005)
        return out

    def op_stats(self, key: str) -> dict[str, Any]:
        return self.ranks[key].engine.stats()

    def op_wait_stat(self, key: str, name: str, at_least: float, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ranks[key].engine.stats().get(name, 0) >= at_least:
                return True
            time.sleep(0.005)
        return False

    def op_snapshot(self, key: str) -> np.ndarray:
        """The whole cache's logical bytes, read back through the backend."""
        r = self.ranks[key]
        layers = [np.asarray(r.backend.read_bytes(t), dtype=np.uint8).reshape(-1) for t in r.kv.values()]
        for i, raw in enumerate(layers):
            if raw.size != r.geom.layer_bytes:
                raise AssertionError(f"read_bytes of layer {i} gave {raw.size} bytes, expected {r.geom.layer_bytes}")
        return np.stack(layers).reshape(r.geom.shape())

    def op_peer_export(self, key: str, geom: Geom, seed: int) -> tuple[Any, bytes | None] | None:
        """D of a peer copy: rank ``key``, a cache of ``geom`` filled from ``seed`` and no engine; returns its
        layout and the backend's ``export_peer`` blob, or None when the backend has no ``PeerCopy``."""
        from kvpush.backends.peer import PeerCopy

        backend = self.target.make()
        if not isinstance(backend, PeerCopy):
            backend.close()
            return None
        kv: dict[str, Any] = {}
        try:
            kv = self.rank_cache(backend, geom, self.target.d_device, seed)
            layout = backend.describe(kv, geom.spec())
            blob = backend.export_peer(layout)
        except BaseException:
            backend.free_test_cache(kv)
            backend.close()
            raise
        self.ranks[key] = Rank(None, backend, kv, geom)
        return layout, blob

    def op_peer_copy(
        self, key: str, geom: Geom, seed: int, blob: bytes, d_layout: Any, reqs: list[tuple[Any, ...]]
    ) -> bool:
        """P of a peer copy: rank ``key`` over a cache of ``geom`` filled from ``seed``, no engine; opens D's
        ``blob`` and copies each request ``(P blocks, D blocks, tokens, start)`` as the engine would (the
        direct plan's merged pieces, one ``start_peer_copy`` each, all in flight before the first wait),
        then waits for every marker. False when ``open_peer`` answered None."""
        from kvpush.core.pieces import coalesce_in_dst_order, map_pieces

        backend = self.target.make()
        kv: dict[str, Any] = {}
        try:
            kv = self.rank_cache(backend, geom, self.target.p_device, seed)
            layout = backend.describe(kv, geom.spec())
        except BaseException:
            backend.free_test_cache(kv)
            backend.close()
            raise
        self.ranks[key] = Rank(None, backend, kv, geom)
        peer = backend.open_peer(blob, d_layout)
        if peer is None:
            return False
        try:
            markers = []
            src, dst = [r.base for r in layout.regions], [r.base for r in d_layout.regions]
            for p_blocks, d_blocks, n, start in reqs:
                pieces = coalesce_in_dst_order(map_pieces(layout, d_layout, p_blocks, d_blocks, n, start))
                if pieces.shape[0]:
                    markers.append(backend.start_peer_copy(peer, src, dst, pieces))
            for m in markers:
                backend.wait_ready(m)
        finally:
            backend.close_peer(peer)
        return True

    def op_peer_open(self, key: str, blob: bytes, d_layout: Any) -> str:
        """What rank ``key``'s backend answers to ``open_peer(blob, d_layout)``: ``"none"``, ``"handle"``
        (closed again at once), or ``"BackendError: ..."``; any other exception fails the op."""
        from kvpush.core.errors import BackendError

        backend = self.ranks[key].backend
        try:
            peer = backend.open_peer(blob, d_layout)
        except BackendError as exc:
            return f"BackendError: {exc}"
        if peer is None:
            return "none"
        backend.close_peer(peer)
        return "handle"

    def op_close(self, key: str) -> dict[str, Any]:
        """Close an engine (if the rank has one) and its backend; report what is left of them."""
        r = self.ranks.pop(key)
        report = {"registered_after_close": 0, "thread_alive": False}
        if r.engine is not None:
            name = f"kvpush-{r.engine.name}"
            r.engine.close()
            agent = getattr(r.engine, "agent", None)
            report = {
                "registered_after_close": agent.registered if agent is not None else 0,
                "thread_alive": any(t.name == name for t in threading.enumerate()),
            }
        r.backend.free_test_cache(r.kv)
        r.backend.close()
        return report

    def op_check(self, name: str, *args: Any) -> None:
        """Run one of ``kvpush.conformance.checks`` here, where NIXL is already loaded and warm."""
        from kvpush.conformance.checks import CHECKS

        CHECKS[name](self.target, *args)

    def op_leaks(self) -> dict[str, Any]:
        """Engines still open, threads that outlive them, exceptions that escaped engine loops.

        A thread counts when it is a kvpush engine thread, or any non-daemon
        thread but this one: such a thread keeps the process from exiting.
        """
        crashes, self.capture.crashes = self.capture.crashes, []
        main = threading.current_thread()
        threads = [t for t in threading.enumerate() if t is not main and (t.name.startswith("kvpush-") or not t.daemon)]
        return {"open_engines": sorted(self.ranks), "threads": sorted(t.name for t in threads), "crashes": crashes}

    def op_exit(self) -> dict[str, Any]:
        """Close whatever is open (reported as a leak first), then the warm-up agent."""
        report = self.op_leaks()
        for key in list(self.ranks):
            self.op_close(key)
        self.warmup.close()
        return report


def worker_main(
    name: str, target: Target, cmds: mp.Queue, answers: mp.Queue, worker_cls: type[Worker] = Worker
) -> None:
    """Entry point of a worker process (spawn target); returns after ``exit``.

    ``worker_cls`` lets another harness (``tests/helpers/procs.py``) run a subclass
    with ops of its own over the same command protocol.
    """
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    try:
        w = worker_cls(name, target)
    except BaseException:
        answers.put(("err", f"{name} failed to start:\n{traceback.format_exc()}"))
        return
    answers.put(("ok", "ready"))
    while True:
        op, args = cmds.get()
        try:
            answers.put(("ok", getattr(w, f"op_{op}")(*args)))
        except Exception:
            answers.put(("err", f"{name}.{op}{args!r:.300}:\n{traceback.format_exc()}"))
        if op == "exit":
            return


WorkerMain = Callable[[str, Target, mp.Queue, mp.Queue], None]
"""A worker process's entry point: ``(name, target, commands, answers)``."""


class Node:
    """Test-side handle of one worker process.

    ``main`` is the process's entry point, :func:`worker_main` unless another
    harness brings its own (a module-level function, so spawn can import it).
    """

    def __init__(self, name: str, target: Target, main: WorkerMain = worker_main) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.cmds: mp.Queue = ctx.Queue()
        self.answers: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=main, args=(name, target, self.cmds, self.answers), daemon=True)
        self.proc.start()
        self._ready = False
        self.exit_report: dict[str, Any] | None = None

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self._ready:
            self.answer(timeout)
            self._ready = True

    def call(self, op: str, *args: Any, timeout: float = 60.0) -> Any:
        """Run ``op`` in the worker and return its answer."""
        self.send(op, *args)
        return self.answer(timeout)

    def send(self, op: str, *args: Any) -> None:
        """Start ``op`` without waiting for its answer (``answer`` collects it): for a call during which the
        worker may stop itself, whose answer then only leaves once it runs again."""
        self.wait_ready()
        self.cmds.put((op, args))

    def answer(self, timeout: float = 60.0) -> Any:
        """The answer of the op ``send`` started (the first one not collected yet)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, value = self.answers.get(timeout=0.2)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"worker {self.name} died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {self.name} did not answer in {timeout}s") from None
        if status != "ok":
            raise RuntimeError(f"worker {self.name} failed: {value}")
        return value

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ask the worker to close everything and return; kill it if it does not. Returns its exit code."""
        if self.proc.is_alive() and self.exit_report is None:
            try:
                self.exit_report = self.call("exit", timeout=timeout)
            except Exception as exc:
                self.exit_report = {"error": str(exc)}
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
            return None  # did not exit by itself
        return self.proc.exitcode


class Pair:
    """The P worker and the D worker shared by every two-process case of a suite run."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.p = Node("P", target)
        self.d = Node("D", target)
        self.exit_codes: tuple[int | None, int | None] | None = None

    def ready(self) -> tuple[Node, Node]:
        self.p.wait_ready()
        self.d.wait_ready()
        return self.p, self.d

    def stop(self) -> tuple[int | None, int | None]:
        if self.exit_codes is None:
            self.exit_codes = (self.p.stop(), self.d.stop())
        return self.exit_codes
