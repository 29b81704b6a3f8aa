"""The two processes of ``kvpush bench transfer``: P's or D's side (its cache, its engines or raw agent, the
operations the driver asks for), and the driver's handle on it (:class:`Proc`: ``send``/``recv`` split a call so
both sides can wait at once).

A side runs the kvpush of the tree it was started from (``--tree``): everything of ``kvpush`` is imported inside
the operations, and modules that moved are looked up where that tree keeps them (:func:`_core`)."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

from kvpush_tools.bench import busy_gil, stages, transfer_plans
from kvpush_tools.bench.transfer_shape import Shape, make_cache, per_block_descriptors, request_digest


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
        self.cache = make_cache(shape, seed)
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
        return request_digest(self.cache, blocks, self.shape.tokens)

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


class Proc:
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
