"""The doctor's loopback self-test: a real push P -> D through one backend and one NIXL plugin, in this process.

Why a real push and not a probe: the plugin loading and the backend starting
do not prove that registration, the side channel and a NIXL WRITE work
together here; a ``Sender`` and a ``Receiver`` with two NIXL agents do, and
the bytes D receives are compared with P's byte for byte.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.core.errors import MemoryKindError
from kvpush.core.geometry import KVGeometry
from kvpush.doctor.report import Check

SELF_TEST_GEOMETRY = KVGeometry(layers=8, num_blocks=160, block_size=16, num_heads=8, head_dim=128)
"""The KV cache both sides of the self-test allocate (float16, NHD)."""
SELF_TEST_TOKENS = 1024
"""Tokens of each self-test push."""


@dataclass
class _Side:
    """One side's backend and KV cache; ``fallback``: numpy arrays, as the backend has no test support."""

    be: Any
    kv: dict[str, Any]
    fallback: bool = False

    def nbytes(self, t: Any) -> int:
        return int(t.nbytes) if self.fallback else int(self.be.read_bytes(t).size)

    def write(self, t: Any, data: np.ndarray) -> None:
        if self.fallback:
            t.view(np.uint8).reshape(-1)[:] = data
        else:
            self.be.write_bytes(t, data)

    def read(self, t: Any) -> np.ndarray:
        return t.view(np.uint8).reshape(-1).copy() if self.fallback else self.be.read_bytes(t)


def _np_cache(spec: Any, layers: int, num_blocks: int) -> dict[str, np.ndarray]:
    """Host fallback when a backend lacks ``make_test_cache``: numpy arrays in the NHD shape."""
    shape = (2, num_blocks, spec.block_size, spec.num_heads, spec.head_dim)
    return {f"layer{i}": np.zeros(shape, dtype=np.float16) for i in range(layers)}


def _sides(name: str, backend_factory: Callable[[], Any], spec: Any, geom: KVGeometry) -> tuple[_Side, _Side]:
    """P's and D's backend with a test cache each; the host backend falls back to numpy arrays.

    Raises ``NotImplementedError`` for another backend without test support."""
    p_be, d_be = backend_factory(), backend_factory()
    try:
        p_kv = p_be.make_test_cache(spec, geom.layers, geom.num_blocks)
        d_kv = d_be.make_test_cache(spec, geom.layers, geom.num_blocks)
    except NotImplementedError:
        if name != "host":
            raise
        p_kv = _np_cache(spec, geom.layers, geom.num_blocks)
        d_kv = _np_cache(spec, geom.layers, geom.num_blocks)
        return _Side(p_be, p_kv, True), _Side(d_be, d_kv, True)
    return _Side(p_be, p_kv), _Side(d_be, d_kv)


def _fill(p: _Side, d: _Side, rng: np.random.Generator) -> None:
    """Random bytes in every layer of P's cache, zeros in D's; P's writes are complete on return."""
    per_layer = None
    for t in p.kv.values():
        data = rng.integers(0, 256, p.nbytes(t), dtype=np.uint8)
        per_layer = data.size
        p.write(t, data)
    for t in d.kv.values():
        d.write(t, np.zeros(per_layer or 0, dtype=np.uint8))
    p.be.wait_ready(p.be.record_ready())


@contextmanager
def engine_pair(nixl_backend: str, p: _Side, d: _Side, spec: Any) -> Iterator[tuple[Any, Any, bytes]]:
    """P's ``Sender``, D's ``Receiver`` over ``nixl_backend`` (closed on the way out) and the key a router
    mints their transfers' capabilities with.

    The one place the self-test configures the side channel and the engines:
    they run as a deployment's would, on a port the system picks, authenticated
    with a throwaway key set, P requiring each registration's capability (the
    self-test mints them, as a router does)."""
    from kvpush.config import Config
    from kvpush.engine import Receiver, Sender
    from kvpush.transport.key_set import make_key_set, router_capability_key

    keys = tempfile.mkdtemp(prefix="kvpush-doctor-keys-")
    make_key_set(keys)
    capability_key = router_capability_key(keys)
    assert capability_key is not None  # the key set holds P's secret key
    cfg = Config.from_dict(
        {"nixl_backends": [nixl_backend], "side_channel_port": 0, "model": "kvpush-doctor", "auth_keys_dir": keys}
    )
    sender = receiver = None
    try:
        sender = Sender(cfg, p.be, p.be.describe(p.kv, spec), "doctor-p")
        receiver = Receiver(cfg, d.be, d.be.describe(d.kv, spec), "doctor-d")
        yield sender, receiver, capability_key
    finally:
        for e in (receiver, sender):
            if e is not None:
                e.close()
        shutil.rmtree(keys, ignore_errors=True)


def _push_rounds(
    sender: Any,
    receiver: Any,
    capability_key: bytes,
    p: _Side,
    d: _Side,
    geom: KVGeometry,
    rng: np.random.Generator,
    rounds: int,
    tokens: int,
    timeout: float,
) -> list[dict[str, float]]:
    """``rounds + 1`` pushes of random blocks, each verified; the first pays the handshake and is not timed."""
    from kvpush.core.capability import mint
    from kvpush.engine import PeerAddress

    peer = PeerAddress(sender.address[0], sender.address[1], 1)
    n = geom.blocks_for(tokens)
    results: list[dict[str, float]] = []
    for r in range(rounds + 1):
        pblocks = [int(b) for b in rng.choice(geom.num_blocks, n, replace=False)]
        dblocks = [int(b) for b in rng.choice(geom.num_blocks, n, replace=False)]
        tid = f"doctor-{r}"
        t0 = time.perf_counter()
        receiver.register(tid, f"d{r}", peer, [dblocks], tokens, capability=mint(capability_key, tid))
        sender.prefill_finished(tid, f"p{r}", [pblocks], tokens, p.be.record_ready())
        d_res = _wait(receiver, timeout)
        elapsed = time.perf_counter() - t0
        _wait(sender, timeout)
        if not d_res.ok:
            raise RuntimeError(f"transfer {tid} failed: {d_res.reason}")
        _verify(p, d, pblocks, dblocks, geom)
        if r:
            results.append({"seconds": elapsed, "bytes": float(d_res.stats.bytes)})
    return results


def self_test(
    name: str,
    backend_factory: Callable[[], Any],
    nixl_backend: str = "UCX",
    geom: KVGeometry = SELF_TEST_GEOMETRY,
    tokens: int = SELF_TEST_TOKENS,
    rounds: int = 3,
    timeout: float = 60.0,
    key: str = "",
) -> Check:
    """Push ``tokens`` tokens P -> D through a real Sender/Receiver pair in this process, verify, time it.

    ``key``: the check's name for ``--require`` (default ``selftest:<backend>``)."""
    title = f"self-test push ({name} over {nixl_backend})"
    key = key or f"selftest:{name}"
    spec = geom.spec()
    try:
        p, d = _sides(name, backend_factory, spec, geom)
    except NotImplementedError:
        return Check(
            key,
            title,
            "missing",
            "skipped: the backend has no test-support surface (make_test_cache)",
            fix="implement the optional test-support methods (docs/backends.md)",
        )
    rng = np.random.default_rng(7)
    _fill(p, d, rng)
    try:
        with engine_pair(nixl_backend, p, d, spec) as (sender, receiver, capability_key):
            results = _push_rounds(sender, receiver, capability_key, p, d, geom, rng, rounds, tokens, timeout)
    except MemoryKindError as exc:  # the transport takes none of this backend's memory: a setting, not a fault
        return Check(
            key,
            title,
            "fail",
            f"{nixl_backend} cannot register this backend's memory",
            why=str(exc),
            fix="give the backend host staging where it has one (cuda: staging=host) or use a NIXL backend that "
            "takes its memory",
        )
    except Exception as exc:
        return Check(
            key,
            title,
            "fail",
            "the loopback push failed",
            why=f"{type(exc).__name__}: {exc}",
            fix="run `pytest tests/nixl/test_push_nixl.py` for a detailed account; check the NIXL plugin above",
        )
    return _measured(key, title, rounds, results, p.fallback)


def _measured(key: str, title: str, rounds: int, results: list[dict[str, float]], fallback: bool) -> Check:
    """The passed self-test's check: bytes moved, best and median bandwidth."""
    nbytes = results[0]["bytes"]
    best = min(r["seconds"] for r in results)
    med = sorted(r["seconds"] for r in results)[len(results) // 2]
    gbps = nbytes / best / 1e9
    return Check(
        key,
        title,
        "ok",
        f"{rounds} pushes of {nbytes / 2**20:.1f} MiB verified byte for byte; best {gbps:.2f} GB/s "
        f"({best * 1e3:.1f} ms), median {nbytes / med / 1e9:.2f} GB/s",
        details={
            "bytes": nbytes,
            "best_s": best,
            "median_s": med,
            "best_GBps": gbps,
            "verified": True,
            "numpy_fallback": fallback,
        },
    )


def _wait(engine: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = engine.poll()
        if got:
            return got[0]
        time.sleep(0.0005)
    raise TimeoutError(f"{engine.name}: no result within {timeout:g}s")


def _verify(p: _Side, d: _Side, pblocks: list[int], dblocks: list[int], geom: KVGeometry) -> None:
    """D's registered blocks must hold P's bytes exactly (logical ``[2, blocks, ...]`` order on both)."""
    for (name, pt), dt in zip(p.kv.items(), d.kv.values(), strict=True):
        got_p = p.read(pt).reshape(2, geom.num_blocks, -1)[:, pblocks]
        got_d = d.read(dt).reshape(2, geom.num_blocks, -1)[:, dblocks]
        if not np.array_equal(got_p, got_d):
            bad = int(np.count_nonzero(got_p != got_d))
            raise AssertionError(f"{name}: {bad} bytes differ between P's blocks and D's after the push")
