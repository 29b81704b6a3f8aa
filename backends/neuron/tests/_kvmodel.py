"""An independent model of the Neuron KV layouts, for checking byte mappings.

Each layout is addressed here the way a model reads it, by numpy indexing
(``cache[kv, block, head, token]``, ``cache[block, token, head]`` or
``cache[slot, head, token]``), never by
byte offsets, so it checks ``map_pieces`` and the layout specs rather than
restating them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backends.base import CacheSpec
from kvpush_neuron.layout import nxdi_bhsd_spec, nxdi_block_spec, nxdi_kv_caches, paged_spec

KINDS = ("paged", "nxdi_block", "bhsd")


@dataclass(frozen=True)
class Side:
    """One rank's cache: ``kind``, geometry and which heads it holds.

    For ``bhsd`` ``block_size`` is ``max_seq_len`` and ``num_blocks`` the
    number of sequence slots.
    """

    kind: str
    layers: int
    heads: int
    tp_rank: int
    tp_size: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int

    @property
    def local_heads(self) -> int:
        return max(1, self.heads // self.tp_size)

    @property
    def head_start(self) -> int:
        return (self.tp_rank * self.local_heads) % self.heads

    def shapes(self) -> list[tuple[int, ...]]:
        """Tensor shapes in the order ``kv_caches`` lists them."""
        hl, d, bs, nb = self.local_heads, self.head_dim, self.block_size, self.num_blocks
        if self.kind == "paged":  # vLLM-Neuron's initialize_kv_cache: (2, num_blocks, kv_heads, block_size, head_size)
            return [(2, nb, hl, bs, d)] * self.layers
        if self.kind == "nxdi_block":
            return [(nb, bs, hl, d)] * (2 * self.layers)
        return [(nb, hl, bs, d)] * (2 * self.layers)

    def spec(self) -> CacheSpec:
        make = {"paged": paged_spec, "nxdi_block": nxdi_block_spec, "bhsd": nxdi_bhsd_spec}[self.kind]
        return make(self.block_size, self.heads, self.head_dim, self.dtype, self.tp_rank, self.tp_size)

    def kv_caches(self, tensors: list[Any]) -> dict[str, Any]:
        if self.kind == "paged":
            return {f"layers.{i}": t for i, t in enumerate(tensors)}
        return nxdi_kv_caches(tensors)

    def capacity(self, blocks: list[int]) -> int:
        """Tokens a request with these block ids can hold."""
        return self.block_size if self.kind == "bhsd" else len(blocks) * self.block_size

    def token(self, arrays: list[np.ndarray], blocks: list[int], t: int, layer: int, kv: int) -> np.ndarray:
        """View ``[local_heads, head_dim]`` of token ``t`` of the request in ``blocks``."""
        bs = self.block_size
        if self.kind == "paged":
            return arrays[layer][kv, blocks[t // bs], :, t % bs]
        if self.kind == "nxdi_block":
            return arrays[2 * layer + kv][blocks[t // bs], t % bs]
        return arrays[2 * layer + kv][blocks[0], :, t, :]


def expected_after(
    src: Side,
    src_arrays: list[np.ndarray],
    src_blocks: list[int],
    dst: Side,
    dst_before: list[np.ndarray],
    dst_blocks: list[int],
    num_tokens: int,
    start_token: int,
) -> list[np.ndarray]:
    """D's caches after a correct push: tokens ``[start, num_tokens)`` of the shared heads replaced."""
    out = [a.copy() for a in dst_before]
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.local_heads, dst.head_start + dst.local_heads)
    for layer in range(src.layers):
        for kv in range(2):
            for t in range(start_token, num_tokens):
                d = dst.token(out, dst_blocks, t, layer, kv)
                s = src.token(src_arrays, src_blocks, t, layer, kv)
                d[lo - dst.head_start : hi - dst.head_start] = s[lo - src.head_start : hi - src.head_start]
    return out


def random_arrays(side: Side, seed: int) -> list[np.ndarray]:
    """Random bytes viewed as the side's dtype (any bit pattern; compare as bytes)."""
    rng = np.random.default_rng(seed)
    item = np.dtype(side.dtype).itemsize
    out = []
    for shape in side.shapes():
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * item, dtype=np.uint8)
        out.append(raw.view(side.dtype).reshape(shape))
    return out


def same_bytes(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b, strict=True)
    )
