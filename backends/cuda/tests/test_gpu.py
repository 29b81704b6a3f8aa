"""CUDA backend on a real GPU: describe/register real CUDA tensors, the Triton and
torch gather/scatter, event ordering without a device-wide sync, and a NIXL
VRAM WRITE (direct and staged) checked with torch.equal.

Skipped without CUDA. On a GPU host: ``python -m pytest backends/cuda/tests -m gpu``
(uses GPU0 and, when present, GPU1 as D).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from cuda_helpers import blocks_equal, check_addresses, fill_random, spec_for

from kvpush.backends.base import CacheSpec
from kvpush.core.errors import BackendError
from kvpush.core.layout import MemKind
from kvpush.core.pieces import coalesce, map_pieces
from kvpush_cuda import CudaBackend
from kvpush_cuda.variants import VARIANTS, canonical, is_mla, make_kv

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: run `pytest backends/cuda/tests -m gpu` there"
    ),
]

D_DEV = 1 if torch.cuda.is_available() and torch.cuda.device_count() > 1 else 0


def _cuda_kv(variant: str, nb: int, dev: int, layers: int = 3, heads: int = 2, d: int = 64) -> dict:
    if is_mla(variant):
        heads = 1
    return make_kv(torch, variant, layers, nb, 16, heads, d, torch.bfloat16, f"cuda:{dev}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_describe_and_register_cuda_tensors(variant: str) -> None:
    be = CudaBackend()
    kv = _cuda_kv(variant, 9, D_DEV)
    heads = 1 if is_mla(variant) else 2
    layout = be.describe(kv, spec_for(variant, 16, heads, 64))
    assert layout.mem is MemKind.VRAM
    assert {r.device_id for r in layout.regions} == {D_DEV}
    check_addresses(layout, kv, variant)
    regs = be.registrations(layout)
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in kv.values()}
    assert {(r.addr, r.size) for r in regs} == storages
    assert all(r.mem is MemKind.VRAM and r.device_id == D_DEV for r in regs)


def test_pinned_device_mismatch_is_an_error() -> None:
    be = CudaBackend(device=D_DEV)
    other = 0 if D_DEV == 1 else None
    if other is None:
        pytest.skip("needs two GPUs")
    with pytest.raises(BackendError, match="pinned"):
        be.describe(_cuda_kv("LBNHC", 4, other), spec_for("LBNHC", 16, 2, 64))


@pytest.mark.parametrize(("axes", "order"), [("KBNHC", "NHD"), ("KBHNC", "HND")])
def test_test_support_surface(axes: str, order: str) -> None:
    """What kvpush.conformance uses: caches describe() accepts, producer-like writes ordered by
    record_ready, exact reads, and host tensors describe() refuses."""
    be = CudaBackend(device=D_DEV)
    be.bind_thread()
    spec = CacheSpec(16, 4, 64, "bfloat16", axes=axes)
    kv = be.make_test_cache(spec, 2, 8, D_DEV)
    layout = be.describe(kv, spec)
    assert layout.order == order and len(layout.regions) == 4
    rng = np.random.default_rng(0)
    for t in kv.values():
        data = rng.integers(0, 256, t.numel() * t.element_size(), dtype=np.uint8)
        be.write_bytes(t, data)
        be.wait_ready(be.record_ready())
        assert np.array_equal(be.read_bytes(t), data)
    for label, foreign in be.foreign_test_tensors(spec, 8, D_DEV).items():
        with pytest.raises(BackendError):
            be.describe(foreign, spec)
        assert label


def test_alloc_staging_on_device() -> None:
    be = CudaBackend()
    s = be.alloc_staging(1 << 20, D_DEV)
    assert s.owner.device == torch.device("cuda", D_DEV) and s.owner.numel() == 1 << 20
    assert (s.addr, s.size, s.device_id, s.mem) == (s.owner.data_ptr(), 1 << 20, D_DEV, MemKind.VRAM)
    with pytest.raises(BackendError, match="cannot allocate"):
        be.alloc_staging(1 << 62, D_DEV)


def test_host_staging() -> None:
    """Host staging: nothing of the KV registered, the staging buffer pinned host memory registered as
    DRAM, and the copy kernels move the blocks through it byte for byte (pack, then unpack elsewhere)."""
    be = CudaBackend(device=0, staging="host")
    assert not be.capabilities.direct and be.capabilities.chained_ready
    kv = _cuda_kv("LBNHC", 16, 0, layers=2)
    out = _cuda_kv("LBNHC", 16, 0, layers=2)
    spec = spec_for("LBNHC", 16, 2, 64)
    layout, out_layout = be.describe(kv, spec), be.describe(out, spec)
    assert be.registrations(layout) == []
    src_ids, dst_ids = np.arange(8), np.array([9, 3, 12, 0, 5, 7, 15, 1])
    pieces = coalesce(map_pieces(layout, out_layout, src_ids, dst_ids, 8 * 16))
    pk, up = np.ascontiguousarray(pieces[:, [0, 2]]), np.ascontiguousarray(pieces[:, [1, 2]])
    staging = be.alloc_staging(int(pk[:, 1].sum()) * len(layout.regions), 0)
    assert staging.mem is MemKind.DRAM and staging.owner.device.type == "cpu" and staging.owner.is_pinned()
    fill_random(kv, 7)
    be.wait_ready(be.start_pack([r.base for r in layout.regions], pk, staging.addr, after=be.record_ready()))
    assert int(staging.owner.count_nonzero()) > 0
    be.wait_ready(be.start_unpack([r.base for r in out_layout.regions], up, staging.addr))
    assert blocks_equal(out, "LBNHC", dst_ids, kv, "LBNHC", src_ids)
    with pytest.raises(BackendError, match="staging 'vram' is not one of"):
        CudaBackend(staging="vram")


@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [("LBNHC", "LBNHC"), ("LBNHC", "LBHNC"), ("BLNHC", "LBHNC"), ("v024_hnd", "v024_cross_layer"), ("v024_mla", "mla")],
)
def test_pack_unpack_between_gpus(kernel: str, src: str, dst: str) -> None:
    """P's blocks -> P staging (pack, GPU0) -> D staging (peer copy) -> D's shuffled blocks (unpack, GPU1)."""
    rng = np.random.default_rng(7)
    p_be, d_be = CudaBackend(device=0, kernel=kernel), CudaBackend(device=D_DEV, kernel=kernel)  # type: ignore[arg-type]
    p_kv, d_kv = _cuda_kv(src, 40, 0), _cuda_kv(dst, 100, D_DEV)
    fill_random(p_kv, 1)
    for t in d_kv.values():
        t.view(torch.uint8).fill_(0xA5)
    lp = p_be.describe(p_kv, spec_for(src, 16, 2, 64))
    ld = d_be.describe(d_kv, spec_for(dst, 16, 2, 64))
    n_tok = 30 * 16 - 5  # a partial last block
    src_ids, dst_ids = rng.permutation(40)[:30], rng.permutation(100)[:30]
    pieces = coalesce(map_pieces(lp, ld, src_ids, dst_ids, n_tok))
    nbytes = int(pieces[:, 2].sum()) * len(lp.regions)
    ps, ds = p_be.alloc_staging(nbytes, 0), d_be.alloc_staging(nbytes, D_DEV)
    ps.owner.fill_(0x11)
    p_be.bind_thread()  # the thread hook: this thread calls both backends, each on its own device
    p_be.pack([r.base for r in lp.regions], pieces[:, [0, 2]], ps.addr)
    ds.owner.copy_(ps.owner)
    d_be.bind_thread()
    d_be.unpack([r.base for r in ld.regions], pieces[:, [1, 2]], ds.addr)
    assert p_be.kernel == kernel and d_be.kernel == kernel
    assert blocks_equal(d_kv, dst, dst_ids[:29], p_kv, src, src_ids[:29])
    # Last block: only its first 11 tokens moved; the rest keeps the poison.
    for d, p in zip(d_kv.values(), p_kv.values(), strict=True):
        got = canonical(d, dst)[:, int(dst_ids[29])]
        want = canonical(p, src)[:, int(src_ids[29])]
        assert torch.equal(got[:, :11].view(torch.int16).cpu(), want[:, :11].view(torch.int16).cpu())
        assert bool((got[:, 11:].contiguous().view(torch.uint8) == 0xA5).all())
    others = np.setdiff1d(np.arange(100), dst_ids)
    for d in d_kv.values():
        assert bool((canonical(d, dst)[:, torch.as_tensor(others)].contiguous().view(torch.uint8) == 0xA5).all())


def test_async_chained_and_prepared_pack_unpack_match_the_synchronous_ones() -> None:
    """start_pack/start_unpack per part (as the engine cuts a push), chained behind a KV event still
    pending on the producer stream, launched plainly, from prepare_* with these parts announced, or from
    the template prepare_* left for any other range: the staging bytes and D's blocks equal those of
    plain pack/unpack, and prepared launches were really used."""
    rng = np.random.default_rng(11)
    be = CudaBackend(device=0)
    kv = _cuda_kv("LBNHC", 64, 0, layers=8)  # one K|V region a layer: 8 regions, cut in three parts
    out = _cuda_kv("LBNHC", 64, 0, layers=8)
    layout = be.describe(kv, spec_for("LBNHC", 16, 2, 64))
    bases = [r.base for r in layout.regions]
    out_bases = [r.base for r in be.describe(out, spec_for("LBNHC", 16, 2, 64)).regions]
    src_ids, dst_ids = rng.permutation(64)[:40], rng.permutation(64)[:40]
    pieces = coalesce(map_pieces(layout, layout, src_ids, dst_ids, 40 * 16))
    pk, up = np.ascontiguousarray(pieces[:, [0, 2]]), np.ascontiguousarray(pieces[:, [1, 2]])
    per_region = int(pk[:, 1].sum())
    n = len(bases)
    want = be.alloc_staging(per_region * n, 0)
    got = be.alloc_staging(per_region * n, 0)
    fill_random(kv, 3)
    be.pack(bases, pk, want.addr)
    parts = [(0, 2, got.addr), (2, 5, got.addr + 2 * per_region), (5, n, got.addr + 5 * per_region)]
    for mode in ("plain", "exact", "template"):
        prepared = mode != "plain"
        got.owner.zero_()
        if prepared:
            be.prepare_pack(bases, pk, parts=parts if mode == "exact" else ())
        before = be.copy_stats().get("prepared_calls", 0)
        # The KV is (re)written after a long GPU sleep on the producer stream: a pack not chained behind
        # its event would read the old bytes, which are the same here, so poison them first.
        for t in kv.values():
            t.view(torch.uint8).fill_(0)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        fill_random(kv, 3)
        ready = be.record_ready()
        events = [be.start_pack(bases[a:b], pk, addr, after=ready) for a, b, addr in parts]
        for ev in events:
            while not be.poll_ready(ev):
                time.sleep(1e-4)
        assert torch.equal(got.owner, want.owner), mode
        used = be.copy_stats().get("prepared_calls", 0) - before
        assert used == (len(parts) if prepared else 0), used
        for t in out.values():
            t.view(torch.uint8).fill_(0xA5)
        if prepared:
            be.prepare_unpack(out_bases, up, parts=parts if mode == "exact" else ())
        before = be.copy_stats().get("prepared_calls", 0)
        events = [be.start_unpack(out_bases[a:b], up, addr) for a, b, addr in parts]
        be.wait_ready(events)
        assert blocks_equal(out, "LBNHC", dst_ids, kv, "LBNHC", src_ids), mode
        assert be.copy_stats().get("prepared_calls", 0) - before == (len(parts) if prepared else 0), mode


def test_copier_stream_is_high_priority_and_its_priority_can_change() -> None:
    """The copier's stream runs at high priority (a layer-wise pack beside the forward's GEMM); a
    benchmark can switch it to normal priority between copies, and copies stay correct on the new stream."""
    be = CudaBackend(device=0)
    kv = _cuda_kv("LBNHC", 16, 0, layers=2)
    layout = be.describe(kv, spec_for("LBNHC", 16, 2, 64))
    bases = [r.base for r in layout.regions]
    pieces = coalesce(map_pieces(layout, layout, np.arange(8), np.arange(8), 8 * 16))
    pk = np.ascontiguousarray(pieces[:, [0, 2]])
    staging = be.alloc_staging(int(pk[:, 1].sum()) * len(bases), 0)
    fill_random(kv, 5)
    be.pack(bases, pk, staging.addr)
    want = staging.owner.clone()
    copier = be._copier_on(0)
    assert copier.stream.priority < 0, copier.stream.priority
    be.set_stream_priority(0)
    staging.owner.zero_()
    be.wait_ready(be.start_pack(bases, pk, staging.addr))
    assert copier.stream.priority == 0 and torch.equal(staging.owner, want)


@pytest.mark.parametrize("shift", [1, 2, 4, 8, 16])
def test_triton_copy_any_alignment(shift: int) -> None:
    """Odd offsets and lengths pick narrower loads; bytes around each piece stay untouched."""
    from kvpush_cuda.copy import PieceCopier

    dev = torch.device("cuda", 0)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(shift)
    lens = rng.integers(1, 200_000 // shift, 5) * shift
    soffs = np.sort(rng.choice(np.arange(0, (1 << 20) - 200_000, shift), 5, replace=False))
    doffs = np.cumsum(np.concatenate(([shift], lens[:-1] + shift)))
    c = PieceCopier(torch, "cuda:0", "triton")
    c.copy([src.data_ptr()], soffs, [dst.data_ptr()], doffs, lens)
    want = torch.zeros_like(src)
    for so, do, ln in zip(soffs, doffs, lens, strict=True):
        want[do : do + ln] = src[so : so + ln]
    assert torch.equal(dst, want)


def test_peer_copy_tables_queued_behind_a_blocked_stream_are_not_overwritten() -> None:
    """start_copy with new pieces each time (a peer copy: one table per registration) puts its table through
    a slot of the pinned ring (into the slot's device twin, held until the copy ends) or uploads it; with the
    copier's stream held behind a long wait, more copies than the ring has slots are queued, and each still
    copies its own pieces (a slot whose copy or upload has not run is not reused), byte-exact. The first
    copy uploads its bases as well, through the ring, while its own table holds a slot: that slot is not
    taken for them."""
    from kvpush_cuda.copy import PieceCopier, PinnedRing

    dev = torch.device("cuda", 0)
    rng = np.random.default_rng(7)
    block, nblocks, copies = 4096, 64, 5
    src = torch.randint(0, 256, (nblocks * block,), dtype=torch.uint8, device=dev)
    # Copy k writes the k-th share of one buffer (one base: uploaded once, as a D rank's), the first copy the last.
    dst = torch.zeros((copies + 1) * nblocks * block, dtype=torch.uint8, device=dev)
    c = PieceCopier(torch, "cuda:0", "triton")
    c._ring = PinnedRing(torch, slots=2, slot_elems=3 * nblocks)
    side = torch.cuda.Stream(device=dev)

    def hold_stream() -> Any:
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the copier's stream waits for this before any upload or copy runs
        held = torch.cuda.Event()
        held.record(side)
        c.stream.wait_event(held)
        return held

    # One copy first, behind a wait too (its table is copied to the device only after its bases were put in
    # the ring), then waited for: the kernel compiled and the bases uploaded, as a D rank's are once, so that
    # the copies below are queued well within the wait and only their tables go through the ring.
    same = np.arange(nblocks) * block
    hold_stream()
    c.start_copy(
        [src.data_ptr()],
        [dst.data_ptr()],
        np.stack([same, copies * nblocks * block + same, np.full(nblocks, block)], 1),
    ).synchronize()
    got = dst.view(copies + 1, nblocks * block)
    assert torch.equal(got[copies], src), "the first copy's table was overwritten by its own bases' upload"
    lent = c.stats["lent"]
    held = hold_stream()
    orders, events = [], []
    for k in range(copies):
        order = rng.permutation(nblocks)
        at = (k * nblocks + np.arange(nblocks)) * block
        pieces = np.stack([order * block, at, np.full(nblocks, block)], axis=1)
        orders.append(order)
        events.append(c.start_copy([src.data_ptr()], [dst.data_ptr()], pieces.astype(np.int64)))
    queued = not held.query()
    for ev in events:
        ev.synchronize()
    assert queued, "the wait ended before the copies were queued: lengthen the sleep"
    for k, order in enumerate(orders):
        want = src.view(nblocks, block)[torch.as_tensor(order, device=dev)].reshape(-1)
        assert torch.equal(got[k], want), f"copy {k} used another copy's table"
    assert c.stats["lent"] - lent == 2, c.stats  # a table in each slot's device twin; the others found both held


def test_an_engine_thread_bound_to_the_copy_stream_copies_exactly_and_leaves_other_threads_alone() -> None:
    """``bind_engine_thread`` makes the copier's stream current on the engine's thread (its copies then skip
    a stream context): copies with a new table each are byte-exact there, the caller's thread keeps its own
    current stream, and once the copier has a new stream (``set_stream_priority``) the thread's stale one is
    not taken for it: a copy queued while that old stream is held still lands before its event is reached."""
    import threading

    dev = torch.device("cuda", 0)
    rng = np.random.default_rng(5)
    block, nblocks = 4096, 64
    src = torch.randint(0, 256, (nblocks * block,), dtype=torch.uint8, device=dev)
    dsts = [torch.zeros_like(src) for _ in range(4)]
    orders = [rng.permutation(nblocks) for _ in dsts]
    be = CudaBackend(device=0)
    seen: dict[str, object] = {}

    def pieces_of(order: np.ndarray) -> np.ndarray:
        return np.stack([order * block, np.arange(nblocks) * block, np.full(nblocks, block)], axis=1).astype(np.int64)

    def engine() -> None:
        be.bind_engine_thread()
        c = be._copier_on(0)
        seen["bound"] = torch.cuda.current_stream(dev).cuda_stream == c.stream.cuda_stream
        for k in range(3):
            c.start_copy([src.data_ptr()], [dsts[k].data_ptr()], pieces_of(orders[k])).synchronize()
        old = torch.cuda.current_stream(dev)
        c.set_stream_priority(0)  # a new stream; ``old`` stays this thread's current one
        torch.cuda._sleep(200_000_000)  # holds ``old``: nothing queued on it runs for a while
        ev = c.start_copy([src.data_ptr()], [dsts[3].data_ptr()], pieces_of(orders[3]))
        ev.synchronize()
        seen["old_held"] = not old.query()
        want = src.view(nblocks, block)[torch.as_tensor(orders[3], device=dev)].reshape(-1)
        seen["last"] = torch.equal(dsts[3], want)
        old.synchronize()

    t = threading.Thread(target=engine)
    t.start()
    t.join(60)
    assert seen.get("bound") is True, seen
    assert torch.cuda.current_stream(dev).cuda_stream == torch.cuda.default_stream(dev).cuda_stream
    for k in range(3):
        want = src.view(nblocks, block)[torch.as_tensor(orders[k], device=dev)].reshape(-1)
        assert torch.equal(dsts[k], want), f"copy {k} on the bound thread is wrong"
    assert seen["old_held"], "the held stream ended before the copy's event: lengthen the sleep"
    assert seen["last"], "after a new stream the copy's table went up on the thread's stale stream"


def test_wait_ready_waits_for_the_producer_stream_only() -> None:
    be = CudaBackend(device=0)
    producer, other = torch.cuda.Stream(0), torch.cuda.Stream(0)
    x = torch.zeros(1, device="cuda:0")
    with torch.cuda.stream(other):
        torch.cuda._sleep(int(3e9))  # ~1.5 s of unrelated work
    with torch.cuda.stream(producer):
        torch.cuda._sleep(int(3e8))  # the "model" still writing KV
        x.fill_(7)
        ev = be.record_ready()
    assert not producer.query()
    t = time.perf_counter()
    be.wait_ready(ev)
    waited = time.perf_counter() - t
    assert producer.query(), "wait_ready returned before the producing stream reached the event"
    assert not other.query(), "wait_ready synchronized the whole device"
    assert waited > 0.02
    other.synchronize()
    assert x.item() == 7
    be.wait_ready(None)


def test_push_between_processes_through_nixl() -> None:
    """P and D processes with real NIXL agents (UCX cuda_ipc between GPUs): every strategy and the
    engine move a small request byte-exactly (the benchmark's own verification, at --quick size)."""
    pytest.importorskip("nixl")
    from kvpush_tools.cuda.bench import main

    rc = main(
        [
            "--quick",
            "--patterns",
            "shuffled,contiguous",
            "--strategies",
            "staged,pipelined:4,coalesced,per_block",
            "--write-descs",
            "1,4",
            "--engine-parts",
            "2,1,-1",
            "--lw-tokens",
            "256",
            "--lw-iters",
            "1",
        ]
    )
    assert rc == 0, "a transfer was not byte-exact on D (see the table above)"


def test_peer_copy_writes_another_process_kv_in_place() -> None:
    """CUDA IPC peer copy: D's process exports its KV, P's maps it and copies block pieces straight into
    D's blocks in one launch; D's regions then hold exactly P's blocks there and zeros elsewhere. A blob from
    another host is out of reach (None), a malformed one an error."""
    import multiprocessing as mp

    import msgspec
    from cuda_helpers import peer_child, region_bytes

    from kvpush_cuda import ipc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=peer_child, args=(child, D_DEV))
    proc.start()
    try:
        blob, d_layout = parent.recv()
        assert blob, "export_peer gave nothing"
        be = CudaBackend(device=0)
        kv = _cuda_kv("LBNHC", 32, 0)
        fill_random(kv, 5)
        p_layout = be.describe(kv, spec_for("LBNHC", 16, 2, 64))
        peer = be.open_peer(blob, d_layout)
        assert peer is not None, "a same-host D's export did not map"
        src_blocks, dst_blocks = [3, 7, 1, 30], [9, 2, 20, 5]
        n = p_layout.block_bytes
        pieces = np.array(
            [
                [s * p_layout.block_stride, d * d_layout.block_stride, n]
                for s, d in zip(src_blocks, dst_blocks, strict=True)
            ],
            dtype=np.int64,
        )
        src_bases = [r.base for r in p_layout.regions]
        dst_bases = [r.base for r in d_layout.regions]
        first, rest = pieces[:2], pieces[2:]  # one prepared launch (tables uploaded ahead), one not
        be.prepare_peer_copy(peer, src_bases, dst_bases, first)
        be.wait_ready(be.start_peer_copy(peer, src_bases, dst_bases, first))
        assert be.copy_stats()["prepared_calls"] == 1
        be.wait_ready(be.start_peer_copy(peer, src_bases, dst_bases, rest))
        parent.send("read")
        got = parent.recv()
        want = [region_bytes(torch, r.base, r.size, 0) for r in p_layout.regions]
        for r, (g, w) in enumerate(zip(got, want, strict=True)):
            exp = np.zeros_like(g)
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                so, do = s * p_layout.block_stride, d * d_layout.block_stride
                exp[do : do + n] = w[so : so + n]
            np.testing.assert_array_equal(g, exp, err_msg=f"region {r}")
        be.close_peer(peer)
        exp_blob = msgspec.msgpack.decode(blob, type=ipc.Export)
        other = msgspec.msgpack.encode(msgspec.structs.replace(exp_blob, boot_id="another-host"))
        assert be.open_peer(other, d_layout) is None
        with pytest.raises(BackendError, match="malformed"):
            be.open_peer(b"\x01garbage", d_layout)
    finally:
        parent.send("bye")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
