"""Hybrid models (several KV-cache groups, vLLM's HMA): each group's regions move with that group's blocks.

A Gemma 3-like layout alternates a sliding-window group and a full-attention
group by layer, and the two groups' layers alias the same memory (vLLM gives
the groups of one pool disjoint blocks). The reference is a token-by-token
copy through numpy indexing of each layer's own block table, never
``kvpush.core.layout``'s offsets: after copying the planned descriptors, D holds
exactly each group's tokens from that group's first pushed token, and the
sliding group's dropped blocks are neither read nor written.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvpush.config import Config
from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.outcome import PlanKind
from kvpush.core.plan import HOLE, build_plan, group_tokens, part_descriptors
from kvpush.decode.registration import wants_staging
from kvpush.integrations.vllm.scheduler_side import SchedulerSide

BS, HEADS, HEAD, NB = 4, 2, 8, 16  # block size, local heads, head bytes, blocks


def cache(layers: int) -> np.ndarray:
    """One pool per group pair, as vLLM lays it out: layer pairs (sliding, full) alias one buffer."""
    return np.zeros((layers // 2, NB, BS, HEADS, HEAD), dtype=np.uint8)


def layout(buf: np.ndarray) -> KVLayout:
    regions = []
    for layer in range(2 * buf.shape[0]):
        base = buf[layer // 2].ctypes.data  # layers 2k (group 0) and 2k+1 (group 1) share the buffer
        regions.append(Region(base, buf[0].nbytes, group=layer % 2, layer=layer))
    return KVLayout(
        BS, NB, BS * HEADS * HEAD, HEAD, HEADS, 0, HEADS, TokenOrder.NHD, MemKind.DRAM, "uint8", tuple(regions)
    )


def test_each_group_moves_its_own_blocks_and_the_window_only() -> None:
    rng = np.random.default_rng(0)
    src_buf, dst_buf = cache(4), cache(4)
    src_buf[:] = rng.integers(1, 255, src_buf.shape, dtype=np.uint8)
    src, dst = layout(src_buf), layout(dst_buf)
    n = 22  # six blocks of 4, the last partial
    sliding_p = (HOLE, HOLE, 9, 3, 5, 11)  # P dropped the window's first two blocks
    full_p = (0, 1, 2, 4, 6, 7)
    sliding_d = (0, 0, 0, 13, 14, 15)  # D holds the last three blocks only (0: vLLM's placeholder)
    full_d = (8, 10, 12, 1, 2, 3)
    groups = group_tokens((sliding_p, full_p), dst, (sliding_d, full_d), start=0, skip=(3, 0))
    plan = build_plan(Config(), src, dst, [], [], n, 0, groups=groups)
    assert plan.kind is PlanKind.DIRECT and plan.region_group == (0, 1, 0, 1)
    loc, rem = part_descriptors(plan, src, dst, 0, 4)
    for (la, ln, _), (ra, _, _) in zip(loc.tolist(), rem.tolist(), strict=True):
        ctypes.memmove(ra, la, ln)
    want = np.zeros_like(dst_buf)
    for t in range(n):
        b, s = t // BS, t % BS
        want[:, full_d[b], s] = src_buf[:, full_p[b], s]  # full group (odd layers): every token
    for t in range(3 * BS, n):
        b, s = t // BS, t % BS
        want[:, sliding_d[b], s] = src_buf[:, sliding_p[b], s]  # sliding group: from D's first held block
    # both groups of a layer pair share one buffer, so compare the union
    assert np.array_equal(dst_buf, want)
    assert plan.bytes_of(0, 4) == plan.nbytes == (n + (n - 3 * BS)) * HEADS * HEAD * 2
    assert plan.bytes_of(1, 2) == n * HEADS * HEAD


def test_a_token_d_needs_that_p_dropped_fails_the_plan() -> None:
    src, dst = layout(cache(4)), layout(cache(4))
    groups = group_tokens(((HOLE, HOLE, 9), (0, 1, 2)), dst, ((0, 5, 6), (3, 4, 7)), start=0, skip=(1, 0))
    with pytest.raises(LayoutError, match="group 0: D needs tokens from 4, P no longer holds block 1"):
        build_plan(Config(), src, dst, [], [], 10, 0, groups=groups)


def test_hybrid_layouts_plan_directly_and_d_reserves_no_staging() -> None:
    src, dst = layout(cache(4)), layout(cache(4))
    with pytest.raises(LayoutError, match="needs every group's blocks"):
        build_plan(Config(), src, dst, [0], [0], 4, 0)
    cfg = Config.from_dict({"plan": "staged", "staging_bytes": 1 << 20})
    assert not wants_staging(cfg, src, dst, np.zeros((100, 2), dtype=np.int64))


def test_scheduler_side_reads_placeholders_from_vllm_block_lists() -> None:
    """D: leading placeholders of a group are blocks it does not hold; P: its placeholders become holes."""
    s = SchedulerSide()
    ids = ((0, 0, 7, 8), (1, 2, 3, 4))
    assert s.skipped(ids) == () and s.holes(ids) == ids  # no pool bound yet: nothing is a placeholder
    s.null_block = 0
    assert s.skipped(ids) == (2, 0)
    assert s.holes(ids) == ((HOLE, HOLE, 7, 8), (1, 2, 3, 4))
    assert s.skipped(((5, 6), (1, 2))) == ()
