"""The pure mapping from P's blocks to D's blocks: pieces, coalesced, made descriptors.

Given two layouts (``kvpush.core.layout``) and both sides' block ids, the
functions here return numpy arrays of byte ranges: a *piece* is a (src offset,
dst offset, length) triple relative to the bases of a region pair (the same
pieces apply to every region pair, as every region has the same shape); a
*descriptor* is a piece made absolute (base address added), one NIXL entry.
Nothing here touches memory, NIXL or a device, which is what makes the
mapping testable exhaustively.
"""

from __future__ import annotations

import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, TokenOrder, check_compatible, heads_overlap


def _check_ids(ids: np.ndarray, n_needed: int, num_blocks: int, side: str, first: int = 0) -> None:
    """Block ids ``[first, n_needed)`` exist: the blocks before ``first`` hold no token pushed (D's prefix, or
    a sliding window's dropped blocks) and may be placeholders."""
    if ids.size < n_needed:
        raise LayoutError(f"{side} has {ids.size} block ids, {n_needed} needed for the tokens pushed")
    used = ids[first:n_needed]
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        raise LayoutError(f"{side} block id out of range [0, {num_blocks}): min {used.min()}, max {used.max()}")


def _segments(start: int, end: int, bs_a: int, bs_b: int) -> tuple[np.ndarray, np.ndarray]:
    """Split tokens [start, end) where either side starts a new block."""
    lo, hi = min(bs_a, bs_b), max(bs_a, bs_b)
    if hi % lo == 0:  # every block start of one side is one of the other's: no merge needed
        cuts = np.arange(0, end, lo, dtype=np.int64)
    else:  # two sorted progressions: sort their concatenation and drop the shared cuts (cheaper than union1d)
        cuts = np.sort(np.concatenate((np.arange(0, end, bs_a), np.arange(0, end, bs_b))))
        cuts = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1]))]
    cuts = cuts[cuts > start]
    starts = np.concatenate(([start], cuts)).astype(np.int64)
    ends = np.concatenate((cuts, [end])).astype(np.int64)
    return starts, ends


def _offsets(layout: KVLayout, block: np.ndarray, tok: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Byte offset inside a region of (block id, token-in-block, local head)."""
    if layout.order == TokenOrder.NHD:  # ==, not is: a plain "NHD" string must count too
        inner = (tok * layout.local_heads + head) * layout.head_bytes
    else:
        inner = (head * layout.block_size + tok) * layout.head_bytes
    return block * layout.block_stride + inner


def map_pieces(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: np.ndarray | list[int],
    dst_blocks: np.ndarray | list[int],
    num_tokens: int,
    start_token: int = 0,
) -> np.ndarray:
    """Byte pieces copying tokens ``[start_token, num_tokens)`` of a request.

    ``src_blocks``/``dst_blocks`` are the request's block ids on each side,
    both counted from token 0 (so D's prefix-cached blocks are listed but not
    written). Only heads held by both ranks move. Returns an ``(n, 3)`` int64
    array of ``(src_off, dst_off, length)`` in token order, uncoalesced at the
    natural granularity of the two layouts; ``coalesce`` merges it.
    """
    check_compatible(src, dst)
    if TokenOrder.BLOCK in (src.order, dst.order):
        return _block_pieces(src, dst, src_blocks, dst_blocks, num_tokens, start_token)
    if not 0 <= start_token <= num_tokens:
        raise LayoutError(f"start_token {start_token} outside [0, {num_tokens}]")
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    _check_ids(sb, -(-num_tokens // src.block_size), src.num_blocks, "P", start_token // src.block_size)
    _check_ids(db, -(-num_tokens // dst.block_size), dst.num_blocks, "D", start_token // dst.block_size)
    if start_token == num_tokens:
        return np.zeros((0, 3), dtype=np.int64)
    if _block_granular(src, dst):
        return _block_run_pieces(src, dst, sb, db, num_tokens, start_token)
    return _token_pieces(src, dst, sb, db, num_tokens, start_token)


def _block_granular(src: KVLayout, dst: KVLayout) -> bool:
    """Both NHD with one block size and exactly the shared heads: a block's tokens are one run on both sides."""
    lo, hi = heads_overlap(src, dst)
    return (
        src.order == TokenOrder.NHD
        and dst.order == TokenOrder.NHD
        and src.block_size == dst.block_size
        and hi - lo == src.local_heads == dst.local_heads
    )


def _block_run_pieces(
    src: KVLayout, dst: KVLayout, sb: np.ndarray, db: np.ndarray, num_tokens: int, start_token: int
) -> np.ndarray:
    """``map_pieces`` when ``_block_granular``: one piece per block touching ``[start_token, num_tokens)``.

    The same pieces the per-segment path gives, from arrays as long as the
    request's blocks instead of its tokens.
    """
    bs, tb = src.block_size, src.token_bytes
    blk = np.arange(start_token // bs, -(-num_tokens // bs), dtype=np.int64)
    tok0 = np.maximum(blk * bs, start_token) - blk * bs
    ln = (np.minimum((blk + 1) * bs, num_tokens) - blk * bs - tok0) * tb
    return np.stack([sb[blk] * src.block_stride + tok0 * tb, db[blk] * dst.block_stride + tok0 * tb, ln], axis=1)


def _token_pieces(
    src: KVLayout, dst: KVLayout, sb: np.ndarray, db: np.ndarray, num_tokens: int, start_token: int
) -> np.ndarray:
    """``map_pieces`` of token-addressable layouts in general: per segment, token, or token and head."""
    lo, hi = heads_overlap(src, dst)
    nh = hi - lo
    s, e = _segments(start_token, num_tokens, src.block_size, dst.block_size)
    ntok = e - s
    sblk, stok = sb[s // src.block_size], s % src.block_size
    dblk, dtok = db[s // dst.block_size], s % dst.block_size
    hb = src.head_bytes
    both_hnd = src.order == TokenOrder.HND and dst.order == TokenOrder.HND
    both_nhd = src.order == TokenOrder.NHD and dst.order == TokenOrder.NHD
    if both_hnd:
        # One piece per (segment, head): a head's tokens are contiguous.
        heads = np.arange(lo, hi, dtype=np.int64)
        seg = np.repeat(np.arange(s.size), nh)
        h = np.tile(heads, s.size)
        so = _offsets(src, sblk[seg], stok[seg], h - src.head_start)
        do = _offsets(dst, dblk[seg], dtok[seg], h - dst.head_start)
        ln = ntok[seg] * hb
    elif both_nhd and nh == src.local_heads == dst.local_heads:
        # Same head slice on both sides: a run of tokens is one range.
        so = _offsets(src, sblk, stok, np.zeros(s.size, dtype=np.int64))
        do = _offsets(dst, dblk, dtok, np.zeros(s.size, dtype=np.int64))
        ln = ntok * nh * hb
    else:
        # One piece per token (all shared heads at once when both are NHD,
        # else one per token and head).
        seg = np.repeat(np.arange(s.size), ntok)
        first = np.cumsum(ntok) - ntok
        t = np.arange(seg.size, dtype=np.int64) - first[seg]
        if both_nhd:
            so = _offsets(src, sblk[seg], stok[seg] + t, np.full(seg.size, lo - src.head_start))
            do = _offsets(dst, dblk[seg], dtok[seg] + t, np.full(seg.size, lo - dst.head_start))
            ln = np.full(seg.size, nh * hb, dtype=np.int64)
        else:
            heads = np.arange(lo, hi, dtype=np.int64)
            seg2 = np.repeat(seg, nh)
            t2 = np.repeat(t, nh)
            h = np.tile(heads, seg.size)
            so = _offsets(src, sblk[seg2], stok[seg2] + t2, h - src.head_start)
            do = _offsets(dst, dblk[seg2], dtok[seg2] + t2, h - dst.head_start)
            ln = np.full(seg2.size, hb, dtype=np.int64)
    return np.stack([so, do, ln], axis=1).astype(np.int64)


def _block_pieces(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: np.ndarray | list[int],
    dst_blocks: np.ndarray | list[int],
    num_tokens: int,
    start_token: int,
) -> np.ndarray:
    """Whole (block, head) chunks for opaque layouts: every block touching ``[start_token, num_tokens)``, the
    heads both ranks hold."""
    if (src.order, dst.order) != (TokenOrder.BLOCK, TokenOrder.BLOCK) or src.block_size != dst.block_size:
        raise LayoutError(
            f"opaque (BLOCK) layouts copy whole blocks head by head: P and D need the BLOCK order and the same "
            f"block size (P: {src.order}/{src.block_size} tokens, D: {dst.order}/{dst.block_size} tokens)"
        )
    if not 0 <= start_token <= num_tokens or start_token % src.block_size:
        raise LayoutError(f"start_token {start_token} must be block-aligned and within [0, {num_tokens}]")
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    n_blocks = -(-num_tokens // src.block_size)
    _check_ids(sb, n_blocks, src.num_blocks, "P", start_token // src.block_size)
    _check_ids(db, n_blocks, dst.num_blocks, "D", start_token // dst.block_size)
    lo, hi = heads_overlap(src, dst)
    chunk = src.block_size * src.head_bytes  # one head of one block
    idx = np.arange(start_token // src.block_size, n_blocks)
    # The shared heads are consecutive on both sides: one piece per block.
    so = sb[idx] * src.block_stride + (lo - src.head_start) * chunk
    do = db[idx] * dst.block_stride + (lo - dst.head_start) * chunk
    return np.stack([so, do, np.full(idx.size, (hi - lo) * chunk, dtype=np.int64)], axis=1).astype(np.int64)


def coalesce(pieces: np.ndarray) -> np.ndarray:
    """Merge consecutive pieces contiguous on *both* sides.

    Only neighbours in the given order are merged, so the result covers exactly
    the same bytes; a merge never bridges a gap on either side.
    """
    if pieces.shape[0] <= 1:
        return pieces.copy()
    so, do, ln = pieces[:, 0], pieces[:, 1], pieces[:, 2]
    joins = (so[:-1] + ln[:-1] == so[1:]) & (do[:-1] + ln[:-1] == do[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(ln, starts)
    return np.stack([so[starts], do[starts], lengths], axis=1)


def coalesce_in_dst_order(pieces: np.ndarray) -> np.ndarray:
    """Coalesce after ordering by destination offset, which finds merges that token order hides.

    Each D byte is written once, so a piece contiguous with another on D is its neighbour in this order:
    every merge of ``coalesce`` is still found, and the descriptors walk D's memory forward."""
    if pieces.shape[0] <= 1:
        return pieces.copy()
    return coalesce(pieces[np.argsort(pieces[:, 1], kind="stable")])


def descriptors(
    pieces: np.ndarray, src: KVLayout, dst: KVLayout, r0: int = 0, r1: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Absolute NIXL descriptors ``(addr, len, dev)`` for region pairs ``[r0, r1)`` (default all).

    Returns ``(local, remote)`` arrays of shape ``(regions * pieces, 3)``.
    """
    n = pieces.shape[0]
    sreg, dreg = src.regions[r0:r1], dst.regions[r0:r1]
    r = len(sreg)
    sbase = np.array([x.base for x in sreg], dtype=np.int64)
    dbase = np.array([x.base for x in dreg], dtype=np.int64)
    sdev = np.array([x.device_id for x in sreg], dtype=np.int64)
    ddev = np.array([x.device_id for x in dreg], dtype=np.int64)
    local = np.empty((r * n, 3), dtype=np.int64)
    remote = np.empty((r * n, 3), dtype=np.int64)
    local[:, 0] = (sbase[:, None] + pieces[None, :, 0]).reshape(-1)
    remote[:, 0] = (dbase[:, None] + pieces[None, :, 1]).reshape(-1)
    local[:, 1] = remote[:, 1] = np.tile(pieces[:, 2], r)
    local[:, 2] = np.repeat(sdev, n)
    remote[:, 2] = np.repeat(ddev, n)
    return local, remote


def merge_descriptors(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge absolute descriptors adjacent on both sides and on the same devices.

    This catches runs that cross region boundaries when regions are laid out
    back to back (vLLM's cross-layer layout).
    """
    if local.shape[0] <= 1:
        return local.copy(), remote.copy()
    la, ll, ld = local[:, 0], local[:, 1], local[:, 2]
    ra, rd = remote[:, 0], remote[:, 2]
    joins = (la[:-1] + ll[:-1] == la[1:]) & (ra[:-1] + ll[:-1] == ra[1:]) & (ld[:-1] == ld[1:]) & (rd[:-1] == rd[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(ll, starts)
    lo = np.stack([la[starts], lengths, ld[starts]], axis=1)
    ro = np.stack([ra[starts], lengths, rd[starts]], axis=1)
    return lo, ro
