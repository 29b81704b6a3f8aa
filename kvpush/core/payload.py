"""The staged payload: which bytes of a request a staging slot holds, and in which order (pure).

A staged push packs the request's bytes into P's staging slot, one WRITE
moves the slot into the slot D granted, and D unpacks. Each side derives its
half of that copy from its *own* block ids, so neither ever needs the
other's: P's pack list depends on P's blocks, the heads both ranks hold and
the tokens D asks for; D's unpack list on D's blocks and P's layout (known
from the handshake). That lets P build its pack list, and hand it to the
backend, when the prefill is handed over, before any registration arrives
(a sequential router registers D only after P's prefill finished).

The order follows P's in-block order, so P's pieces are as long as its
layout allows:

- ``TOKEN`` (P is NHD): for each token of ``[start, n)``, the shared heads in head order;
- ``HEAD`` (P is HND): for each shared head, the tokens of ``[start, n)`` in order;
- ``BLOCK`` (opaque layouts): for each block touching ``[start, n)``, its chunk of shared heads.

Every region carries the same payload, regions one after the other in the slot.
"""

from __future__ import annotations

import enum

import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, TokenOrder, check_compatible, heads_overlap


class PayloadOrder(enum.StrEnum):
    TOKEN = "token"
    HEAD = "head"
    BLOCK = "block"


def payload_order(src: KVLayout) -> PayloadOrder:
    """The payload order of pushes from a P rank with layout ``src`` (its in-block order decides)."""
    if src.order == TokenOrder.BLOCK:
        return PayloadOrder.BLOCK
    return PayloadOrder.HEAD if src.order == TokenOrder.HND else PayloadOrder.TOKEN


def pack_pieces(
    src: KVLayout, heads: tuple[int, int], src_blocks: np.ndarray | list[int], num_tokens: int, start_token: int
) -> np.ndarray:
    """P's ``(offset, length)`` list gathering tokens ``[start_token, num_tokens)`` of heads ``[lo, hi)``."""
    return side_pieces(src, payload_order(src), src_blocks, num_tokens, start_token, heads, "P")


def unpack_pieces(
    src: KVLayout, dst: KVLayout, dst_blocks: np.ndarray | list[int], num_tokens: int, start_token: int
) -> np.ndarray:
    """D's ``(offset, length)`` list scattering the payload a P rank with layout ``src`` sends; needs no P block ids."""
    check_compatible(src, dst)
    if (src.order == TokenOrder.BLOCK) != (dst.order == TokenOrder.BLOCK):
        raise LayoutError(f"opaque (BLOCK) layouts exchange with opaque layouts only: P is {src.order}, D {dst.order}")
    return side_pieces(dst, payload_order(src), dst_blocks, num_tokens, start_token, heads_overlap(src, dst), "D")


def check_unpack(
    src: KVLayout, dst: KVLayout, dst_blocks: np.ndarray | list[int], num_tokens: int, start_token: int
) -> None:
    """Raise the ``LayoutError`` ``unpack_pieces`` would, without building the list.

    D checks its registration with this before sending it and builds its
    unpack list after the send, while P pairs, plans and packs.
    """
    check_compatible(src, dst)
    if (src.order == TokenOrder.BLOCK) != (dst.order == TokenOrder.BLOCK):
        raise LayoutError(f"opaque (BLOCK) layouts exchange with opaque layouts only: P is {src.order}, D {dst.order}")
    check_side(dst, payload_order(src), dst_blocks, num_tokens, start_token, heads_overlap(src, dst), "D")


def check_side(
    layout: KVLayout,
    order: PayloadOrder,
    blocks: np.ndarray | list[int],
    num_tokens: int,
    start_token: int,
    heads: tuple[int, int],
    side: str,
) -> tuple[np.ndarray, int]:
    """Validate one side's part of a payload; returns its block ids as an array and how many are needed."""
    lo, hi = heads
    if not layout.head_start <= lo < hi <= layout.head_end:
        raise LayoutError(f"{side} holds heads [{layout.head_start}, {layout.head_end}), not all of [{lo}, {hi})")
    if not 0 <= start_token <= num_tokens:
        raise LayoutError(f"start_token {start_token} outside [0, {num_tokens}]")
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    need = -(-num_tokens // layout.block_size)
    if ids.size < need:
        raise LayoutError(f"{side} has {ids.size} block ids, {need} needed for the tokens pushed")
    if need and (ids[:need].min() < 0 or ids[:need].max() >= layout.num_blocks):
        raise LayoutError(f"{side} block id out of range [0, {layout.num_blocks})")
    if start_token < num_tokens and (order is PayloadOrder.BLOCK) != (layout.order == TokenOrder.BLOCK):
        raise LayoutError(f"a {order} payload does not fit {side}'s {layout.order} layout")
    return ids, need


def block_runs(layout: KVLayout, blocks: np.ndarray | list[int], num_tokens: int, start_token: int) -> int:
    """Runs of consecutive ids among the blocks holding tokens ``[start_token, num_tokens)``.

    A lower bound on the pieces per region of any list moving those tokens
    on this side (a piece is contiguous, and bytes of blocks in different
    runs never are), so a cost decision that holds for it holds for the
    real list, which need not be built to decide.
    """
    if start_token >= num_tokens:
        return 0  # nothing moves (a block holding only ``start_token`` is not one of them)
    bs = layout.block_size
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)[start_token // bs : -(-num_tokens // bs)]
    if ids.size <= 1:
        return int(ids.size)
    ids = np.sort(ids)
    return 1 + int(np.count_nonzero(np.diff(ids) > 1))


def side_pieces(
    layout: KVLayout,
    order: PayloadOrder,
    blocks: np.ndarray | list[int],
    num_tokens: int,
    start_token: int,
    heads: tuple[int, int],
    side: str,
) -> np.ndarray:
    """One side's ``(offset, length)`` list of the payload ``order`` lays out, merged where contiguous.

    Offsets are relative to a region's base (every region holds the same
    pieces); the lengths add up to one region's share of the payload.
    ``side`` ("P" or "D") only names the side in errors.
    """
    ids, need = check_side(layout, order, blocks, num_tokens, start_token, heads, side)
    if start_token == num_tokens:
        return np.zeros((0, 2), dtype=np.int64)
    lo, hi = heads
    bs = layout.block_size
    blk = np.arange(start_token // bs, need, dtype=np.int64)
    base = ids[blk] * layout.block_stride
    if order is PayloadOrder.BLOCK:
        if start_token % bs:
            raise LayoutError(f"start_token {start_token} must be block-aligned for opaque (BLOCK) layouts")
        chunk = bs * layout.head_bytes  # one head of one block
        lens = np.full(blk.size, (hi - lo) * chunk, dtype=np.int64)
        return merge_runs(np.stack([base + (lo - layout.head_start) * chunk, lens], axis=1))
    tok0 = np.maximum(blk * bs, start_token) - blk * bs  # first token of each block segment, within its block
    ntok = np.minimum((blk + 1) * bs, num_tokens) - blk * bs - tok0
    return merge_runs(_token_pieces(layout, order, base, tok0, ntok, lo, hi))


def _token_pieces(
    layout: KVLayout, order: PayloadOrder, base: np.ndarray, tok0: np.ndarray, ntok: np.ndarray, lo: int, hi: int
) -> np.ndarray:
    """Unmerged pieces of block segments (``base`` of each block, its tokens ``tok0 .. tok0 + ntok``) in payload order.

    A run is as long as the layout keeps the payload's neighbours together:
    a whole segment when the layout's order matches the payload's (and, for
    TOKEN, the side holds exactly the shared heads), else one token of one head.
    """
    hb, lh, hs, bs = layout.head_bytes, layout.local_heads, layout.head_start, layout.block_size
    nh = hi - lo
    nhd = layout.order == TokenOrder.NHD
    if order is PayloadOrder.TOKEN and nhd and nh == lh:
        return np.stack([base + tok0 * lh * hb, ntok * lh * hb], axis=1)
    if order is PayloadOrder.HEAD and not nhd:
        h = np.repeat(np.arange(lo - hs, hi - hs, dtype=np.int64), base.size)  # heads outer, segments inner
        seg = np.tile(np.arange(base.size), nh)
        return np.stack([base[seg] + (h * bs + tok0[seg]) * hb, ntok[seg] * hb], axis=1)
    # One piece per token (all shared heads of an NHD token), or per token and head.
    seg = np.repeat(np.arange(base.size), ntok)
    t = np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(ntok) - ntok, ntok) + tok0[seg]
    b = base[seg]
    if order is PayloadOrder.TOKEN and nhd:
        return np.stack([b + (t * lh + lo - hs) * hb, np.full(seg.size, nh * hb, dtype=np.int64)], axis=1)
    heads = np.arange(lo - hs, hi - hs, dtype=np.int64)
    if order is PayloadOrder.TOKEN:  # HND side: tokens outer, heads inner
        b, t, h = np.repeat(b, nh), np.repeat(t, nh), np.tile(heads, seg.size)
    else:  # NHD side of a HEAD payload: heads outer, tokens inner
        b, t, h = np.tile(b, nh), np.tile(t, nh), np.repeat(heads, seg.size)
    inner = t * lh + h if nhd else h * bs + t
    return np.stack([b + inner * hb, np.full(b.size, hb, dtype=np.int64)], axis=1)


def merge_runs(pieces: np.ndarray) -> np.ndarray:
    """Merge consecutive ``(offset, length)`` rows contiguous on their one side (the payload order is kept)."""
    if pieces.shape[0] <= 1:
        return pieces.astype(np.int64, copy=True)
    off, ln = pieces[:, 0], pieces[:, 1]
    starts = np.flatnonzero(np.concatenate(([True], off[:-1] + ln[:-1] != off[1:])))
    return np.stack([off[starts], np.add.reduceat(ln, starts)], axis=1).astype(np.int64, copy=False)
