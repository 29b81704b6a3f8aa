"""What one D rank asks one writing P rank for (pure): the checks, the staging wish, the message, the parts.

D checks a registration against P's layout before sending it, so a request
P cannot write fails on D with the reason instead of on P mid-push; and it
decides from its own block fragmentation whether it wants P to stage,
because only D sees how scattered its blocks are.
"""

from __future__ import annotations

import numpy as np

from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.layout import KVLayout
from kvpush.core.parts import MIN_PART_BYTES, PartCosts, cut, split_regions
from kvpush.core.payload import block_runs, check_unpack, unpack_pieces
from kvpush.core.rounds import ring_sizes
from kvpush.core.staging import SlotAllocator
from kvpush.decode.fencing_actions import Asked


def unpack_choice(
    cfg: Config, p_layout: KVLayout, d_layout: KVLayout, ask: Asked, peer_copies: bool = False
) -> tuple[np.ndarray, bool, np.ndarray | None]:
    """``(blocks, want_staging, pieces)`` for a registration; raises when P's layout cannot write these blocks.

    ``pieces`` (D's unpack list) is built only when the cheap rule cannot
    decide the staging wish without it, and is ``None`` otherwise. A writer
    that said it writes with peer copies (``peer_copies``) gets no staging:
    its bytes land in D's blocks, a slot would sit unused for the whole push.
    """
    blocks = np.asarray(ask.block_ids[d_layout.token_group], dtype=np.int64)  # once, for the checks and the list
    check_unpack(p_layout, d_layout, blocks, ask.num_tokens, ask.start_token)
    if peer_copies:
        return blocks, False, None
    want = staging_decided(cfg, d_layout, blocks, ask.num_tokens, ask.start_token)
    pieces = None
    if want is None:
        pieces = unpack_pieces(p_layout, d_layout, blocks, ask.num_tokens, ask.start_token)
        want = wants_staging(cfg, p_layout, d_layout, pieces)
    return blocks, want, pieces


def register_message(
    cfg: Config, ask: Asked, attempt: int, engine_id: str, rank: int, grant: protocol.StagingGrant | None
) -> protocol.Register:
    """The registration D rank ``rank`` sends for attempt ``attempt``, with its lease and staging grant."""
    return protocol.Register(
        transfer_id=ask.transfer_id,
        request_id=ask.request_id,
        engine_id=engine_id,
        rank=rank,
        block_ids=ask.block_ids,
        num_tokens=ask.num_tokens,
        start_token=ask.start_token,
        lease_ms=int(cfg.leases.registration_lease_s * 1000),
        staging=grant,
        attempt=attempt,
        skip_blocks=ask.skip_blocks,
        capability=ask.capability,
    )


def guess_parts(
    cfg: Config, num_regions: int, pieces: np.ndarray, base: int, costs: PartCosts | None = None
) -> list[tuple[int, int, int]]:
    """The parts P will most likely cut a whole-request push into (its rule, D's own config and costs), as
    ``(r0, r1, staging_addr)`` from the slot at ``base``; a part cut otherwise is unpacked all the same."""
    region_bytes = int(pieces[:, 1].sum()) if pieces.size else 0
    k = cut(cfg, num_regions * region_bytes, costs)
    return [(r0, r1, base + r0 * region_bytes) for r0, r1 in split_regions(0, num_regions, k)]


def staging_decided(
    cfg: Config, dst: KVLayout, dst_blocks: np.ndarray | list[int], num_tokens: int, start_token: int
) -> bool | None:
    """D's side of the choice where it can be made without D's unpack list, else None (``wants_staging``).

    D's unpack list has at least ``block_runs`` pieces per region, so when
    that bound already asks for a slot, D grants one, sends its Register and
    builds the list afterwards, while P pairs, plans and packs.
    """
    if cfg.staging.plan == "direct" or cfg.staging.staging_bytes == 0:
        return False
    if cfg.staging.plan == "staged":
        return True
    if block_runs(dst, dst_blocks, num_tokens, start_token) * len(dst.regions) >= cfg.staging.staged_min_descriptors:
        return True
    return None


def wants_staging(cfg: Config, src: KVLayout, dst: KVLayout, dst_pieces: np.ndarray) -> bool:
    """D's side of the choice: reserve a slot only when direct would post many descriptors.

    D sees only its own fragmentation (``dst_pieces`` from ``unpack_pieces``),
    a lower bound on the direct plan's descriptor count. When either side
    cannot be accessed in place, the push can only be staged: always reserve.
    A hybrid model's push (several KV-cache groups, or recurrent state) is direct: never reserve.
    """
    if dst.hybrid:
        return False
    if not (src.direct and dst.direct):
        return cfg.staging.staging_bytes > 0
    if cfg.staging.plan == "direct" or cfg.staging.staging_bytes == 0:
        return False
    if cfg.staging.plan == "staged":
        return True
    return dst_pieces.shape[0] * len(dst.regions) >= cfg.staging.staged_min_descriptors


def staging_grant(cfg: Config, slots: SlotAllocator, size: int, rounds: bool) -> protocol.StagingGrant | None:
    """The staging D grants a writer for a staged payload of ``size`` bytes, taken from ``slots``; None: none
    is free (the push goes direct).

    A payload no larger than a full ring (``ring_slots`` x ``min_part_bytes``), or any payload for a P rank
    that does not take rounds (an older protocol: ``rounds`` False), gets one slot holding all of it, as it
    always did. A larger one, or one whose whole slot is not free, goes through a ring
    (``kvpush.core.rounds``): the largest of ``ring_sizes`` that is free, smaller than the payload. So no
    prompt length needs a region that holds it, and a busy region hands out smaller rings before none.
    """
    st = cfg.staging
    part = st.min_part_bytes or MIN_PART_BYTES  # 0 lifts the one-slot plan's minimum; a ring's slot keeps a size
    full = st.ring_slots * part
    if not rounds or size <= full:
        off = slots.alloc(size)
        if off is not None:
            return protocol.StagingGrant(off, size)
        if not rounds:
            return None
    for n, each in ring_sizes(st.ring_slots, part):
        if n * each >= size:
            continue  # no smaller than the whole payload: its own slot was tried
        off = slots.alloc(n * each)
        if off is not None:
            return protocol.StagingGrant(off, n * each, each, n)
    return None
