"""Read-run planning for host-staging packs: few device reads, same bytes."""

from __future__ import annotations

import numpy as np
from _kvmodel import Side, random_arrays
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.backends.tensors import describe_strided
from kvpush.core.layout import MemKind
from kvpush.core.payload import unpack_pieces
from kvpush.core.pieces import map_pieces
from kvpush_neuron import NeuronBackend, NeuronTensor
from kvpush_neuron.runs import read_runs


@settings(max_examples=100, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 300)), min_size=1, max_size=40),
    gap=st.integers(0, 2000),
)
def test_runs_cover_every_piece_and_keep_its_bytes(pieces: list[tuple[int, int]], gap: int) -> None:
    p = np.array(pieces, dtype=np.int64)
    runs, remapped = read_runs(p, gap)
    src = np.random.default_rng(0).integers(0, 256, 6000, dtype=np.uint8)
    scratch = np.concatenate([src[o : o + n] for o, n, _ in runs.tolist()])
    assert runs[:, 2].tolist() == np.concatenate(([0], np.cumsum(runs[:, 1])[:-1])).tolist()
    starts, ends = runs[:, 0], runs[:, 0] + runs[:, 1]
    assert (starts[1:] > ends[:-1] + gap).all(), "runs closer than the gap must have been merged"
    for (o, n), (r, n2) in zip(p.tolist(), remapped.tolist(), strict=True):
        assert n == n2 and np.array_equal(scratch[r : r + n], src[o : o + n])


def test_host_pack_of_head_major_slot_reads_each_region_once(nrt_lib: str) -> None:
    """NxDI BHSD (head-major) into token-major blocks: one piece per token and head, one read per region."""
    p = Side("bhsd", 2, 4, 0, 1, 16, "float16", 64, 2)
    d = Side("nxdi_block", 2, 4, 0, 1, 16, "float16", 16, 8)
    b = NeuronBackend(mode="host_staging", mem="DRAM", lib=nrt_lib)
    tensors = [NeuronTensor(b.runtime, s, p.dtype, 0) for s in p.shapes()]
    try:
        for t, a in zip(tensors, random_arrays(p, 5), strict=True):
            t.write_bytes(a.view(np.uint8).reshape(-1))
        lp = b.describe(p.kv_caches(tensors), p.spec())
        dst_arrays = random_arrays(d, 6)
        ld = describe_strided(d.kv_caches(dst_arrays), d.spec(), MemKind.DRAM, "cpu")[0]
        pieces = map_pieces(lp, ld, [1], [0, 3, 6], 40)  # ascending: D order is token order
        assert pieces.shape[0] == 40 * 4  # a piece per token and head
        order = pieces[np.argsort(pieces[:, 1], kind="stable")][:, [0, 2]]
        staging = b.alloc_staging(int(order[:, 1].sum()) * len(lp.regions))
        b.pack([r.base for r in lp.regions], order, staging.addr)
        assert b.runtime_calls == len(lp.regions)
        # and the staged bytes are what D unpacks: token-major, heads in order
        back = unpack_pieces(lp, ld, [0, 3, 6], 40, 0)
        assert int(back[:, 1].sum()) == int(order[:, 1].sum())
        got = np.frombuffer(staging.owner[1][: int(order[:, 1].sum())], dtype=p.dtype).reshape(40, 4, 16)
        k0 = random_arrays(p, 5)[0][1]  # layer 0 K, slot 1: [heads, tokens, dim]
        assert np.array_equal(got.view(np.uint8), k0[:, :40, :].transpose(1, 0, 2).copy().view(np.uint8))
    finally:
        b.close()
        for t in tensors:
            t.free()
