"""The KV geometry of one rank's cache, as the doctor's self-test, the conformance suite, the tests and the
CUDA benchmark allocate it.

A cache is ``layers`` layers of ``[K/V, num_blocks, block]``; a block holds
``block_size`` tokens of ``local_heads`` heads of ``head_dim`` elements of
``dtype``, token-major (``NHD``) or head-major (``HND``); the rank is
``tp_rank`` of ``tp_size``, holding ``local_heads`` of the model's
``num_heads`` KV heads. Only sizes are derived here: where a byte lives is
the backend's ``describe`` and ``kvpush.core.layout``'s to say, and a test model
that checks them keeps its own rule (``kvpush.conformance.model``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.core.layout import CacheSpec

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Bytes of one element of each KV dtype a cache may have here: tests, benchmarks, the Neuron backend's tensors."""


@dataclass(frozen=True)
class KVGeometry:
    """One rank's KV cache: layers, blocks, block size, heads and their elements, in-block order, TP rank."""

    layers: int = 2
    num_blocks: int = 32
    block_size: int = 16
    num_heads: int = 4
    head_dim: int = 8
    order: str = "NHD"
    dtype: str = "float16"
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def local_heads(self) -> int:
        """KV heads this rank holds (a head is replicated when there are more ranks than heads)."""
        return max(1, self.num_heads // self.tp_size)

    @property
    def head_bytes(self) -> int:
        return self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """One token's bytes in one layer's K (or V)."""
        return self.local_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        """One block's bytes in one layer's K (or V)."""
        return self.block_size * self.token_bytes

    @property
    def layer_bytes(self) -> int:
        """One layer's bytes: K and V of every block."""
        return 2 * self.num_blocks * self.block_bytes

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens takes."""
        return -(-tokens // self.block_size)

    def spec(self) -> CacheSpec:
        """The cache as an engine declares it: a leading K/V axis, then blocks, in-block axes in ``order``."""
        axes = "KBNHC" if self.order == "NHD" else "KBHNC"
        return CacheSpec(self.block_size, self.num_heads, self.head_dim, self.dtype, self.tp_rank, self.tp_size, axes)
