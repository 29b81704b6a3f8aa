"""NxDI and vLLM-Neuron cache layouts mapped onto each other, property-based.

Caches live in numpy arrays here (the mapping is pure; no device needed):
the layouts come from ``kvpush_neuron.layout``'s specs, the byte pieces from
the core's ``map_pieces``, and the result is checked against ``_kvmodel``,
which reads the caches by indexing, not by offsets.
"""

from __future__ import annotations

import ctypes

import msgspec
import numpy as np
import pytest
from _kvmodel import KINDS, Side, expected_after, random_arrays, same_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.backends.tensors import describe_strided
from kvpush.core.errors import LayoutError
from kvpush.core.layout import MemKind, TokenOrder
from kvpush.core.pieces import coalesce, coalesce_in_dst_order, descriptors, map_pieces
from kvpush_neuron import NeuronTensor
from kvpush_neuron.layout import nxdi_kv_caches, slot_of, virtual_blocks

DTYPES = ("float16", "float32", "uint8")


def describe_host(side: Side, arrays: list[np.ndarray]):
    return describe_strided(side.kv_caches(arrays), side.spec(), MemKind.DRAM, "cpu")[0]


def apply(pieces: np.ndarray, src_layout, dst_layout) -> None:
    """Copy every piece of every region pair, through the core's absolute descriptors."""
    local, remote = descriptors(pieces, src_layout, dst_layout)
    for (sa, ln, _), (da, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        ctypes.memmove(da, sa, ln)


@st.composite
def sides(draw: st.DrawFn) -> tuple[Side, list[int], Side, list[int], int, int]:
    """A P side and a D side of any two kinds, sharing at least one head, and a request."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    layers = draw(st.integers(1, 3))
    shared_head = draw(st.integers(0, heads - 1))
    num_tokens = draw(st.integers(1, 40))
    start_token = draw(st.integers(0, num_tokens))
    out: list = []
    for _ in range(2):
        kind = draw(st.sampled_from(KINDS))
        tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if heads % t == 0]))
        rank = shared_head // (heads // tp)
        if kind == "bhsd":
            max_seq = draw(st.integers(num_tokens, num_tokens + 8))
            slots = draw(st.integers(1, 4))
            side = Side(kind, layers, heads, rank, tp, head_dim, dtype, max_seq, slots)
            blocks = [draw(st.integers(0, slots - 1))]
        else:
            bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
            need = -(-num_tokens // bs)
            nb = need + draw(st.integers(0, 4))
            side = Side(kind, layers, heads, rank, tp, head_dim, dtype, bs, nb)
            blocks = draw(st.permutations(list(range(nb))))[:need]
        out += [side, blocks]
    return (*out, num_tokens, start_token)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sides(), seed=st.integers(0, 2**32 - 1), merge=st.sampled_from(["none", "coalesce", "dst_order"]))
def test_push_between_any_neuron_layouts_moves_exactly_the_requested_tokens(case, seed, merge) -> None:
    src, src_blocks, dst, dst_blocks, num_tokens, start = case
    src_arrays = random_arrays(src, seed)
    dst_arrays = random_arrays(dst, seed + 1)
    before = [a.copy() for a in dst_arrays]
    want = expected_after(src, src_arrays, src_blocks, dst, before, dst_blocks, num_tokens, start)
    src_layout, dst_layout = describe_host(src, src_arrays), describe_host(dst, dst_arrays)

    pieces = map_pieces(src_layout, dst_layout, src_blocks, dst_blocks, num_tokens, start)
    pieces = {"none": pieces, "coalesce": coalesce(pieces), "dst_order": coalesce_in_dst_order(pieces)}[merge]
    apply(pieces, src_layout, dst_layout)

    assert same_bytes(dst_arrays, want)
    assert same_bytes(src_arrays, random_arrays(src, seed)), "the source must not change"


@settings(max_examples=60, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4]),
    max_seq=st.integers(1, 64),
    head_dim=st.sampled_from([2, 8]),
    slots=st.integers(1, 4),
)
def test_bhsd_slot_is_one_hnd_block(heads: int, max_seq: int, head_dim: int, slots: int) -> None:
    """A BHSD cache is an HND layout whose block is a whole slot: the strides say so."""
    side = Side("bhsd", 1, heads, 0, 1, head_dim, "float16", max_seq, slots)
    arrays = random_arrays(side, 0)
    lay = describe_host(side, arrays)
    assert lay.order == TokenOrder.HND
    assert (lay.block_size, lay.num_blocks) == (max_seq, slots)
    assert lay.block_stride == arrays[0].strides[0] == heads * max_seq * head_dim * 2
    assert [r.base for r in lay.regions] == [a.ctypes.data for a in arrays]


@given(slot=st.integers(0, 50), data=st.data())
def test_virtual_blocks_roundtrip(slot: int, data: st.DataObject) -> None:
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    max_seq = bs * data.draw(st.integers(1, 16))
    n = data.draw(st.integers(1, max_seq))
    ids = virtual_blocks(slot, n, max_seq, bs)
    assert len(ids) == -(-n // bs)
    assert slot_of(ids, max_seq, bs) == slot


def test_slot_of_refuses_scattered_blocks() -> None:
    with pytest.raises(LayoutError, match="not the leading virtual blocks"):
        slot_of([4, 6], 64, 16)
    with pytest.raises(LayoutError, match="not a multiple"):
        virtual_blocks(0, 10, 60, 16)


def test_nxdi_kv_caches_pairs_k_and_v_per_layer() -> None:
    assert list(nxdi_kv_caches(["k0", "v0", "k1", "v1"]).items()) == [
        ("layers.0.k", "k0"),
        ("layers.0.v", "v0"),
        ("layers.1.k", "k1"),
        ("layers.1.v", "v1"),
    ]
    with pytest.raises(LayoutError, match="odd number"):
        nxdi_kv_caches(["k0", "v0", "k1"])


@pytest.mark.parametrize("kind", KINDS)
def test_runtime_tensors_describe_like_host_arrays(backend, kind: str) -> None:
    """The backend's layout of Neuron tensors equals the host layout of the same shapes, addresses aside."""
    side = Side(kind, 2, 4, 1, 2, 8, "float16", 16, 3)
    arrays = random_arrays(side, 3)
    tensors = [NeuronTensor(backend.runtime, a.shape, side.dtype, 0) for a in arrays]
    try:
        dev = backend.describe(side.kv_caches(tensors), side.spec())
        host = describe_host(side, arrays)
        strip = {"regions": (), "mem": MemKind.DRAM}
        assert msgspec.structs.replace(dev, **strip) == msgspec.structs.replace(host, **strip)
        firsts = dev.regions[::2] if kind == "paged" else dev.regions
        assert [r.base for r in firsts] == [t.va for t in tensors]
    finally:
        for t in tensors:
            t.free()
