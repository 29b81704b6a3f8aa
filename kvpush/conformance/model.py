"""The suite's own model of a KV cache: logical bytes addressed by numpy indexing.

What D must hold after a push is computed here token by token and head by
head, from the *logical* shape every test cache has (``[layers, K/V, blocks,
*block, head bytes]``), never from ``kvpush.core.layout``'s byte offsets or from the
backend's ``describe``: a wrong address in either would otherwise be checked
by the code that produced it. Nothing here touches a device or NIXL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.core.geometry import KVGeometry


@dataclass(frozen=True)
class Geom(KVGeometry):
    """One rank's test cache (``KVGeometry``) with the model's own view of it: its logical shape and the heads
    this rank holds.

    The fields, sizes and the engine's ``spec`` are the shared type's; the
    logical shape and ``head_start`` are defined here again on purpose, by the
    model's own rule, and not taken from ``CacheSpec`` or ``kvpush.core.layout``: the
    suite checks those, so it must not compute what it expects with them.
    """

    @property
    def head_start(self) -> int:
        return (self.tp_rank * self.local_heads) % self.num_heads

    def layer_shape(self) -> tuple[int, ...]:
        """One layer's logical bytes: ``(2, blocks, *block)`` with head bytes last."""
        blk = (
            (self.block_size, self.local_heads, self.head_bytes)
            if self.order == "NHD"
            else (self.local_heads, self.block_size, self.head_bytes)
        )
        return (2, self.num_blocks, *blk)

    def shape(self) -> tuple[int, ...]:
        return (self.layers, *self.layer_shape())


def payload(geom: Geom, seed: int) -> np.ndarray:
    """Random logical bytes of a whole cache, reproducible from ``seed`` in any process."""
    return np.random.default_rng(seed).integers(0, 256, geom.shape(), dtype=np.uint8)


@dataclass(frozen=True)
class Req:
    """One transfer as both sides see it: P's blocks, D's blocks, tokens ``[start, n)`` to move."""

    tid: str
    p_rid: str
    d_rid: str
    p_blocks: list[int]
    d_blocks: list[int]
    n: int
    start: int = 0


def make_requests(
    rng: np.random.Generator,
    count: int,
    pg: Geom,
    dg: Geom,
    prefix: str,
    max_tokens: int = 130,
    contiguous: bool = False,
) -> list[Req]:
    """Random requests: random lengths, random P blocks, disjoint D blocks.

    Request 0 is shorter than a block; request 1 has no new tokens (D holds
    them all, ``start == n``); about a quarter start after a prefix D already
    has. ``contiguous`` gives each request consecutive block ids on both
    sides, which is what lets the planner coalesce whole blocks.
    """
    free = list(range(dg.num_blocks)) if contiguous else [int(b) for b in rng.permutation(dg.num_blocks)]
    p_next = 0
    out: list[Req] = []
    for i in range(count):
        n = int(rng.integers(1, max_tokens))
        start = 0
        if i == 0:
            n = max(1, min(pg.block_size, dg.block_size) // 3)
        elif i == 1:
            start = n = min(37, max_tokens - 1)
        elif not contiguous and rng.random() < 0.25 and n > 1:
            start = int(rng.integers(1, n))
        np_ = math.ceil(n / pg.block_size)
        if contiguous:
            if p_next + np_ > pg.num_blocks:
                p_next = 0
            pblocks = list(range(p_next, p_next + np_))
            p_next += np_
        else:
            pblocks = [int(b) for b in rng.choice(pg.num_blocks, np_, replace=False)]
        nd = math.ceil(n / dg.block_size)
        dblocks, free = free[:nd], free[nd:]
        if len(dblocks) != nd:
            raise ValueError(f"D pool of {dg.num_blocks} blocks too small for {count} requests")
        out.append(Req(f"{prefix}-t{i}", f"{prefix}-p{i}", f"{prefix}-d{i}", pblocks, dblocks, n, start))
    return out


def _at(geom: Geom, block: int, tok: int, head: int) -> tuple[Any, ...]:
    """Index of one token's one local head in every layer and K/V: shape ``(layers, 2, head_bytes)``."""
    if geom.order == "NHD":
        return (slice(None), slice(None), block, tok, head)
    return (slice(None), slice(None), block, head, tok)


def apply_push(expected: np.ndarray, dg: Geom, src: np.ndarray, pg: Geom, req: Req) -> None:
    """Write into ``expected`` what D holds after P pushed ``req``: every new token of every shared head."""
    lo = max(pg.head_start, dg.head_start)
    hi = min(pg.head_start + pg.local_heads, dg.head_start + dg.local_heads)
    for t in range(req.start, req.n):
        pb, pt = req.p_blocks[t // pg.block_size], t % pg.block_size
        db, dt = req.d_blocks[t // dg.block_size], t % dg.block_size
        for h in range(lo, hi):
            expected[_at(dg, db, dt, h - dg.head_start)] = src[_at(pg, pb, pt, h - pg.head_start)]


def assert_same(
    actual: np.ndarray, expected: np.ndarray, geom: Geom, what: str = "D's cache", sentinel: int | None = None
) -> None:
    """Byte equality of two caches, naming the first differing byte by (layer, K/V, block, token, head, byte).

    ``sentinel``: the byte a blank D cache was filled with (the engine tests
    use one); where the expected byte is still that, the message says D never
    registered it, which tells a stray write from a missing one.
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    bad = np.argwhere(actual != expected)
    if bad.size:
        names = ["layer", "kv", "block", *(("tok", "head") if geom.order == "NHD" else ("head", "tok")), "byte"]
        where = ", ".join(f"{k}={v}" for k, v in zip(names, bad[0].tolist(), strict=True))
        first = tuple(bad[0])
        note = (
            " (sentinel: D never registered this byte)" if sentinel is not None and expected[first] == sentinel else ""
        )
        raise AssertionError(
            f"{what}: {len(bad)} bytes differ; first at {where}: got {actual[first]}, want {expected[first]}{note}"
        )
