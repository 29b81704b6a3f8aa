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
from kvpush.core.payload import check_unpack
from kvpush.core.plan import part_count, split_regions, staging_decided, unpack_pieces, wants_staging
from kvpush.decode.incoming import Asked, Incoming


def unpack_choice(
    cfg: Config, p_layout: KVLayout, d_layout: KVLayout, ask: Asked
) -> tuple[np.ndarray, bool, np.ndarray | None]:
    """``(blocks, want_staging, pieces)`` for a registration; raises when P's layout cannot write these blocks.

    ``pieces`` (D's unpack list) is built only when the cheap rule cannot
    decide the staging wish without it, and is ``None`` otherwise.
    """
    blocks = np.asarray(ask.block_ids[d_layout.token_group], dtype=np.int64)  # once, for the checks and the list
    check_unpack(p_layout, d_layout, blocks, ask.num_tokens, ask.start_token)
    want = staging_decided(cfg, d_layout, blocks, ask.num_tokens, ask.start_token)
    pieces = None
    if want is None:
        pieces = unpack_pieces(p_layout, d_layout, blocks, ask.num_tokens, ask.start_token)
        want = wants_staging(cfg, p_layout, d_layout, pieces)
    return blocks, want, pieces


def register_message(
    cfg: Config, inc: Incoming, engine_id: str, rank: int, grant: protocol.StagingGrant | None
) -> protocol.Register:
    """The registration D rank ``rank`` sends for this attempt, with its lease and staging grant."""
    ask = inc.asked
    return protocol.Register(
        transfer_id=inc.transfer_id,
        request_id=inc.request_id,
        engine_id=engine_id,
        rank=rank,
        block_ids=ask.block_ids,
        num_tokens=ask.num_tokens,
        start_token=ask.start_token,
        lease_ms=int(cfg.leases.registration_lease_s * 1000),
        staging=grant,
        attempt=inc.attempt,
        skip_blocks=ask.skip_blocks,
        capability=ask.capability,
    )


def guess_parts(cfg: Config, num_regions: int, pieces: np.ndarray, base: int) -> list[tuple[int, int, int]]:
    """The parts P will most likely cut a whole-request push into (its rule, D's own config), as
    ``(r0, r1, staging_addr)`` from the slot at ``base``; a part cut otherwise is unpacked all the same."""
    region_bytes = int(pieces[:, 1].sum()) if pieces.size else 0
    k = part_count(cfg.staging.push_parts, num_regions * region_bytes)
    return [(r0, r1, base + r0 * region_bytes) for r0, r1 in split_regions(0, num_regions, k)]
