"""Host backend: pack/unpack move exactly the listed bytes, and ``describe`` finds every KV element where torch has it.

Pack/unpack is the staged plan's local copy: a wrong byte here is KV
corruption just like a wrong descriptor. ``describe`` is checked against
``data_ptr()`` of individual tensor elements, the ground truth of where vLLM's
attention kernels read, and end to end through the layout mapping.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.backends.base import CacheSpec
from kvpush.backends.host import HostBackend, gather, scatter
from kvpush.core.errors import BackendError
from kvpush.core.layout import MemKind, TokenOrder
from kvpush.core.pieces import coalesce, descriptors, map_pieces

# -- pack / unpack --------------------------------------------------------------------


def _regions(rng: np.random.Generator, count: int, size: int) -> list[np.ndarray]:
    return [rng.integers(1, 256, size, dtype=np.uint8) for _ in range(count)]


def _addrs(arrays: list[np.ndarray]) -> list[int]:
    return [int(a.ctypes.data) for a in arrays]


def _reference_gather(arrays: list[np.ndarray], pieces: np.ndarray) -> np.ndarray:
    chunks = [a[o : o + n] for a in arrays for o, n in pieces.tolist()]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)


def _reference_scatter(arrays: list[np.ndarray], pieces: np.ndarray, staged: np.ndarray) -> None:
    pos = 0
    for a in arrays:
        for o, n in pieces.tolist():
            a[o : o + n] = staged[pos : pos + n]
            pos += n


@st.composite
def piece_sets(draw) -> tuple[int, int, np.ndarray]:
    """(region count, region size, pieces): non-overlapping pieces, either equal-and-aligned or arbitrary."""
    kind = draw(st.sampled_from(["uniform", "uniform_unaligned", "ragged"]))
    count = draw(st.integers(1, 4))
    if kind == "uniform":
        length = draw(st.sampled_from([1, 2, 8, 24, 64]))
        slots = draw(st.integers(1, 40))
        chosen = draw(st.lists(st.integers(0, slots - 1), min_size=1, max_size=slots, unique=True))
        size = slots * length + draw(st.integers(0, length - 1 if length > 1 else 0))
        pieces = [(s * length, length) for s in chosen]
    else:
        bounds = sorted(draw(st.lists(st.integers(0, 2000), min_size=2, max_size=60, unique=True)))
        spans = list(itertools.pairwise(bounds))
        picked = draw(st.lists(st.sampled_from(spans), min_size=1, max_size=len(spans), unique=True))
        if kind == "uniform_unaligned":
            length = min(b - a for a, b in picked)
            picked = [(a, a + length) for a, b in picked]
        pieces = [(a, b - a) for a, b in picked]
        size = bounds[-1] + draw(st.integers(0, 5))
    order = draw(st.permutations(range(len(pieces))))
    return count, size, np.array([pieces[i] for i in order], dtype=np.int64).reshape(-1, 2)


@settings(max_examples=150, deadline=None)
@given(piece_sets(), st.integers(0, 2**32 - 1))
def test_gather_scatter_match_reference(case, seed: int) -> None:
    count, size, pieces = case
    rng = np.random.default_rng(seed)
    regions = _regions(rng, count, size)
    before = [r.copy() for r in regions]
    out = np.zeros(count * int(pieces[:, 1].sum()), np.uint8)
    gather(_addrs(regions), pieces, out)
    assert np.array_equal(out, _reference_gather(regions, pieces))
    for r, b in zip(regions, before, strict=True):
        assert np.array_equal(r, b), "gather wrote into a region"

    staged = rng.integers(0, 256, out.size, dtype=np.uint8)
    targets = [np.zeros(size, np.uint8) for _ in range(count)]
    expected = [np.zeros(size, np.uint8) for _ in range(count)]
    scatter(_addrs(targets), pieces, staged)
    _reference_scatter(expected, pieces, staged)
    for i, (got, want) in enumerate(zip(targets, expected, strict=True)):
        assert np.array_equal(got, want), f"region {i}: {np.flatnonzero(got != want)[:8]}"


@pytest.mark.parametrize("uniform", [True, False])
def test_backend_pack_unpack_round_trip(uniform: bool) -> None:
    """pack into a staging buffer from ``alloc_staging``, unpack into fresh regions: same bytes, nothing else."""
    rng = np.random.default_rng(7)
    backend = HostBackend()
    if uniform:
        pieces = np.array([[64, 32], [0, 32], [320, 32], [96, 32]], dtype=np.int64)
    else:
        pieces = np.array([[100, 7], [0, 33], [400, 1], [40, 50]], dtype=np.int64)
    regions = _regions(rng, 3, 512)
    total = 3 * int(pieces[:, 1].sum())
    staging = backend.alloc_staging(total + 16, device_id=0)
    assert staging.mem is MemKind.DRAM and staging.size == total + 16
    buf = staging.owner
    buf[total:] = 0xAB
    backend.pack(_addrs(regions), pieces, staging.addr)
    assert np.array_equal(buf[:total], _reference_gather(regions, pieces))
    assert (buf[total:] == 0xAB).all(), "pack wrote past its bytes"

    targets = [np.zeros(512, np.uint8) for _ in range(3)]
    backend.unpack(_addrs(targets), pieces, staging.addr)
    for src, dst in zip(regions, targets, strict=True):
        moved = np.zeros(512, bool)
        for o, n in pieces.tolist():
            moved[o : o + n] = True
        assert np.array_equal(dst[moved], src[moved])
        assert not dst[~moved].any(), "unpack wrote outside the pieces"


def test_empty_pieces_are_a_no_op() -> None:
    backend = HostBackend()
    region = np.arange(64, dtype=np.uint8)
    staging = backend.alloc_staging(8)
    staging.owner[:] = 9
    empty = np.zeros((0, 2), dtype=np.int64)
    backend.pack([int(region.ctypes.data)], empty, staging.addr)
    backend.unpack([int(region.ctypes.data)], empty, staging.addr)
    assert (staging.owner == 9).all() and np.array_equal(region, np.arange(64, dtype=np.uint8))


def test_layout_pieces_pack_like_descriptors() -> None:
    """pack over ``map_pieces`` output (src offsets) equals reading the local descriptors in order."""
    rng = np.random.default_rng(3)
    t = torch.from_numpy(rng.integers(1, 1000, (2, 6, 8, 4, 16)).astype(np.float16))
    spec = CacheSpec(block_size=8, num_heads=4, head_dim=16, dtype="float16")
    lay = HostBackend().describe({"l0": t}, spec)
    pieces = coalesce(map_pieces(lay, lay, [4, 1, 2], [0, 3, 5], 21, 5))
    local, _ = descriptors(pieces, lay, lay)
    backend = HostBackend()
    staging = backend.alloc_staging(int(local[:, 1].sum()))
    backend.pack([r.base for r in lay.regions], pieces[:, [0, 2]], staging.addr)
    expected = b"".join(ctypes.string_at(a, n) for a, n, _ in local.tolist())
    assert staging.owner.tobytes() == expected


# -- describe ---------------------------------------------------------------------------------


def _kv(order: str, num_blocks: int, block_size: int, heads: int, dim: int, dtype=torch.float16, seed: int = 0):
    shape = (2, num_blocks, block_size, heads, dim) if order == "NHD" else (2, num_blocks, heads, block_size, dim)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, shape, generator=g).to(dtype)


def _element(t: torch.Tensor, order: str, kv: int, block: int, tok: int, head: int) -> int:
    return (t[kv, block, tok, head] if order == "NHD" else t[kv, block, head, tok]).data_ptr()


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_describe_addresses_match_tensor_elements(order: str, dtype) -> None:
    nb, bs, heads, dim = 5, 4, 2, 8
    layers = {f"layer.{i}": _kv(order, nb, bs, heads, dim, dtype, seed=i) for i in range(3)}
    axes = "KBNHC" if order == "NHD" else "KBHNC"
    spec = CacheSpec(block_size=bs, num_heads=heads, head_dim=dim, dtype=str(dtype).removeprefix("torch."), axes=axes)
    lay = HostBackend().describe(layers, spec)
    item = torch.empty(0, dtype=dtype).element_size()
    assert lay.order == TokenOrder(order) and lay.mem is MemKind.DRAM
    assert (lay.block_size, lay.num_blocks, lay.local_heads, lay.head_start) == (bs, nb, heads, 0)
    assert lay.head_bytes == dim * item
    assert len(lay.regions) == 2 * len(layers)
    for i, t in enumerate(layers.values()):
        assert lay.block_stride == t.stride(1) * item
        for kv in range(2):
            region = lay.regions[2 * i + kv]
            assert region.size == nb * bs * heads * dim * item
            assert region.device_id == 0
            for b in range(nb):
                for tok in range(bs):
                    for h in range(heads):
                        inner = (tok * heads + h) if order == "NHD" else (h * bs + tok)
                        addr = region.base + b * lay.block_stride + inner * lay.head_bytes
                        assert addr == _element(t, order, kv, b, tok, h), (i, kv, b, tok, h)
            last = t[kv, -1].reshape(-1)[-1]
            assert region.base + region.size == last.data_ptr() + item, "region must end at the last element"


def test_describe_block_stride_larger_than_block() -> None:
    """Blocks padded (a view into a wider allocation): the stride is the tensor's, not the payload size."""
    big = torch.zeros(2, 4, 3, 8, 2, 8, dtype=torch.float16)  # [2, blocks, pad, bs, heads, dim]
    t = big[:, :, 1]
    lay = HostBackend().describe({"l": t}, CacheSpec(block_size=8, num_heads=2, head_dim=8, dtype="float16"))
    assert lay.block_stride == 3 * 8 * 2 * 8 * 2 > lay.block_bytes
    assert lay.regions[1].base == t[1, 0, 0, 0].data_ptr()
    assert lay.regions[0].base + 2 * lay.block_stride + (5 * 2 + 1) * 16 == t[0, 2, 5, 1].data_ptr()
    # The region ends at its last payload byte: registering the pad after V's last block would overrun.
    assert lay.regions[1].size == 3 * lay.block_stride + lay.block_bytes
    assert lay.regions[1].base + lay.regions[1].size == t[1, -1, -1, -1, -1].data_ptr() + 2


def test_describe_numpy_and_unsplit_kv() -> None:
    """numpy arrays work as well as tensors; axes without K give one region per layer."""
    arr = np.zeros((6, 2, 16, 4), dtype=np.float32)  # [blocks, heads, bs, dim] (HND)
    spec = CacheSpec(block_size=16, num_heads=2, head_dim=4, dtype="float32", axes="BHNC")
    lay = HostBackend().describe({"a": arr, "b": arr.copy()}, spec)
    assert len(lay.regions) == 2
    assert lay.regions[0].base == arr.ctypes.data
    assert lay.block_stride == 2 * 16 * 4 * 4


@pytest.mark.parametrize(
    ("num_heads", "tp_size", "starts"),
    [
        (4, 1, [0]),
        (4, 2, [0, 2]),
        (8, 4, [0, 2, 4, 6]),
        (4, 4, [0, 1, 2, 3]),
        # More ranks than KV heads: vLLM replicates each head over tp/num_heads consecutive ranks.
        (2, 4, [0, 0, 1, 1]),
        (1, 2, [0, 0]),
        (2, 8, [0, 0, 0, 0, 1, 1, 1, 1]),
    ],
)
def test_describe_head_slice_per_tp_rank(num_heads: int, tp_size: int, starts: list[int]) -> None:
    """Head ranges follow vLLM's sharding (``QKVParallelLinear``: rank r holds shard r // replicas)."""
    local = max(1, num_heads // tp_size)
    got = []
    for rank in range(tp_size):
        spec = CacheSpec(block_size=4, num_heads=num_heads, head_dim=8, dtype="float16", tp_rank=rank, tp_size=tp_size)
        lay = HostBackend().describe({"l": _kv("NHD", 2, 4, local, 8)}, spec)
        assert lay.local_heads == local and lay.num_heads == num_heads
        got.append(lay.head_start)
    assert got == starts


def test_describe_then_push_between_tensors() -> None:
    """P (tp=1, NHD, block 16) pushes to D rank 1 of tp=2 (HND, block 8) through real tensor memory."""
    heads, dim = 4, 8
    p_t = {f"l{i}": _kv("NHD", 4, 16, heads, dim, seed=10 + i) for i in range(2)}
    d_t = {f"l{i}": torch.zeros(2, 10, heads // 2, 8, dim, dtype=torch.float16) for i in range(2)}
    p = HostBackend().describe(p_t, CacheSpec(block_size=16, num_heads=heads, head_dim=dim, dtype="float16"))
    d = HostBackend().describe(
        d_t,
        CacheSpec(block_size=8, num_heads=heads, head_dim=dim, dtype="float16", tp_rank=1, tp_size=2, axes="KBHNC"),
    )
    p_blocks, d_blocks, n, start = [3, 0, 2], [9, 1, 4, 0, 7, 2], 41, 8
    local, remote = descriptors(coalesce(map_pieces(p, d, p_blocks, d_blocks, n, start)), p, d)
    for (sa, ln, _), (da, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        ctypes.memmove(da, sa, ln)
    for name in p_t:
        src, dst = p_t[name], d_t[name]
        want = torch.zeros_like(dst)
        for tok in range(start, n):
            pb, db = p_blocks[tok // 16], d_blocks[tok // 8]
            for h in range(2, 4):
                want[:, db, h - 2, tok % 8] = src[:, pb, tok % 16, h]
        assert torch.equal(dst, want), name


@pytest.mark.parametrize(
    ("tensors", "spec_changes", "words"),
    [
        ({}, {}, ["no KV cache tensors"]),
        ({"l": [1, 2, 3]}, {}, ["unsupported", "list"]),
        ({"l": torch.zeros(6, 4, 2, 8)}, {}, ["layer l", "4 dims", "KBNHC"]),
        ({"l": torch.zeros(3, 6, 4, 2, 8)}, {}, ["layer l", "K=3, expected 2"]),
        ({"l": torch.zeros(2, 6, 4, 2, 8)}, {"axes": "BNHC"}, ["5 dims", "BNHC"]),
        ({"l": torch.zeros(2, 6, 4, 3, 8)}, {}, ["H=3, expected 2", "(2, 6, 4, 3, 8)"]),
        ({"l": torch.zeros(2, 6, 4, 2, 8)}, {"axes": "KBHNC"}, ["H=4, expected 2", "KBHNC"]),
        ({"l": torch.zeros(2, 6, 4, 2, 16)[..., :8]}, {}, ["not dense"]),
        ({"l": torch.zeros(2, 6, 4, 8, 2).transpose(3, 4)}, {}, ["content is not contiguous"]),
        ({"l": torch.zeros(2, 6, 4, 2, 8)}, {"attention": "FLASH_ATTN"}, ["FLASH_ATTN", "CPU_ATTN", "CPU_MLA"]),
        ({"l": torch.zeros(2, 6, 4, 2, 8, device="meta")}, {}, ["l", "meta", "cpu"]),
        ({"a": torch.zeros(2, 6, 4, 2, 8), "b": torch.zeros(2, 7, 4, 2, 8)}, {}, ["b", "geometry", "differs"]),
        (
            {"a": torch.zeros(2, 6, 4, 2, 8), "b": torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16)},
            {},
            ["b", "geometry"],
        ),
        ({"l": torch.zeros(2, 6, 4, 2, 8)}, {"tp_rank": 2, "tp_size": 2}, ["TP rank 2 of 2"]),
        ({"l": torch.zeros(2, 6, 4, 1, 8)}, {"num_heads": 3, "tp_size": 2}, ["3 KV heads", "TP 2"]),
    ],
)
def test_describe_rejects(tensors: dict, spec_changes: dict, words: list[str]) -> None:
    spec = CacheSpec(**{"block_size": 4, "num_heads": 2, "head_dim": 8, "dtype": "float32", **spec_changes})
    with pytest.raises(BackendError) as info:
        HostBackend().describe(tensors, spec)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_registrations_merge_k_and_v_of_one_tensor() -> None:
    """K and V of one ``[2, ...]`` tensor are back to back: one NIXL registration per tensor."""
    layers = {f"l{i}": _kv("NHD", 3, 4, 2, 8, seed=i) for i in range(2)}
    backend = HostBackend()
    lay = backend.describe(layers, CacheSpec(block_size=4, num_heads=2, head_dim=8, dtype="float16"))
    regs = backend.registrations(lay)
    assert sorted((r.addr, r.size) for r in regs) == sorted((t.data_ptr(), t.nbytes) for t in layers.values())
    assert all(r.mem is MemKind.DRAM for r in regs)
