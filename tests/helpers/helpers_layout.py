"""Simulated KV memory for layout tests, and a reference that does not use ``kvpush.core.layout``.

Each side (P or D) owns one numpy byte *arena*; its regions live inside it at
real addresses, so descriptors (absolute addresses) can be applied with plain
numpy copies. The reference computes where a (region, token, head) lives by
viewing a block's bytes as the tensor it is (``[block_size, heads, head]`` for
NHD, ``[heads, block_size, head]`` for HND) with numpy reshapes, which is a
different route from the offset arithmetic in ``kvpush.core.layout``: a bug there
does not repeat itself here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder

BLOCK_SIZES = (8, 16, 32, 64)
GUARD = 16  # bytes before and after the regions of an arena, to catch stray writes
# The token-addressable orders (other orders, if any, are not per-token layouts).
ORDERS = (TokenOrder.NHD, TokenOrder.HND)


@dataclass
class Side:
    """One rank's layout plus the arena backing its regions."""

    layout: KVLayout
    arena: np.ndarray

    @property
    def addr(self) -> int:
        return int(self.arena.ctypes.data)

    def region_off(self, r: int) -> int:
        """Offset of region ``r``'s base inside the arena."""
        return self.layout.regions[r].base - self.addr

    def token_heads(self, arena: np.ndarray, r: int, block: int, tok_in_block: int) -> np.ndarray:
        """View ``[local_heads, head_bytes]`` of one token of one block of region ``r`` in ``arena``."""
        lay = self.layout
        start = self.region_off(r) + block * lay.block_stride
        raw = arena[start : start + lay.block_bytes]
        if lay.order == TokenOrder.NHD:
            blk = raw.reshape(lay.block_size, lay.local_heads, lay.head_bytes)
        else:
            blk = raw.reshape(lay.local_heads, lay.block_size, lay.head_bytes).transpose(1, 0, 2)
        return blk[tok_in_block]


@dataclass
class Scenario:
    """A P side, a D side and one request's blocks on each."""

    src: Side
    dst: Side
    src_blocks: list[int]
    dst_blocks: list[int]
    num_tokens: int
    start_token: int

    def call_args(self) -> tuple:
        return (self.src.layout, self.dst.layout, self.src_blocks, self.dst_blocks, self.num_tokens, self.start_token)


def make_side(
    *,
    block_size: int,
    num_blocks: int,
    head_bytes: int,
    num_heads: int,
    head_start: int,
    local_heads: int,
    order: TokenOrder,
    num_regions: int,
    pad: int = 0,
    interleaved: bool = False,
    gaps: list[int] | None = None,
    device_ids: list[int] | None = None,
    dtype: str = "float16",
) -> Side:
    """Allocate an arena and lay ``num_regions`` regions out in it.

    ``interleaved`` puts block ``b`` of every region side by side (vLLM's
    ``[num_blocks, 2, ...]`` K/V layout), so ``block_stride`` covers all
    regions; otherwise regions follow each other with ``gaps[r]`` bytes before
    region ``r`` (0 makes them back to back).
    """
    block_bytes = block_size * local_heads * head_bytes
    if interleaved:
        stride = num_regions * block_bytes + pad
        need = (num_blocks - 1) * stride + block_bytes
        offs = [GUARD + r * block_bytes for r in range(num_regions)]
        end = offs[-1] + need
    else:
        stride = block_bytes + pad
        need = (num_blocks - 1) * stride + block_bytes
        gaps = gaps or [0] * num_regions
        offs, pos = [], GUARD
        for r in range(num_regions):
            pos += gaps[r]
            offs.append(pos)
            pos += need
        end = pos
    arena = np.zeros(end + GUARD, dtype=np.uint8)
    base = int(arena.ctypes.data)
    devs = device_ids or [0] * num_regions
    regions = tuple(Region(base=base + o, size=need, device_id=devs[r]) for r, o in enumerate(offs))
    layout = KVLayout(
        block_size=block_size,
        num_blocks=num_blocks,
        block_stride=stride,
        head_bytes=head_bytes,
        num_heads=num_heads,
        head_start=head_start,
        local_heads=local_heads,
        order=order,
        mem=MemKind.DRAM,
        dtype=dtype,
        regions=regions,
    ).validate()
    return Side(layout, arena)


def fill_random(side: Side, seed: int) -> None:
    """Random bytes in 1..255, so a byte left at 0 on D can only mean "never written"."""
    rng = np.random.default_rng(seed)
    side.arena[:] = rng.integers(1, 256, side.arena.size, dtype=np.uint8)


def reference_dst(scn: Scenario) -> np.ndarray:
    """D's arena as it must look after the push: shared heads of tokens [start, n) copied, nothing else."""
    src, dst = scn.src, scn.dst
    sl, dl = src.layout, dst.layout
    lo, hi = max(sl.head_start, dl.head_start), min(sl.head_start + sl.local_heads, dl.head_start + dl.local_heads)
    out = dst.arena.copy()
    for r in range(len(sl.regions)):
        for t in range(scn.start_token, scn.num_tokens):
            s = src.token_heads(src.arena, r, scn.src_blocks[t // sl.block_size], t % sl.block_size)
            d = dst.token_heads(out, r, scn.dst_blocks[t // dl.block_size], t % dl.block_size)
            d[lo - dl.head_start : hi - dl.head_start] = s[lo - sl.head_start : hi - sl.head_start]
    return out


def apply_descriptors(local: np.ndarray, remote: np.ndarray, src: Side, dst_arena: np.ndarray, dst: Side) -> None:
    """Perform each ``local[i] -> remote[i]`` copy (what NIXL WRITE does), bounds-checked on both arenas."""
    assert local.shape == remote.shape
    assert (local[:, 1] == remote[:, 1]).all(), "local and remote lengths differ"
    for (sa, ln, _), (da, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        so, do = sa - src.addr, da - dst.addr
        assert ln > 0, f"empty descriptor at {sa}"
        assert so >= 0 and so + ln <= src.arena.size, f"read outside P's memory: {so}+{ln}"
        assert do >= 0 and do + ln <= dst_arena.size, f"write outside D's memory: {do}+{ln}"
        dst_arena[do : do + ln] = src.arena[so : so + ln]


def byte_map(pieces: np.ndarray) -> np.ndarray:
    """Every (src byte, dst byte) pair a piece list moves, sorted: equal maps move identical bytes."""
    if pieces.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    lens = pieces[:, 2]
    owner = np.repeat(np.arange(pieces.shape[0]), lens)
    within = np.arange(owner.size) - np.repeat(np.cumsum(lens) - lens, lens)
    pairs = np.stack([pieces[owner, 0] + within, pieces[owner, 1] + within], axis=1)
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]


def mismatch_report(actual: np.ndarray, expected: np.ndarray) -> str:
    bad = np.flatnonzero(actual != expected)
    return f"{bad.size} bytes differ; first offsets {bad[:8].tolist()}"


@st.composite
def scenarios(draw, max_tokens: int = 160) -> Scenario:
    """Random P/D pair of one model: head slices, block sizes, orders, strides, placements, block ids."""
    num_heads = draw(st.integers(1, 8))
    head_bytes = draw(st.sampled_from([1, 2, 4, 6]))
    p_lo = draw(st.integers(0, num_heads - 1))
    p_hi = draw(st.integers(p_lo + 1, num_heads))
    d_lo = draw(st.integers(0, p_hi - 1))
    d_hi = draw(st.integers(max(d_lo, p_lo) + 1, num_heads))
    num_regions = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(0, max_tokens))
    start_token = draw(st.integers(0, num_tokens))
    sides, ids = [], []
    for lo, hi in ((p_lo, p_hi), (d_lo, d_hi)):
        bs = draw(st.sampled_from(BLOCK_SIZES))
        needed = max(1, -(-num_tokens // bs))
        num_blocks = needed + draw(st.integers(0, 4))
        interleaved = draw(st.booleans())
        side = make_side(
            block_size=bs,
            num_blocks=num_blocks,
            head_bytes=head_bytes,
            num_heads=num_heads,
            head_start=lo,
            local_heads=hi - lo,
            order=draw(st.sampled_from(ORDERS)),
            num_regions=num_regions,
            pad=draw(st.sampled_from([0, 0, head_bytes, 5])),
            interleaved=interleaved,
            gaps=draw(st.lists(st.sampled_from([0, 0, 1, 7, 64]), min_size=num_regions, max_size=num_regions)),
            device_ids=draw(st.lists(st.sampled_from([0, 0, 1]), min_size=num_regions, max_size=num_regions)),
        )
        if draw(st.booleans()):
            first = draw(st.integers(0, num_blocks - needed))
            blocks = list(range(first, first + needed))
        else:
            blocks = draw(st.permutations(range(num_blocks)))
        sides.append(side)
        ids.append(list(blocks))
    fill_random(sides[0], draw(st.integers(0, 2**32 - 1)))
    return Scenario(sides[0], sides[1], ids[0], ids[1], num_tokens, start_token)
