"""Spawn-able worker processes for the multi-process NIXL tests.

A worker hosts any number of kvpush engines (``Sender``s and ``Receiver``s),
each over its own host KV cache, and runs commands that the test process sends
over a queue. The tests keep one P worker and one D worker alive for the whole
module because the first NIXL/UCX agent of a process costs ~4 s to start while
later ones cost ~50 ms: one process per case would blow the time budget.

Commands are ``(op, args)`` tuples; each runs ``Worker.op_<op>(*args)`` and
answers ``("ok", value)`` or ``("err", traceback)``, so a failure inside a
worker surfaces as a test failure with the worker's traceback, not a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

SENTINEL = 0xA5
"""Byte that fills D's caches before a test: any block D did not register must still hold it."""


@dataclass(frozen=True)
class Geom:
    """Shape of one rank's test KV cache; arrays are uint8 with ``head_dim`` bytes per head.

    ``dtype`` is only the *label* the layout carries (peers compare it); the
    buffers are bytes of the same size, which is all a transfer sees.
    """

    layers: int = 3
    num_blocks: int = 64
    block_size: int = 16
    num_heads: int = 4
    head_dim: int = 16
    order: str = "NHD"
    dtype: str = "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def local_heads(self) -> int:
        return max(1, self.num_heads // self.tp_size)

    @property
    def head_start(self) -> int:
        return (self.tp_rank * self.local_heads) % self.num_heads

    def shape(self) -> tuple[int, ...]:
        """``(layers, K/V, blocks, *block)`` with the block in NHD or HND order."""
        blk = (
            (self.block_size, self.local_heads, self.head_dim)
            if self.order == "NHD"
            else (self.local_heads, self.block_size, self.head_dim)
        )
        return (self.layers, 2, self.num_blocks, *blk)


def make_cache(geom: Geom, seed: int | None) -> np.ndarray:
    """Random bytes (P, from ``seed``) or the sentinel everywhere (D, ``seed=None``)."""
    if seed is None:
        return np.full(geom.shape(), SENTINEL, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, geom.shape(), dtype=np.uint8)


class _Capture(logging.Handler):
    """Keeps kvpush's warnings so the test can assert what an engine complained about."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.crashes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.name}: {record.getMessage()}"
        self.lines.append(line)
        if record.exc_info is not None:
            # an exception escaped into the engine loop (``log.exception``): always a bug
            self.crashes.append(line + "\n" + "".join(traceback.format_exception(*record.exc_info)))


class Worker:
    """State of one worker process: engines by key, their caches, captured logs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.engines: dict[str, Any] = {}
        self.caches: dict[str, np.ndarray] = {}
        self.agents: list[Any] = []
        self.retired: list[Any] = []
        self.capture = _Capture()
        logging.getLogger("kvpush").addHandler(self.capture)
        logging.getLogger("kvpush").setLevel(logging.INFO)

    def _build(self, geom: Geom, seed: int | None) -> tuple[Any, Any, np.ndarray]:
        from kvpush.backends.base import CacheSpec
        from kvpush.backends.host import HostBackend

        arr = make_cache(geom, seed)
        be = HostBackend()
        spec = CacheSpec(
            geom.block_size, geom.num_heads, geom.head_dim, geom.dtype, geom.tp_rank, geom.tp_size, geom.order
        )
        layout = be.describe({f"layer{i}": arr[i] for i in range(geom.layers)}, spec)
        return be, layout, arr

    def op_sender(self, key: str, geom: Geom, cfg: dict[str, Any], engine_id: str, seed: int) -> tuple[str, int]:
        from kvpush.config import Config
        from kvpush.engine import Sender

        be, layout, arr = self._build(geom, seed)
        s = Sender(Config.from_dict(cfg), be, layout, engine_id, rank=geom.tp_rank, tp_size=geom.tp_size)
        self.engines[key], self.caches[key] = s, arr
        return s.address

    def op_receiver(self, key: str, geom: Geom, cfg: dict[str, Any], engine_id: str) -> None:
        from kvpush.config import Config
        from kvpush.engine import Receiver

        be, layout, arr = self._build(geom, None)
        r = Receiver(Config.from_dict(cfg), be, layout, engine_id, rank=geom.tp_rank, tp_size=geom.tp_size)
        self.engines[key], self.caches[key] = r, arr

    def op_prefill(self, key: str, tid: str, rid: str, blocks: list[int], n: int) -> None:
        self.engines[key].prefill_finished(tid, rid, [blocks], n)

    def op_prefill_started(self, key: str, tid: str, rid: str, blocks: list[int], n: int) -> None:
        self.engines[key].prefill_started(tid, rid, [blocks], n)

    def op_compute_layers(self, key: str, lo: int, hi: int, seed: int) -> None:
        """Stand-in for P's forward writing layers ``[lo, hi)``: fresh bytes there, nothing else touched."""
        arr = self.caches[key]
        arr[lo:hi] = np.random.default_rng(seed).integers(0, 256, arr[lo:hi].shape, dtype=np.uint8)

    def op_kv_ready(self, key: str, tids: list[str], regions: int) -> None:
        self.engines[key].kv_ready(tids, regions)

    def op_min_part_bytes(self, nbytes: int) -> int:
        """Lower the size under which staged pushes are not split (test caches are small); returns the old one."""
        from kvpush.engine import sender

        old, sender.MIN_PART_BYTES = sender.MIN_PART_BYTES, nbytes
        return old

    def op_register(
        self, key: str, tid: str, rid: str, peer: tuple[str, int, int], blocks: list[int], n: int, start: int
    ) -> None:
        from kvpush.engine import PeerAddress

        self.engines[key].register(tid, rid, PeerAddress(*peer), [blocks], n, start)

    def op_abort(self, key: str, tid: str, reason: str) -> None:
        self.engines[key].abort(tid, reason)

    def op_results(self, key: str, count: int, timeout: float) -> list[Any]:
        """Wait up to ``timeout`` s for ``count`` results (fewer come back on timeout)."""
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out.extend(self.engines[key].poll())
            if len(out) < count:
                time.sleep(0.005)
        return out

    def op_stats(self, key: str) -> dict[str, Any]:
        return self.engines[key].stats()

    def op_loops(self, key: str) -> int:
        return int(self.engines[key].loops)

    def op_snapshot(self, key: str) -> np.ndarray:
        return self.caches[key].copy()

    def op_layout(self, key: str) -> bytes:
        import msgspec

        return msgspec.msgpack.encode(self.engines[key].layout)

    def op_bare_agent(self, name: str) -> bytes:
        """A NIXL agent that belongs to no engine: its metadata lets a raw socket say a valid hello."""
        from kvpush.transport.nixl_agent import Agent

        a = Agent(name)
        self.agents.append(a)
        return a.metadata()

    def op_logs(self) -> list[str]:
        lines, self.capture.lines = self.capture.lines, []
        return lines

    def op_crashes(self) -> list[str]:
        lines, self.capture.crashes = self.capture.crashes, []
        return lines

    def op_close(self, key: str, keep_memory: bool = False) -> None:
        """Close an engine; ``keep_memory`` keeps its cache mapped, for a peer that may still write into it."""
        self.engines.pop(key).close()
        cache = self.caches.pop(key, None)
        if keep_memory:
            self.retired.append(cache)

    def op_exit(self) -> None:
        for key in list(self.engines):
            self.op_close(key)
        for a in self.agents:
            a.close()


def worker_main(name: str, cmds: mp.Queue, answers: mp.Queue) -> None:
    """Entry point of a worker process (spawn target)."""
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    w = Worker(name)
    # The first NIXL agent of a process pays UCX's start (~4 s); pay it here,
    # in both workers at once, rather than inside the first test.
    w.op_bare_agent(f"warmup-{name}")
    answers.put(("ok", "ready"))
    while True:
        op, args = cmds.get()
        try:
            answers.put(("ok", getattr(w, f"op_{op}")(*args)))
        except Exception:
            answers.put(("err", f"{name}.{op}{args!r:.200}:\n{traceback.format_exc()}"))
        if op == "exit":
            # Engines and agents are closed; skip the interpreter's slow
            # teardown of NIXL/UCX globals (~3 s) once the answer is out.
            answers.close()
            answers.join_thread()
            os._exit(0)


class Node:
    """Test-side handle of one worker process."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.cmds: mp.Queue = ctx.Queue()
        self.answers: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=worker_main, args=(name, self.cmds, self.answers), daemon=True)
        self.proc.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        self._answer(timeout)

    def call(self, op: str, *args: Any, timeout: float = 30.0) -> Any:
        self.cmds.put((op, args))
        return self._answer(timeout)

    def _answer(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, value = self.answers.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"worker {self.name} died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {self.name} did not answer in {timeout}s") from None
        if status != "ok":
            raise RuntimeError(f"worker {self.name} failed: {value}")
        return value

    def stop(self) -> None:
        """Close everything in the worker, then end it (killed if it does not answer)."""
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20.0)
            except Exception:
                pass
            self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
