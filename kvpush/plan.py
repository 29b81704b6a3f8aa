"""Turning a paired request into a transfer plan (pure).

Descriptor count, not bandwidth, is what a fragmented request costs: UCX posts
each descriptor for ~6-8 us, so 131k block-layer pieces take a second while the
same bytes contiguous take milliseconds. The plan is either

- ``direct``: the pieces, coalesced, written straight into D's blocks; or
- ``staged``: P packs the pieces into a contiguous staging slot, one WRITE
  moves it into a slot D reserved in its staging region, D unpacks.

Staging payload format (both sides derive it without exchanging block lists):
for each region in order, the request's bytes in ascending *D offset* order.
P knows its source offsets for that order; D knows its destination offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.config import Config
from kvpush.layout import KVLayout, coalesce, descriptors, map_pieces, merge_descriptors


@dataclass(frozen=True)
class Estimate:
    direct_s: float
    staged_s: float


@dataclass(frozen=True)
class Plan:
    """What the push thread posts for one (request, D rank)."""

    kind: str  # "direct" or "staged" or "empty"
    nbytes: int
    pieces: int  # uncoalesced pieces x regions: what a naive push would post
    descriptors: int  # descriptors actually posted
    local: np.ndarray  # (n, 3) addr, len, dev on P
    remote: np.ndarray  # (n, 3) on D
    pack: np.ndarray | None = None  # (m, 2) source offset, length for backend.pack
    estimate: Estimate | None = None


def _dst_order(pieces: np.ndarray) -> np.ndarray:
    return pieces[np.argsort(pieces[:, 1], kind="stable")] if pieces.shape[0] > 1 else pieces


def _merge_on(pieces2: np.ndarray) -> np.ndarray:
    """Merge consecutive (offset, length) rows contiguous on that one side."""
    if pieces2.shape[0] <= 1:
        return pieces2.copy()
    off, ln = pieces2[:, 0], pieces2[:, 1]
    joins = off[:-1] + ln[:-1] == off[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return np.stack([off[starts], np.add.reduceat(ln, starts)], axis=1)


def unpack_pieces(
    src: KVLayout, dst: KVLayout, dst_blocks: list[int] | np.ndarray, num_tokens: int, start_token: int
) -> np.ndarray:
    """D's (offset, length) list for unpacking a staged payload; needs no P block ids."""
    dummy = np.arange(-(-num_tokens // src.block_size), dtype=np.int64) % src.num_blocks
    pieces = map_pieces(src, dst, dummy, dst_blocks, num_tokens, start_token)
    return _merge_on(_dst_order(pieces)[:, 1:3])


def staged_bytes(src: KVLayout, dst: KVLayout, num_tokens: int, start_token: int) -> int:
    """Payload size of a staged transfer, computable on either side."""
    lo, hi = max(src.head_start, dst.head_start), min(src.head_end, dst.head_end)
    return (num_tokens - start_token) * max(0, hi - lo) * src.head_bytes * len(src.regions)


def estimate(cfg: Config, ndesc: int, nbytes: int, pack_pieces: int, pack_bw: float) -> Estimate:
    """Seconds for each plan under the configured costs."""
    desc = cfg.descriptor_cost_us * 1e-6
    wire = nbytes / (cfg.link_gbps * 1e9)
    # Pack and unpack each touch every byte once; per-piece overhead is small
    # next to a descriptor post but not zero.
    staged = 2 * nbytes / pack_bw + 2 * pack_pieces * 0.05e-6 + desc + wire
    return Estimate(direct_s=ndesc * desc + wire, staged_s=staged)


def build_plan(
    cfg: Config,
    src: KVLayout,
    dst: KVLayout,
    src_blocks: list[int] | np.ndarray,
    dst_blocks: list[int] | np.ndarray,
    num_tokens: int,
    start_token: int,
    *,
    staging_local: tuple[int, int] | None = None,
    staging_remote: tuple[int, int, int] | None = None,
    pack_bw: float = 5e9,
) -> Plan:
    """Choose and build the plan for one (request, D rank).

    ``staging_local`` is (address, device) of a P slot large enough for the
    payload, ``staging_remote`` (address, length, device) of D's granted slot;
    without both the plan is direct.
    """
    pieces = map_pieces(src, dst, src_blocks, dst_blocks, num_tokens, start_token)
    nregions = len(src.regions)
    npieces = pieces.shape[0] * nregions
    if pieces.shape[0] == 0:
        empty = np.zeros((0, 3), dtype=np.int64)
        return Plan("empty", 0, 0, 0, empty, empty)
    ordered = _dst_order(pieces)
    merged = coalesce(ordered)
    nbytes = int(merged[:, 2].sum()) * nregions
    pack = _merge_on(ordered[:, [0, 2]])
    # Descriptor count before cross-region merging: an upper bound, and exact
    # unless regions sit back to back; enough to choose without building them.
    est = estimate(cfg, merged.shape[0] * nregions, nbytes, pack.shape[0] * nregions, pack_bw)
    can_stage = staging_local is not None and staging_remote is not None and staging_remote[1] >= nbytes
    want_staged = cfg.plan == "staged" or (cfg.plan == "auto" and est.staged_s < est.direct_s)
    if can_stage and want_staged:
        assert staging_local is not None and staging_remote is not None
        lo = np.array([[staging_local[0], nbytes, staging_local[1]]], dtype=np.int64)
        ro = np.array([[staging_remote[0], nbytes, staging_remote[2]]], dtype=np.int64)
        return Plan("staged", nbytes, npieces, 1, lo, ro, pack=pack, estimate=est)
    local, remote = merge_descriptors(*descriptors(merged, src, dst))
    return Plan("direct", nbytes, npieces, local.shape[0], local, remote, estimate=est)


def wants_staging(cfg: Config, src: KVLayout, dst: KVLayout, dst_pieces: np.ndarray) -> bool:
    """D's side of the choice: reserve a slot only when direct would post many descriptors.

    D sees only its own fragmentation (``dst_pieces`` from ``unpack_pieces``),
    a lower bound on the direct plan's descriptor count.
    """
    if cfg.plan == "direct" or cfg.staging_bytes == 0:
        return False
    if cfg.plan == "staged":
        return True
    return dst_pieces.shape[0] * len(dst.regions) >= cfg.staged_min_descriptors
