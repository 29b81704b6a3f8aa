"""The caches and requests of ``kvpush bench post``: each side's cache (:class:`Shape`: split K/V regions or a
blocks-first cache), its layout as kvpush sees it, the request's block ids by pattern, and vLLM's
NixlPushConnector's prepared-list rows and entry ids for the same blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PATTERNS = ("fragmented", "contiguous")
KV = ("split", "blocks-first")


@dataclass(frozen=True)
class Shape:
    """Each side's cache: ``regions`` (layers x K/V) of ``pool`` blocks of ``block_bytes``, one buffer a side;
    ``kv``: ``split`` (each region its own span) or ``blocks-first`` (a layer's block b holds K then V)."""

    regions: int
    pool: int
    block_bytes: int
    kv: str
    block_size: int = 16

    @property
    def nbytes(self) -> int:
        return self.regions * self.pool * self.block_bytes

    @property
    def vllm_width(self) -> int:
        """Regions one entry of vLLM's lists covers: a blocks-first layer is one region of K|V blocks there."""
        return 2 if self.kv == "blocks-first" else 1


def make_layout(shape: Shape, base: int, device: int, mem: str) -> Any:
    """The kvpush layout of one side's buffer at ``base``."""
    from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder

    bb, pool = shape.block_bytes, shape.pool
    if shape.kv == "split":
        stride = bb
        bases = [base + r * pool * bb for r in range(shape.regions)]
    else:
        stride = 2 * bb
        bases = [base + (r // 2) * pool * stride + (r % 2) * bb for r in range(shape.regions)]
    size = (pool - 1) * stride + bb
    return KVLayout(
        block_size=shape.block_size,
        num_blocks=pool,
        block_stride=stride,
        head_bytes=bb // shape.block_size,
        num_heads=1,
        head_start=0,
        local_heads=1,
        order=TokenOrder.NHD,
        mem=MemKind(mem),
        dtype="bfloat16",
        regions=tuple(Region(b, size, device, layer=r // 2) for r, b in enumerate(bases)),
    ).validate()


def vllm_rows(layout: Any, width: int) -> np.ndarray:
    """vLLM's prepared list over a layout: one (address, bytes, device) entry per block of each of its regions
    (``width`` of kvpush's regions each), region by region."""
    bb, nb = layout.block_bytes * width, layout.num_blocks
    bases = [r.base for r in layout.regions[::width]]
    addrs = np.asarray(bases, dtype=np.int64)[:, None] + np.arange(nb, dtype=np.int64)[None, :] * layout.block_stride
    out = np.empty((addrs.size, 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = addrs.ravel(), bb, layout.regions[0].device_id
    return out


def vllm_ids(blocks: np.ndarray, regions: int, pool: int) -> np.ndarray:
    """vLLM's entry ids of a request's blocks (its ``_compute_desc_ids``): region offset + block id, region by
    region, as int32."""
    return (np.arange(regions, dtype=np.int64)[:, None] * pool + blocks[None, :]).ravel().astype(np.int32)


def block_ids(pattern: str, n: int, pool: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct block ids of a pool: random (``fragmented``) or one run at a random start."""
    if pattern == "contiguous":
        first = int(rng.integers(0, pool - n + 1))
        return np.arange(first, first + n, dtype=np.int64)
    return rng.permutation(pool)[:n].astype(np.int64)
