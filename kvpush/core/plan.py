"""Turning a paired request into a transfer plan (pure).

Descriptor count, not bandwidth, is what a fragmented request costs: the
transport posts each descriptor separately, so a request scattered over many
blocks and layers costs far more than the same bytes contiguous (measured:
docs/benchmarks-log.md, "Descriptor cost"). The plan is either

- ``direct``: the pieces, coalesced, written straight into D's blocks; or
- ``staged``: P packs the pieces into a contiguous staging slot, one WRITE
  moves it into a slot D reserved in its staging region, D unpacks; or
- ``rounds``: staged through a ring of small slots D granted, part by part
  (``kvpush.core.rounds``), when the payload is larger than a ring; or
- ``peer``: where P's backend reaches D's memory (same host,
  ``kvpush.backends.peer``), P's device copies the direct plan's pieces into
  D's blocks itself: one pass over the bytes and no descriptors, so it beats
  both whenever it is there and the cost model is not asked.

Staging payload format: ``kvpush.core.payload`` (each side derives its half from
its own block ids, so P's pack list can be built before D registers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpush.config import Config
from kvpush.core import recurrent
from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, TokenOrder, heads_overlap
from kvpush.core.outcome import PlanKind
from kvpush.core.payload import block_runs, pack_pieces
from kvpush.core.pieces import coalesce, coalesce_in_dst_order, descriptors, map_pieces, merge_descriptors
from kvpush.core.rounds import RING_MIN_PART_BYTES, Ring, make_ring


@dataclass(frozen=True)
class Estimate:
    direct_s: float
    staged_s: float


@dataclass(frozen=True)
class Plan:
    """What the push thread posts for one (request, D rank), in one or more parts.

    A *part* is a contiguous range of regions ``[r0, r1)`` (whole layers when the
    backend lists a layer's regions together): the unit a layer-wise push posts
    when a layer is computed, and the unit a large staged push is pipelined in.
    Every region carries the same pieces, so a part's descriptors are derived
    from ``merged`` (direct) or from the region's share of the staging slot
    (staged) without planning again.
    """

    kind: PlanKind
    nbytes: int
    pieces: int  # uncoalesced pieces x regions: what a naive push would post
    descriptors: int  # descriptors of a whole-request push (upper bound for direct)
    nregions: int
    merged: np.ndarray  # (n, 3) coalesced src offset, dst offset, length (relative to region bases)
    pack: np.ndarray | None = None  # (m, 2) source offset, length for backend.pack
    staging_local: tuple[int, int] | None = None  # P slot (address, device)
    staging_remote: tuple[int, int] | None = None  # D slot (address, device)
    estimate: Estimate | None = None
    group_merged: tuple[np.ndarray, ...] = ()
    """Hybrid models (several KV-cache groups, each with its own blocks): the merged pieces of each group's
    regions; ``merged`` is group 0's. Empty: one piece list serves every region."""
    region_group: tuple[int, ...] = ()  # each region's group, when ``group_merged`` is set
    ring: Ring | None = None
    """A push in rounds (``ROUNDS``): the ring's geometry and cut; ``staging_local``/``staging_remote`` are
    then the start of P's and D's rings."""

    @property
    def region_bytes(self) -> int:
        """Bytes one region contributes (on average, for a hybrid plan); see ``bytes_of``."""
        return self.nbytes // self.nregions if self.nregions else 0

    def bytes_of(self, r0: int, r1: int) -> int:
        """Bytes regions ``[r0, r1)`` move."""
        if not self.group_merged:
            return (r1 - r0) * self.region_bytes
        per = [int(m[:, 2].sum()) for m in self.group_merged]
        return sum(per[g] for g in self.region_group[r0:r1])


def staged_bytes(src: KVLayout, dst: KVLayout, num_tokens: int, start_token: int) -> int:
    """Payload size of a staged transfer, computable on either side (opaque layouts move whole blocks)."""
    lo, hi = max(src.head_start, dst.head_start), min(src.head_end, dst.head_end)
    tokens = num_tokens - start_token
    if TokenOrder.BLOCK in (src.order, dst.order):
        tokens = (-(-num_tokens // src.block_size) - start_token // src.block_size) * src.block_size
    return tokens * max(0, hi - lo) * src.head_bytes * len(src.regions)


def staging_shortfall(cfg: Config, layout: KVLayout, max_tokens: int, region: int) -> tuple[int, int] | None:
    """Where this rank's staging region (``region`` bytes) cannot stage the longest prompt served (``max_tokens``):
    ``(tokens it holds, bytes the longest push needs)``, counted in whole blocks with a peer of this layout's
    heads; None where it can, or where staging is off (``plan="direct"``, ``staging_bytes`` 0).

    A push larger than the region goes through it in rounds (``kvpush.core.rounds``), so the region holds any
    prompt once it holds a ring's two smallest slots (``RING_MIN_PART_BYTES``); a smaller region holds only
    what fits it whole, and a longer prompt whose blocks are fragmented goes direct, one descriptor per
    piece at the transport's price. Said at start, so an operator sizes the region before the first slow
    request instead of after.
    """
    if cfg.staging.plan == "direct" or region <= 0 or max_tokens <= 0 or layout.hybrid:
        return None
    if region >= 2 * RING_MIN_PART_BYTES:
        return None
    per_block = staged_bytes(layout, layout, layout.block_size, 0)
    need = -(-max_tokens // layout.block_size) * per_block
    if per_block <= 0 or need <= region:
        return None
    return region // per_block * layout.block_size, need


HOLE = recurrent.HOLE
"""A block id P no longer holds (its sliding window moved past it): never to be read."""


@dataclass(frozen=True)
class GroupTokens:
    """One KV-cache group's share of a push: P's and D's block ids of that group, the first token to write."""

    src_blocks: tuple[int, ...]
    dst_blocks: Sequence[int] | np.ndarray
    """D's ids as the registration carries them (an array once decoded)."""
    start_token: int


def group_tokens(
    src_ids: tuple[tuple[int, ...], ...],
    dst: KVLayout,
    reg_ids: Sequence[Sequence[int] | np.ndarray],
    start: int,
    skip: tuple[int, ...],
) -> list[GroupTokens]:
    """Each group's blocks and first token: D's ``skip`` leading blocks of a group (a sliding window's) are not
    written, so that group starts at ``max(start, skip * D's block size)``."""
    return [
        GroupTokens(tuple(src_ids[g]), reg_ids[g], max(start, (skip[g] if g < len(skip) else 0) * dst.block_size))
        for g in range(len(reg_ids))
    ]


def _group_pieces(src: KVLayout, dst: KVLayout, gt: GroupTokens, g: int, num_tokens: int) -> np.ndarray:
    """Pieces of one group, refusing a token D needs that P no longer holds; a state group's one piece."""
    held_state = src.state_of(g)
    if held_state is not None:
        wanted = dst.state_of(g)
        if wanted is None:
            raise LayoutError(f"KV-cache group {g} holds recurrent state on P and attention KV on D")
        return recurrent.state_pieces(held_state, wanted, gt.src_blocks, gt.dst_blocks, src.num_blocks, dst.num_blocks)
    if gt.start_token < num_tokens:
        first = gt.start_token // src.block_size
        held = gt.src_blocks[first : -(-num_tokens // src.block_size)]
        if HOLE in held:
            raise LayoutError(
                f"KV-cache group {g}: D needs tokens from {gt.start_token}, P no longer holds block "
                f"{first + held.index(HOLE)} of that group (its sliding window moved past it)"
            )
    return map_pieces(src, dst, gt.src_blocks, gt.dst_blocks, num_tokens, gt.start_token)


def _hybrid_plan(
    cfg: Config,
    src: KVLayout,
    dst: KVLayout,
    groups: list[GroupTokens],
    num_tokens: int,
    pack_bw: float,
    kind: PlanKind = PlanKind.DIRECT,
) -> Plan:
    """A direct (or peer) plan whose regions carry their group's pieces (staging needs one piece list for all
    regions)."""
    if kind is PlanKind.DIRECT and not (src.direct and dst.direct):
        raise LayoutError("a hybrid model's KV (several KV-cache groups) is pushed directly; a side cannot be")
    region_group = tuple(r.group for r in src.regions)
    merged = tuple(coalesce_in_dst_order(_group_pieces(src, dst, gt, g, num_tokens)) for g, gt in enumerate(groups))
    count = [region_group.count(g) for g in range(len(groups))]
    nbytes = sum(int(m[:, 2].sum()) * c for m, c in zip(merged, count, strict=True))
    nregions = len(src.regions)
    if nbytes == 0:
        return _empty(nregions)
    ndesc = sum(m.shape[0] * c for m, c in zip(merged, count, strict=True))
    est = estimate(cfg, ndesc, nbytes, ndesc, pack_bw)
    return Plan(
        kind,
        nbytes,
        ndesc,
        ndesc,
        nregions,
        merged[0],
        estimate=est,
        group_merged=merged,
        region_group=region_group,
    )


def estimate(cfg: Config, ndesc: int, nbytes: int, pack_pieces: int, pack_bw: float) -> Estimate:
    """Seconds for each plan under the configured costs."""
    desc = cfg.descriptor_cost_s()
    wire = nbytes / (cfg.staging.link_gbps * 1e9)
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
    groups: list[GroupTokens] | None = None,
    pack: np.ndarray | None = None,
    peer: bool = False,
    ring: tuple[int, int, int] | None = None,
) -> Plan:
    """Choose and build the plan for one (request, D rank).

    ``staging_local`` is (address, device) of a P slot large enough for the
    payload, ``staging_remote`` (address, length, device) of D's granted slot;
    without both the plan is direct. A side whose backend cannot let NIXL
    touch its KV in place (``KVLayout.direct`` false, from the backend's
    ``Capabilities``) gets a staged plan whatever ``cfg.staging.plan`` says, and
    ``LayoutError`` when there is no slot to stage through. ``groups``: a
    hybrid model's per-group blocks and first tokens (``group_tokens``),
    whose plan is direct, each region with its group's pieces. ``pack``: P's pack list for exactly this
    request's tokens and shared heads, built ahead (``payload.pack_pieces``).

    With a pack list given, the cost model first compares staging with a
    lower bound of the direct plan's descriptors (``payload.block_runs``):
    when staging wins even against that, the direct plan (sorting and
    coalescing every piece) is never built, and ``estimate.direct_s`` is that
    bound's. This is the path of a registration arriving after the prefill.

    ``peer``: P's backend reaches this D rank's memory (``kvpush.backends.peer``): the plan is ``PEER``
    (the direct plan's pieces, which P's device copies itself), staging and the cost model unused.

    ``ring``: D granted a ring, ``(part_bytes, D's slots, P's slots)`` (P's ring at ``staging_local``, D's
    at ``staging_remote``): a staged plan is then ``ROUNDS``, whatever the payload's size, its estimate
    counting each part's fixed cost (``part_cost_us``).
    """
    kind = PlanKind.PEER if peer else PlanKind.DIRECT
    if src.hybrid:
        if groups is None or len(groups) != 1 + max(r.group for r in src.regions):
            raise LayoutError("a hybrid layout (several KV-cache groups) needs every group's blocks to plan")
        return _hybrid_plan(cfg, src, dst, groups, num_tokens, pack_bw, kind)
    if peer:
        return _peer_plan(src, dst, src_blocks, dst_blocks, num_tokens, start_token)
    return _one_group_plan(
        cfg,
        src,
        dst,
        src_blocks,
        dst_blocks,
        num_tokens,
        start_token,
        staging_local,
        staging_remote,
        pack_bw,
        pack,
        ring,
    )


def _empty(nregions: int) -> Plan:
    """The plan of a push with nothing to write (D already holds every token): only the notification goes."""
    return Plan(PlanKind.EMPTY, 0, 0, 0, nregions, np.zeros((0, 3), dtype=np.int64))


def _mapped(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: list[int] | np.ndarray,
    dst_blocks: list[int] | np.ndarray,
    num_tokens: int,
    start_token: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both sides' block ids as int64 (once: each helper would convert a list again) and their pieces."""
    src_ids, dst_ids = np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64)
    return src_ids, dst_ids, map_pieces(src, dst, src_ids, dst_ids, num_tokens, start_token)


def _one_group_plan(
    cfg: Config,
    src: KVLayout,
    dst: KVLayout,
    src_blocks: list[int] | np.ndarray,
    dst_blocks: list[int] | np.ndarray,
    num_tokens: int,
    start_token: int,
    staging_local: tuple[int, int] | None,
    staging_remote: tuple[int, int, int] | None,
    pack_bw: float,
    pack: np.ndarray | None,
    ring: tuple[int, int, int] | None = None,
) -> Plan:
    """``build_plan`` for a layout of one KV-cache group: empty, direct or staged (or rounds) by the cost model.

    Staging is forced when either side cannot be written in place, and tried
    first against a lower bound of the direct plan when P's pack list is built.
    """
    src_blocks, dst_blocks, pieces = _mapped(src, dst, src_blocks, dst_blocks, num_tokens, start_token)
    nregions = len(src.regions)
    npieces = pieces.shape[0] * nregions
    if pieces.shape[0] == 0:
        return _empty(nregions)
    if pack is not None and staging_local is not None and staging_remote is not None:
        # D's runs first (most often the fragmented side); P's only when D's do not decide.
        runs = block_runs(dst, dst_blocks, num_tokens, start_token)
        early = _staged_early(cfg, pieces, nregions, runs, pack, staging_local, staging_remote, pack_bw, ring)
        if early is None and cfg.staging.plan == "auto":
            runs = max(runs, block_runs(src, src_blocks, num_tokens, start_token))
            early = _staged_early(cfg, pieces, nregions, runs, pack, staging_local, staging_remote, pack_bw, ring)
        if early is not None:
            return early
    merged = coalesce_in_dst_order(pieces)
    nbytes = int(merged[:, 2].sum()) * nregions
    can_stage = (
        staging_local is not None and staging_remote is not None and (staging_remote[1] >= nbytes or ring is not None)
    )
    if pack is None and can_stage:
        pack = pack_pieces(src, heads_overlap(src, dst), src_blocks, num_tokens, start_token)
    # Descriptor count before cross-region merging: an upper bound, and exact
    # unless regions sit back to back; enough to choose without building them.
    ndesc = merged.shape[0] * nregions
    est = estimate(cfg, ndesc, nbytes, (merged if pack is None else pack).shape[0] * nregions, pack_bw)
    rounds = _ring(ring, nregions, nbytes) if can_stage else None
    if rounds is not None:
        est = Estimate(est.direct_s, est.staged_s + rounds.parts * cfg.staging.part_cost_us * 1e-6)
    direct_ok = src.direct and dst.direct
    if not direct_ok and not can_stage:
        raise _unstageable(src, staging_remote, nbytes)
    want_staged = (
        not direct_ok or cfg.staging.plan == "staged" or (cfg.staging.plan == "auto" and est.staged_s < est.direct_s)
    )
    if can_stage and want_staged:
        assert staging_local is not None and staging_remote is not None
        remote = (staging_remote[0], staging_remote[2])
        kind = PlanKind.STAGED if rounds is None else PlanKind.ROUNDS
        return Plan(kind, nbytes, npieces, 1, nregions, merged, pack, staging_local, remote, est, ring=rounds)
    return Plan(PlanKind.DIRECT, nbytes, npieces, ndesc, nregions, merged, estimate=est)


def _peer_plan(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: list[int] | np.ndarray,
    dst_blocks: list[int] | np.ndarray,
    num_tokens: int,
    start_token: int,
) -> Plan:
    """The pieces of a one-group layout, coalesced in token order, for P's device to copy into D's blocks.

    Not sorted by D's offsets first as a direct plan's are: a copy kernel takes its pieces in any order, and
    the merges only that order finds (D's blocks contiguous but listed out of token order) are rare. This
    plan is built as D's registration arrives in the finished order, on a thread that just woke, where each
    numpy call costs several times what it does in a loop (docs/benchmarks-log.md, "The finished order's P path
    on a woken thread").
    """
    pieces = map_pieces(src, dst, src_blocks, dst_blocks, num_tokens, start_token)
    nregions = len(src.regions)
    if pieces.shape[0] == 0:
        return _empty(nregions)
    merged = coalesce(pieces)
    nbytes = int(merged[:, 2].sum()) * nregions
    return Plan(PlanKind.PEER, nbytes, pieces.shape[0] * nregions, merged.shape[0] * nregions, nregions, merged)


def _unstageable(src: KVLayout, staging_remote: tuple[int, int, int] | None, nbytes: int) -> LayoutError:
    """The error for a push that must be staged (a side cannot be written in place) but has no slot to stage through."""
    side = "P" if not src.direct else "D"
    return LayoutError(
        f"{side}'s backend cannot let NIXL access its KV in place, so this push must be staged, but "
        f"{'D granted no staging slot' if staging_remote is None else 'no staging slot was free'} for its "
        f"{nbytes} bytes (set staging_bytes on both sides, larger than the largest request)"
    )


def _staged_early(
    cfg: Config,
    pieces: np.ndarray,
    nregions: int,
    runs: int,
    pack: np.ndarray,
    staging_local: tuple[int, int],
    staging_remote: tuple[int, int, int],
    pack_bw: float,
    ring: tuple[int, int, int] | None = None,
) -> Plan | None:
    """The staged (or rounds) plan if staging wins even against direct's fewest possible descriptors
    (``runs`` per region), so that the direct plan need not be built; None when only the real count can
    decide."""
    nbytes = int(pieces[:, 2].sum()) * nregions
    if staging_remote[1] < nbytes and ring is None:
        return None
    est = estimate(cfg, runs * nregions, nbytes, pack.shape[0] * nregions, pack_bw)
    rounds = _ring(ring, nregions, nbytes)
    if rounds is not None:
        est = Estimate(est.direct_s, est.staged_s + rounds.parts * cfg.staging.part_cost_us * 1e-6)
    if cfg.staging.plan != "staged" and not (cfg.staging.plan == "auto" and est.staged_s < est.direct_s):
        return None
    remote = (staging_remote[0], staging_remote[2])
    empty = np.zeros((0, 3), dtype=np.int64)
    npieces = pieces.shape[0] * nregions
    kind = PlanKind.STAGED if rounds is None else PlanKind.ROUNDS
    return Plan(kind, nbytes, npieces, 1, nregions, empty, pack, staging_local, remote, est, ring=rounds)


def _ring(ring: tuple[int, int, int] | None, nregions: int, nbytes: int) -> Ring | None:
    """The ring of a push in rounds (``ring``: part bytes, D's slots, P's slots) over ``nbytes`` in
    ``nregions`` regions; None without one."""
    if ring is None or nregions <= 0:
        return None
    part_bytes, d_slots, p_slots = ring
    return make_ring(nregions, nbytes // nregions, part_bytes, d_slots, p_slots)


def group_runs(plan: Plan, r0: int, r1: int) -> list[tuple[int, int]]:
    """Regions ``[r0, r1)`` of a hybrid plan cut where the group changes: consecutive regions of one group
    share its pieces (``group_merged``), so each run is moved with one piece list."""
    runs, a = [], r0
    for r in range(r0 + 1, r1 + 1):
        if r == r1 or plan.region_group[r] != plan.region_group[a]:
            runs.append((a, r))
            a = r
    return runs


def part_descriptors(plan: Plan, src: KVLayout, dst: KVLayout, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptors (local, remote) moving regions ``[r0, r1)`` of ``plan``.

    Staged: the regions' share of the slots (the payload is region-major).
    Direct: the merged pieces made absolute for those regions only, merged
    again where regions sit back to back.
    """
    if not 0 <= r0 < r1 <= plan.nregions:
        raise ValueError(f"part [{r0}, {r1}) outside the plan's {plan.nregions} regions")
    if plan.kind is PlanKind.STAGED:
        assert plan.staging_local is not None and plan.staging_remote is not None
        off, ln = r0 * plan.region_bytes, (r1 - r0) * plan.region_bytes
        lo = np.array([[plan.staging_local[0] + off, ln, plan.staging_local[1]]], dtype=np.int64)
        ro = np.array([[plan.staging_remote[0] + off, ln, plan.staging_remote[1]]], dtype=np.int64)
        return lo, ro
    if plan.group_merged:
        parts = [
            descriptors(plan.group_merged[plan.region_group[a]], src, dst, a, b) for a, b in group_runs(plan, r0, r1)
        ]
        return merge_descriptors(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return merge_descriptors(*descriptors(plan.merged, src, dst, r0, r1))
