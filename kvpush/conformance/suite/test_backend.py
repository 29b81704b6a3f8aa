"""The backend alone, in the test process: test support, describe, registration, pack/unpack, markers, errors.

Everything here runs in one process with at most one NIXL agent; the
two-process pushes are in ``test_push``. Each test's docstring names the
contract it checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvpush.backends.base import Backend
from kvpush.backends.copy import copier
from kvpush.config import Config
from kvpush.conformance.model import Geom, apply_push, assert_same, make_requests, payload
from kvpush.conformance.target import Target
from kvpush.conformance.worker import Pair
from kvpush.core.errors import BackendError
from kvpush.core.geometry import DTYPE_BYTES
from kvpush.core.layout import KVLayout, MemKind, check_compatible
from kvpush.core.parts import split_regions
from kvpush.core.payload import unpack_pieces
from kvpush.core.plan import build_plan

GEOMS = {
    "nhd": Geom(),
    "hnd": Geom(order="HND", block_size=32, num_blocks=16),
    "tp2-rank1": Geom(num_heads=8, tp_size=2, tp_rank=1, layers=3),
}

Cache = dict[str, Any]


@pytest.fixture(scope="module", autouse=True)
def _boot_workers(kvpush_pair: Pair) -> None:
    """Spawn the P/D workers now: their NIXL start-up overlaps the in-process tests."""


@pytest.fixture()
def caches(kvpush_backend: Backend, kvpush_target: Target) -> Iterator[Callable[..., Cache]]:
    """Factory of test caches on P's device, filled from a seed; all freed afterwards."""
    made: list[Cache] = []

    def make(geom: Geom, seed: int | None = None) -> Cache:
        kv = kvpush_backend.make_test_cache(geom.spec(), geom.layers, geom.num_blocks, kvpush_target.p_device)
        made.append(kv)
        if seed is not None:
            data = payload(geom, seed)
            for i, t in enumerate(kv.values()):
                kvpush_backend.write_bytes(t, data[i].reshape(-1))
            # write_bytes may still run on the device; read_bytes returns after all earlier device work.
            for t in kv.values():
                kvpush_backend.read_bytes(t)
        return kv

    yield make
    for kv in made:
        kvpush_backend.free_test_cache(kv)


def snapshot(backend: Backend, kv: Cache, geom: Geom) -> np.ndarray:
    return np.stack([np.asarray(backend.read_bytes(t), np.uint8).reshape(-1) for t in kv.values()]).reshape(
        geom.shape()
    )


def test_backend_loads(kvpush_target: Target) -> None:
    """Contract: the backend is found by its entry-point name or module:Class, subclasses Backend,
    constructs with the given options, names itself and a NIXL memory kind, and closes."""
    cls = kvpush_target.backend_class()
    assert issubclass(cls, Backend)
    backend = kvpush_target.make()
    try:
        assert isinstance(backend.name, str) and backend.name and backend.name != "abstract", backend.name
        assert MemKind(backend.mem) in set(MemKind), backend.mem
    finally:
        backend.close()


@pytest.mark.parametrize("geom", GEOMS.values(), ids=GEOMS.keys())
def test_test_support_round_trip(kvpush_backend: Backend, caches: Callable[..., Cache], geom: Geom) -> None:
    """Contract (test support): make_test_cache gives one tensor per layer; read_bytes returns exactly the
    logical bytes write_bytes wrote, for every layer, in NHD and HND and for a TP rank's head slice."""
    kv = caches(geom, seed=5)
    assert len(kv) == geom.layers, list(kv)
    assert_same(snapshot(kvpush_backend, kv, geom), payload(geom, 5), geom, "read_bytes after write_bytes")


def _payload_intervals(layout: KVLayout) -> np.ndarray:
    """Sorted byte intervals ``[start, end)`` of every (region, block) the layout says holds payload."""
    blocks = np.arange(layout.num_blocks, dtype=np.int64) * layout.block_stride
    s = np.sort(np.concatenate([r.base + blocks for r in layout.regions]))
    return np.stack([s, s + layout.block_bytes], axis=1)


@pytest.mark.parametrize("geom", GEOMS.values(), ids=GEOMS.keys())
def test_layout_is_self_consistent(kvpush_backend: Backend, caches: Callable[..., Cache], geom: Geom) -> None:
    """Contract (describe): the layout validates and states the spec's geometry (block size, block count,
    head bytes, the rank's heads, dtype, memory kind, one region per layer and K/V, on the cache's device);
    block stride and region sizes hold every block; no two payload bytes of different (region, block, head)
    share an address (blocks are dense); every region lies inside one registration of the same device and memory kind;
    describing the same cache twice gives the same layout."""
    kv = caches(geom, seed=1)
    layout = kvpush_backend.describe(kv, geom.spec())
    assert layout.validate() is layout
    want = {
        "block_size": geom.block_size,
        "num_blocks": geom.num_blocks,
        "head_bytes": geom.head_dim * DTYPE_BYTES[geom.dtype],
        "num_heads": geom.num_heads,
        "local_heads": geom.local_heads,
        "head_start": geom.head_start,
        "dtype": geom.dtype,
        "mem": MemKind(kvpush_backend.mem),
        "regions": 2 * geom.layers,
    }
    got = {k: (len(layout.regions) if k == "regions" else getattr(layout, k)) for k in want}
    assert got == want, f"layout {layout} does not state the spec's geometry"
    assert layout.block_bytes == geom.block_size * geom.local_heads * want["head_bytes"]
    assert layout.block_stride >= layout.block_bytes
    for i, r in enumerate(layout.regions):
        assert r.size >= (layout.num_blocks - 1) * layout.block_stride + layout.block_bytes, (i, r)
    iv = _payload_intervals(layout)
    overlaps = np.flatnonzero(iv[1:, 0] < iv[:-1, 1])
    assert overlaps.size == 0, f"payloads overlap at {iv[overlaps[0]]} and {iv[overlaps[0] + 1]}"
    regs = kvpush_backend.registrations(layout)
    if not regs:
        assert not kvpush_backend.capabilities.direct, "no registrations, yet the backend claims direct transfers"
    for i, r in enumerate(layout.regions):
        if not regs:
            break
        inside = [
            g for g in regs if g.addr <= r.base and r.base + r.size <= g.addr + g.size and g.device_id == r.device_id
        ]
        assert inside, f"region {i} [{r.base:#x}, +{r.size}) on device {r.device_id} is in no registration: {regs}"
        assert all(MemKind(g.mem) == layout.mem for g in inside), (regs, layout.mem)
    assert len({r.device_id for r in layout.regions}) == 1
    again = kvpush_backend.describe(kv, geom.spec())
    assert again == layout, "describing the same cache twice changed the layout"
    # The same model with another block size and the full set of heads: a peer this rank can exchange KV with.
    peer = Geom(layers=geom.layers, num_heads=geom.num_heads, block_size=2 * geom.block_size, num_blocks=8)
    check_compatible(layout, kvpush_backend.describe(caches(peer), peer.spec()))


PACK_CASES = {
    "same-geometry": (Geom(num_blocks=48), Geom(num_blocks=48)),
    "block-sizes-16-to-32-nhd-to-hnd": (Geom(num_blocks=48), Geom(block_size=32, num_blocks=32, order="HND")),
    "tp1-to-tp2-rank1": (Geom(num_blocks=48, order="HND"), Geom(num_blocks=48, tp_size=2, tp_rank=1)),
}


@pytest.mark.parametrize(("pg", "dg"), PACK_CASES.values(), ids=PACK_CASES.keys())
def test_pack_unpack_move_exactly_the_mapped_bytes(
    kvpush_backend: Backend, caches: Callable[..., Cache], pg: Geom, dg: Geom
) -> None:
    """Contract (describe + pack/unpack): P's pieces packed into a staging buffer at the layout's offsets
    and unpacked into D's cache land where the logical model puts those tokens and heads, for random
    block sets, differing block sizes, orders and head slices; no other byte of D changes."""
    src_kv, dst_kv = caches(pg, seed=10), caches(dg, seed=20)
    lp, ld = kvpush_backend.describe(src_kv, pg.spec()), kvpush_backend.describe(dst_kv, dg.spec())
    staging = kvpush_backend.alloc_staging(1 << 20, lp.regions[0].device_id)
    expected = payload(dg, 20)
    src = payload(pg, 10)
    cfg = Config.of(plan="staged")
    for req in make_requests(np.random.default_rng(3), 8, pg, dg, "pk", max_tokens=120):
        plan = build_plan(
            cfg,
            lp,
            ld,
            req.p_blocks,
            req.d_blocks,
            req.n,
            req.start,
            staging_local=(staging.addr, staging.device_id),
            staging_remote=(staging.addr, staging.size, staging.device_id),
        )
        if plan.kind == "empty":
            continue
        assert plan.kind == "staged" and plan.pack is not None
        kvpush_backend.pack([r.base for r in lp.regions], plan.pack, staging.addr)
        pieces = unpack_pieces(lp, ld, req.d_blocks, req.n, req.start)
        kvpush_backend.unpack([r.base for r in ld.regions], pieces, staging.addr)
        apply_push(expected, dg, src, pg, req)
    assert_same(snapshot(kvpush_backend, dst_kv, dg), expected, dg)
    assert_same(snapshot(kvpush_backend, src_kv, pg), src, pg, "P's cache after pack")


def test_parts_pack_and_unpack_back_to_back(kvpush_backend: Backend, caches: Callable[..., Cache]) -> None:
    """Contract (parts): a staged push cut into parts packs each part into its own place in the staging buffer
    and starts the next pack before the one before landed; D starts each part's unpack on its own. So packs
    (and unpacks) of disjoint parts started back to back, without waiting (``start_pack``/``start_unpack``
    where the backend copies asynchronously, else its synchronous copies), must not disturb each other, and
    each marker must be reached on its own: waited for last part first, part k's bytes are in the staging
    buffer once part k's marker is reached (read at once by a synchronous unpack), whatever the markers of
    the parts before it; D's cache ends exactly as the logical model says."""
    pg, dg = Geom(layers=4, num_blocks=48), Geom(layers=4, block_size=32, num_blocks=32, order="HND")
    src_kv, now_kv, dst_kv = caches(pg, seed=30), caches(dg, seed=40), caches(dg, seed=40)
    lp, ld = kvpush_backend.describe(src_kv, pg.spec()), kvpush_backend.describe(dst_kv, dg.spec())
    ld_now = kvpush_backend.describe(now_kv, dg.spec())
    staging = kvpush_backend.alloc_staging(1 << 20, lp.regions[0].device_id)
    reqs = make_requests(np.random.default_rng(4), 6, pg, dg, "parts", max_tokens=120)
    req = max(reqs, key=lambda r: r.n - r.start)
    plan = build_plan(
        Config.of(plan="staged"),
        lp,
        ld,
        req.p_blocks,
        req.d_blocks,
        req.n,
        req.start,
        staging_local=(staging.addr, staging.device_id),
        staging_remote=(staging.addr, staging.size, staging.device_id),
    )
    assert plan.kind == "staged" and plan.pack is not None
    cut = split_regions(0, plan.nregions, 4)
    assert len(cut) >= 3, (plan.nregions, cut)
    copy = copier(kvpush_backend)
    p_bases, d_bases, now_bases = ([r.base for r in lay.regions] for lay in (lp, ld, ld_now))
    pieces = unpack_pieces(lp, ld, req.d_blocks, req.n, req.start)
    at = [staging.addr + r0 * plan.region_bytes for r0, _ in cut]
    packs = [copy.start_pack(p_bases[r0:r1], plan.pack, at[k]) for k, (r0, r1) in enumerate(cut)]
    assert all(isinstance(kvpush_backend.poll_ready(m), bool) for m in packs), "poll_ready of a running pack"
    for k in reversed(range(len(cut))):
        r0, r1 = cut[k]
        kvpush_backend.wait_ready(packs[k])
        kvpush_backend.unpack(now_bases[r0:r1], pieces, at[k])  # what the slot holds of part k now
    assert all(kvpush_backend.poll_ready(m) for m in packs), "a pack's marker not reached after it was waited for"
    unpacks = [copy.start_unpack(d_bases[r0:r1], pieces, at[k]) for k, (r0, r1) in enumerate(cut)]
    for m in reversed(unpacks):
        kvpush_backend.wait_ready(m)
    assert all(kvpush_backend.poll_ready(m) for m in unpacks), "an unpack's marker not reached after it was waited for"
    expected = payload(dg, 40)
    apply_push(expected, dg, payload(pg, 30), pg, req)
    assert_same(snapshot(kvpush_backend, now_kv, dg), expected, dg, "part k's bytes once its own pack's marker")
    assert_same(snapshot(kvpush_backend, dst_kv, dg), expected, dg, "D's cache after the parts' unpacks")
    assert_same(snapshot(kvpush_backend, src_kv, pg), payload(pg, 30), pg, "P's cache after the packs")


def test_ready_markers(kvpush_backend: Backend, caches: Callable[..., Cache]) -> None:
    """Contract (ordering): record_ready() after writes gives a marker wait_ready accepts, from another
    thread, and after it returns the writes are visible; wait_ready(None) returns at once."""
    import threading

    geom = GEOMS["nhd"]
    kv = caches(geom, seed=6)
    data = payload(geom, 7)
    for i, t in enumerate(kv.values()):
        kvpush_backend.write_bytes(t, data[i].reshape(-1))
    marker = kvpush_backend.record_ready()
    errors: list[BaseException] = []

    def push_thread() -> None:
        try:
            kvpush_backend.wait_ready(marker)
            kvpush_backend.wait_ready(None)
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=push_thread)
    th.start()
    th.join(30)
    assert not th.is_alive(), "wait_ready did not return within 30 s"
    assert not errors, errors
    assert_same(snapshot(kvpush_backend, kv, geom), data, geom, "cache after wait_ready")


def test_foreign_tensors_are_refused(
    kvpush_backend: Backend, kvpush_target: Target, caches: Callable[..., Cache]
) -> None:
    """Contract (describe): memory the backend does not own, or that contradicts the spec, raises
    BackendError (never another exception, never a layout): non-tensor objects, an empty cache, caches
    built for another head size or block size, and the backend's own foreign examples; an error about a
    particular tensor names its layer."""
    geom = GEOMS["nhd"]
    spec = geom.spec()
    with pytest.raises(BackendError):
        kvpush_backend.describe({}, spec)
    with pytest.raises(BackendError):
        kvpush_backend.describe({"layer0": object(), "layer1": object()}, spec)
    with pytest.raises(BackendError):
        kvpush_backend.describe({"layer0": [[0.0] * 8] * 4}, spec)
    cases: dict[str, Cache] = {
        "head_dim twice the spec's": caches(Geom(head_dim=2 * geom.head_dim)),
        "block_size twice the spec's": caches(Geom(block_size=2 * geom.block_size)),
    }
    foreign = kvpush_backend.foreign_test_tensors(spec, geom.num_blocks, kvpush_target.p_device)
    try:
        for label, kv in {**cases, **foreign}.items():
            with pytest.raises(BackendError) as info:
                kvpush_backend.describe(kv, spec)
            assert any(name in str(info.value) for name in kv), f"{label}: error does not name a layer: {info.value}"
    finally:
        for kv in foreign.values():
            kvpush_backend.free_test_cache(kv)


# -- last: these wait for the P worker, which boots while the tests above run --------------


def test_register_deregister_round_trip(kvpush_pair: Pair) -> None:
    """Contract (registrations): the buffers registrations() returns register with a real NIXL agent,
    deregister to zero, register again after deregistration, and a staging buffer from alloc_staging
    registers alongside them; closing the agent leaves no registration. (Runs in the P worker, where
    NIXL is loaded already: see ``kvpush.conformance.checks``.)"""
    p, _ = kvpush_pair.ready()
    p.call("check", "register_deregister_round_trip", GEOMS["nhd"])


def test_reregistration_after_free(kvpush_pair: Pair) -> None:
    """Contract (registrations): after a cache is deregistered and freed, a new cache (the allocator may
    hand out the same addresses) is described afresh, registers, and holds its own bytes. (P worker.)"""
    p, _ = kvpush_pair.ready()
    p.call("check", "reregistration_after_free", GEOMS["nhd"])
