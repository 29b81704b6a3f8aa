"""The shared KV geometry (``kvpush.core.geometry``): its sizes and its engine spec agree with the conformance model's
logical cache and with ``CacheSpec``'s heads, for every geometry the tests and benchmarks build."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvpush.conformance.model import Geom
from kvpush.core.geometry import DTYPE_BYTES

geometries = st.builds(
    Geom,
    layers=st.integers(1, 4),
    num_blocks=st.integers(1, 64),
    block_size=st.sampled_from([1, 2, 16, 32]),
    num_heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([1, 8, 64]),
    order=st.sampled_from(["NHD", "HND"]),
    dtype=st.sampled_from(sorted(DTYPE_BYTES)),
    tp_size=st.sampled_from([1, 2, 4]),
).flatmap(lambda g: st.builds(lambda r: Geom(**{**g.__dict__, "tp_rank": r}), st.integers(0, g.tp_size - 1)))


@given(geometries)
def test_sizes_are_the_model_caches(g: Geom) -> None:
    """A layer's bytes are the model's logical layer (K/V, blocks, block), a block's one block of one of K/V."""
    assert g.layer_bytes == math.prod(g.layer_shape())
    assert g.block_bytes == math.prod(g.layer_shape()[2:])
    assert g.token_bytes * g.block_size == g.block_bytes
    assert g.head_bytes == g.head_dim * DTYPE_BYTES[g.dtype]


@given(geometries, st.integers(0, 1000))
def test_spec_and_blocks(g: Geom, tokens: int) -> None:
    """The engine's spec holds the geometry (its heads per rank too); a request takes whole blocks."""
    spec = g.spec()
    assert (spec.block_size, spec.num_heads, spec.head_dim, spec.dtype) == (
        g.block_size,
        g.num_heads,
        g.head_dim,
        g.dtype,
    )
    assert (spec.tp_rank, spec.tp_size, spec.local_heads) == (g.tp_rank, g.tp_size, g.local_heads)
    assert spec.axes == ("KBNHC" if g.order == "NHD" else "KBHNC")
    n = g.blocks_for(tokens)
    assert (n - 1) * g.block_size < tokens <= n * g.block_size or tokens == n == 0
