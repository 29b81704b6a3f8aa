"""D's registration rules (pure): the checks and staging wish, the guessed parts, who writes and who stands by."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_layout import Scenario, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.config import Config
from kvpush.core.layout import LayoutError
from kvpush.core.parts import MIN_PART_BYTES, part_count
from kvpush.core.payload import unpack_pieces
from kvpush.core.topology import bystander_channels, writer_channels
from kvpush.decode.incoming import Asked
from kvpush.decode.registration import guess_parts, unpack_choice, wants_staging


def _asked(scn: Scenario, num_tokens: int | None = None) -> Asked:
    n = scn.num_tokens if num_tokens is None else num_tokens
    return Asked("t", "r", (tuple(scn.dst_blocks),), n, scn.start_token)


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from(["auto", "direct", "staged"]), st.integers(1, 40))
def test_unpack_choice_agrees_with_the_full_unpack_list(scn: Scenario, plan: str, min_desc: int) -> None:
    """The staging wish is the one the full unpack list gives, whether or not the list had to be built."""
    cfg = Config.of(plan=plan, staging_bytes=1 << 20, staged_min_descriptors=min_desc)
    p, d = scn.src.layout, scn.dst.layout
    blocks, want, pieces = unpack_choice(cfg, p, d, _asked(scn))
    full = unpack_pieces(p, d, blocks, scn.num_tokens, scn.start_token)
    if pieces is not None:
        np.testing.assert_array_equal(pieces, full)
    assert want == wants_staging(cfg, p, d, full)


@settings(max_examples=20, deadline=None)
@given(scenarios(), st.sampled_from(["auto", "direct", "staged"]))
def test_unpack_choice_refuses_more_tokens_than_the_blocks_hold(scn: Scenario, plan: str) -> None:
    """Checked whatever the staging wish, also when no unpack list is built before the send."""
    too_many = len(scn.dst_blocks) * scn.dst.layout.block_size + 1
    with pytest.raises(LayoutError):
        unpack_choice(Config.of(plan=plan), scn.src.layout, scn.dst.layout, _asked(scn, too_many))


@settings(max_examples=30, deadline=None)
@given(scenarios(), st.sampled_from(["auto", "direct", "staged"]))
def test_a_writer_with_peer_copies_gets_no_staging_but_the_same_checks(scn: Scenario, plan: str) -> None:
    """P said it writes with peer copies: no staging wish and no unpack list, whatever the plan; the
    registration is checked all the same."""
    cfg = Config.of(plan=plan, staging_bytes=1 << 20, staged_min_descriptors=1)
    p, d = scn.src.layout, scn.dst.layout
    blocks, want, pieces = unpack_choice(cfg, p, d, _asked(scn), peer_copies=True)
    assert (want, pieces) == (False, None)
    np.testing.assert_array_equal(blocks, np.asarray(scn.dst_blocks, dtype=np.int64))
    too_many = len(scn.dst_blocks) * d.block_size + 1
    with pytest.raises(LayoutError):
        unpack_choice(cfg, p, d, _asked(scn, too_many), peer_copies=True)


@pytest.mark.parametrize("push_parts", [1, 3, 8])
@pytest.mark.parametrize("regions", [1, 5, 64])
def test_guessed_parts_tile_the_slot_region_by_region(push_parts: int, regions: int) -> None:
    region_bytes = 3 * MIN_PART_BYTES // 2
    pieces = np.array([[0, region_bytes // 3, 0], [7, region_bytes - region_bytes // 3, 0]], dtype=np.int64)
    parts = guess_parts(Config.of(push_parts=push_parts), regions, pieces, 1 << 20)
    assert len(parts) == min(regions, part_count(push_parts, regions * region_bytes))
    assert parts[0][0] == 0 and parts[-1][1] == regions
    for (r0, r1, addr), nxt in zip(parts, [*parts[1:], None], strict=True):
        assert addr == (1 << 20) + r0 * region_bytes
        if nxt is not None:
            assert nxt[0] == r1


def test_writers_and_bystanders_when_p_has_more_ranks_than_kv_heads() -> None:
    """P TP 4 over 2 KV heads (each head on two P ranks), D TP 2: each D rank takes its head from one P rank,
    and the two replicas nobody reads from are bystanders."""
    assert writer_channels("h", 5000, 4, 0, 2, 2) == {0: ("h", 5000)}
    assert writer_channels("h", 5000, 4, 1, 2, 2) == {3: ("h", 5003)}
    assert bystander_channels("h", 5000, 4, 2, 2) == {1: ("h", 5001), 2: ("h", 5002)}
    assert bystander_channels("h", 5000, 2, 2, 8) == {}
