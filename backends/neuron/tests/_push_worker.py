"""One side (P or D) of a two-process push, run in a spawned process.

Each side is a whole kvpush rank: its own Neuron runtime, KV tensors
allocated and filled through the runtime, a ``NeuronBackend``, and the real
engine (``Sender``/``Receiver``) with a real NIXL agent. The parent only
relays P's side-channel address and compares the bytes D reports.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from _kvmodel import Side, random_arrays

P_SEED, D_SEED = 11, 22
TIMEOUT_S = 25.0


@dataclass(frozen=True)
class Scenario:
    """A request pushed from P's cache layout to D's."""

    name: str
    mode: str  # NeuronBackend mode, both sides
    plan: str  # kvpush Config.plan
    p: Side
    p_blocks: list[int]
    d: Side
    d_blocks: list[int]
    num_tokens: int
    start_token: int = 0
    delay_s: float = 0.0  # P's last KV tensor lands this long after prefill_finished (stand-in async write)


@dataclass(frozen=True)
class Env:
    lib: str
    nixl: str  # NIXL backend: UCX on the stand-in, LIBFABRIC on a trn host
    core: str  # NEURON_RT_VISIBLE_CORES of this worker


def _mem(env: Env, mode: str) -> str:
    return "VRAM" if env.nixl == "LIBFABRIC" and mode == "direct" else "DRAM"


def _wait(engine: Any, what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        results = engine.poll()
        if results:
            return results[0]
        time.sleep(0.005)
    raise TimeoutError(f"{what}: no result in {TIMEOUT_S}s; stats {engine.stats()}")


def run(role: str, scenarios: list[Scenario], env: Env, conn: Connection) -> None:
    """Worker entry point: play ``role`` in each scenario in turn (one process start for all).

    Reports ``("ok", name, payload)`` or ``("error", name, traceback)`` per
    scenario; P first reports ``("addr", name, (host, port))``, D first waits
    for that address (None: P failed, skip).
    """
    os.environ["NEURON_RT_VISIBLE_CORES"] = env.core
    os.environ["KVPUSH_NRT_LIB"] = env.lib
    try:
        for sc in scenarios:
            try:
                payload = _p(sc, env, conn) if role == "P" else _d(sc, env, conn)
                conn.send(("ok", sc.name, payload))
            except BaseException:
                conn.send(("error", sc.name, traceback.format_exc()))
    finally:
        conn.close()


def _setup(side: Side, sc: Scenario, env: Env, seed: int) -> tuple[Any, list[Any], Any]:
    from kvpush_neuron import NeuronBackend, NeuronTensor

    backend = NeuronBackend(mode=sc.mode, mem=_mem(env, sc.mode), lib=env.lib)
    tensors = [NeuronTensor(backend.runtime, shape, side.dtype, 0) for shape in side.shapes()]
    return backend, tensors, random_arrays(side, seed)


def _config(sc: Scenario, env: Env) -> Any:
    from kvpush.config import Config

    return Config.of(nixl_backends=(env.nixl,), plan=sc.plan, staging_bytes=2 << 20, side_channel_port=0)


def _p(sc: Scenario, env: Env, conn: Connection) -> dict[str, Any]:
    from kvpush.engine import Sender

    backend, tensors, arrays = _setup(sc.p, sc, env, P_SEED)
    layout = backend.describe(sc.p.kv_caches(tensors), sc.p.spec())
    sender = Sender(
        _config(sc, env), backend, layout, engine_id=f"P-{sc.name}", rank=sc.p.tp_rank, tp_size=sc.p.tp_size
    )
    announced = False
    try:
        conn.send(("addr", sc.name, sender.address))
        announced = True
        marker = None
        if sc.delay_s:
            # D's registration waits at P first, so only wait_ready stands between the prefill and the WRITE.
            deadline = time.monotonic() + TIMEOUT_S
            while not sender.stats().get("registrations_total") and time.monotonic() < deadline:
                time.sleep(0.01)
        # The "prefill": KV written into P's device tensors; with a delay, the last one is still in flight.
        for i, (t, a) in enumerate(zip(tensors, arrays, strict=True)):
            raw = a.view(np.uint8).reshape(-1)
            if sc.delay_s and i == len(tensors) - 1:
                from _standin import delayed_write

                marker = backend.record_ready(seq=delayed_write(t, raw, sc.delay_s))
            else:
                t.write_bytes(raw)
        t0 = time.monotonic()
        sender.prefill_finished("t1", "r1", [sc.p_blocks], sc.num_tokens, ready=marker)
        res = _wait(sender, "P")
        elapsed = time.monotonic() - t0
        stats = sender.stats()
        source_ok = all(
            np.array_equal(t.read_bytes(), a.view(np.uint8).reshape(-1)) for t, a in zip(tensors, arrays, strict=True)
        )
    finally:
        if announced:
            conn.recv()  # the parent says D is done: P's engine stays up until then
        sender.close()
        backend.close()
        for t in tensors:
            t.free()
    return {"ok": res.ok, "reason": res.reason, "stats": stats, "elapsed": elapsed, "source_ok": source_ok}


def _d(sc: Scenario, env: Env, conn: Connection) -> dict[str, Any]:
    from kvpush.engine import PeerAddress, Receiver
    from kvpush.transport import key_set

    backend, tensors, arrays = _setup(sc.d, sc, env, D_SEED)
    for t, a in zip(tensors, arrays, strict=True):
        t.write_bytes(a.view(np.uint8).reshape(-1))
    layout = backend.describe(sc.d.kv_caches(tensors), sc.d.spec())
    receiver = Receiver(
        _config(sc, env), backend, layout, engine_id=f"D-{sc.name}", rank=sc.d.tp_rank, tp_size=sc.d.tp_size
    )
    try:
        addr = conn.recv()
        if addr is None:
            raise RuntimeError("P failed before listening; see P's error")
        host, port = addr
        peer = PeerAddress(host, port, tp_size=sc.p.tp_size)
        # the test acts as the router: it mints the transfer's capability with the run's key set
        cap = key_set.session_capability("t1")
        receiver.register("t1", "r1", peer, [sc.d_blocks], sc.num_tokens, sc.start_token, capability=cap)
        res = _wait(receiver, "D")
        stats = receiver.stats()
        after = [t.read_bytes() for t in tensors]  # through the runtime, as decode would see them
    finally:
        receiver.close()
        backend.close()
        for t in tensors:
            t.free()
    return {"ok": res.ok, "reason": res.reason, "stats": stats, "after": after}
