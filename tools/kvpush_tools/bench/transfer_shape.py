"""The request ``kvpush bench transfer`` pushes: one rank's KV geometry and the prompt length (:class:`Shape`), each
side's block ids by pattern, the cache it fills, the digest that says D's bytes equal P's, and the descriptors a
connector without coalescing posts.

Nothing of ``kvpush`` is imported at module level: with ``--tree`` the side processes import another checkout's
``kvpush``, where today's types may not exist."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

PATTERNS = ("shuffled", "runs16", "contiguous")
RUN = 16


@dataclass(frozen=True)
class Shape:
    """One rank's KV geometry and the request length; elements are ``dtype_bytes`` wide.

    Not ``kvpush.core.geometry.KVGeometry``, on purpose: a shape is sent to the side processes, which with
    ``--tree`` import another checkout's ``kvpush`` (an old commit's, for an A/B), where that type may not
    exist; so the shape is this module's own, and nothing of ``kvpush`` is imported here at module level.
    """

    tokens: int = 4096
    layers: int = 64
    kv_heads: int = 1
    head_dim: int = 128
    dtype_bytes: int = 2
    block_size: int = 16
    pool_factor: float = 2.0

    @property
    def blocks(self) -> int:
        return math.ceil(self.tokens / self.block_size)

    @property
    def pool(self) -> int:
        """Blocks per side: ``pool_factor`` times the request (rounded to runs), by default twice, so patterns
        have room to scatter (1: a shuffled request takes every block, in random order)."""
        return max(RUN, math.ceil(self.pool_factor * self.blocks / RUN) * RUN)

    @property
    def token_bytes(self) -> int:
        return self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def request_bytes(self) -> int:
        return self.tokens * self.token_bytes * self.layers * 2


def block_ids(pattern: str, n: int, pool: int, rng: np.random.Generator) -> list[int]:
    """``n`` distinct block ids out of ``pool`` laid out as ``pattern``."""
    if pattern == "contiguous":
        return list(range(n))
    if pattern == "shuffled":
        return [int(b) for b in rng.permutation(pool)[:n]]
    if pattern == "runs16":
        starts = rng.permutation(pool // RUN)[: math.ceil(n / RUN)] * RUN
        return [int(s + i) for s in starts for i in range(RUN)][:n]
    raise ValueError(f"unknown block pattern {pattern!r}; choose from {', '.join(PATTERNS)}")


def make_cache(shape: Shape, seed: int | None) -> np.ndarray:
    dims = (shape.layers, 2, shape.pool, shape.block_size, shape.kv_heads, shape.head_dim * shape.dtype_bytes)
    if seed is None:
        arr = np.zeros(dims, dtype=np.uint8)
        arr.fill(0)  # its pages now, not in the first unpack (a GiB of first touches takes seconds)
        return arr
    n = math.prod(dims)
    if n % 8:
        return np.random.default_rng(seed).integers(0, 256, dims, dtype=np.uint8)
    # Random 64-bit words: several times faster than bytes, which a cache of gigabytes notices.
    return np.random.default_rng(seed).bit_generator.random_raw(n // 8).view(np.uint8).reshape(dims)


def request_digest(arr: np.ndarray, blocks: list[int], tokens: int) -> str:
    """Hash of the request's tokens in token order: equal on P and D iff every byte arrived in place. Layer
    by layer: a copy of the whole request at once would double a large cache's memory."""
    h = hashlib.blake2b(digest_size=16)
    for layer in arr:
        sel = layer[:, blocks]
        h.update(np.ascontiguousarray(sel.reshape(2, -1, *sel.shape[3:])[:, :tokens]).data)
    return h.hexdigest()


def per_block_descriptors(src: Any, dst: Any, sblocks: list[int], dblocks: list[int], tokens: int) -> tuple:
    """One descriptor per (block, region): the uncoalesced push a naive connector posts.

    Both layouts must share block geometry (the benchmark's P and D do).
    """
    assert (src.block_size, src.block_bytes, src.order) == (dst.block_size, dst.block_bytes, dst.order)
    n = math.ceil(tokens / src.block_size)
    lens = np.full(n, src.block_bytes, dtype=np.int64)
    lens[-1] = (tokens - (n - 1) * src.block_size) * src.token_bytes
    sb, db = np.asarray(sblocks[:n], np.int64), np.asarray(dblocks[:n], np.int64)
    local = np.empty((len(src.regions) * n, 3), dtype=np.int64)
    remote = np.empty_like(local)
    for i, (rs, rd) in enumerate(zip(src.regions, dst.regions, strict=True)):
        rows = slice(i * n, (i + 1) * n)
        local[rows, 0], local[rows, 1], local[rows, 2] = rs.base + sb * src.block_stride, lens, rs.device_id
        remote[rows, 0], remote[rows, 1], remote[rows, 2] = rd.base + db * dst.block_stride, lens, rd.device_id
    return local, remote
