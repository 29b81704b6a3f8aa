"""Plans in parts (pure): splitting regions, and per-part descriptors that add up to the whole push."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_layout import Scenario, apply_descriptors, reference_dst, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.config import Config
from kvpush.core.parts import MIN_PART_BYTES, PartCosts, PartSchedule, part_count, split_regions
from kvpush.core.plan import build_plan, part_descriptors, staged_bytes, staging_shortfall
from kvpush.core.rounds import RING_MIN_PART_BYTES


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 50), st.integers(1, 200), st.integers(1, 70))
def test_split_regions_tiles_the_range(r0: int, n: int, parts: int) -> None:
    ranges = split_regions(r0, r0 + n, parts)
    assert ranges[0][0] == r0 and ranges[-1][1] == r0 + n
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    assert len(ranges) <= min(parts, n)
    if parts >= 4 and n >= 8 * parts:
        # Pipeline fill and drain: the first and last parts are the small ones.
        sizes = [b - a for a, b in ranges]
        assert max(sizes[0], sizes[-1]) < min(sizes[1:-1])


@settings(max_examples=80, deadline=None)
@given(scenarios(), st.integers(1, 9))
def test_direct_parts_add_up_to_the_whole_push(scn: Scenario, parts: int) -> None:
    """Posting a direct plan region range by region range writes exactly the reference bytes."""
    plan = build_plan(Config.of(plan="direct"), *scn.call_args())
    out = scn.dst.arena.copy()
    if plan.kind != "empty":
        for r0, r1 in split_regions(0, plan.nregions, parts):
            local, remote = part_descriptors(plan, scn.src.layout, scn.dst.layout, r0, r1)
            apply_descriptors(local, remote, scn.src, out, scn.dst)
    np.testing.assert_array_equal(out, reference_dst(scn))


@settings(max_examples=40, deadline=None)
@given(scenarios(), st.integers(1, 9))
def test_staged_parts_cover_the_slots_region_by_region(scn: Scenario, parts: int) -> None:
    plan = build_plan(
        Config.of(plan="staged"), *scn.call_args(), staging_local=(1 << 20, 0), staging_remote=(1 << 30, 1 << 40, 1)
    )
    if plan.kind == "empty":
        return
    assert plan.kind == "staged" and plan.nbytes == plan.region_bytes * plan.nregions
    covered = 0
    for r0, r1 in split_regions(0, plan.nregions, parts):
        local, remote = part_descriptors(plan, scn.src.layout, scn.dst.layout, r0, r1)
        assert local.shape == remote.shape == (1, 3)
        assert local[0, 0] == (1 << 20) + covered and remote[0, 0] == (1 << 30) + covered
        assert local[0, 1] == remote[0, 1] == (r1 - r0) * plan.region_bytes
        covered += local[0, 1]
    assert covered == plan.nbytes


@settings(max_examples=5, deadline=None)
@given(scenarios())
def test_part_outside_the_plan_is_refused(scn: Scenario) -> None:
    plan = build_plan(Config.of(plan="direct"), *scn.call_args())
    with pytest.raises(ValueError, match="outside the plan"):
        part_descriptors(plan, scn.src.layout, scn.dst.layout, 0, plan.nregions + 1)


def test_part_count_keeps_parts_large_and_at_most_push_parts() -> None:
    mib = 1 << 20
    assert 16 * mib == MIN_PART_BYTES
    assert part_count(4, 512 * mib) == 4
    assert part_count(4, 40 * mib) == 2  # two parts of >= 16 MiB fit, not four
    assert part_count(4, 10 * mib) == 1
    assert part_count(1, 512 * mib) == 1
    assert part_count(4, 0) == 1
    assert part_count(4, 40 * mib, min_part_bytes=mib) == 4


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(0, 1 << 32),
    st.floats(1e8, 1e13),
    st.floats(1e8, 1e13),
    st.floats(1e8, 1e13),
    st.floats(0, 1e-3),
    st.booleans(),
)
def test_the_cost_model_picks_the_fastest_count_and_never_more_parts_than_one_costs(
    most: int, nbytes: int, pack: float, wire: float, unpack: float, part_s: float, overlaps: bool
) -> None:
    """The chosen count is within the bounds, fastest by the model (the fewest on a tie), so never slower
    than one part; with no fixed cost per part, the most parts allowed."""
    costs = PartCosts(pack, wire, unpack, part_s, overlaps)
    k = part_count(most, nbytes, 1 << 20, costs)
    bound = part_count(most, nbytes, 1 << 20)
    assert 1 <= k <= bound
    t = [costs.seconds(nbytes, i) for i in range(1, bound + 1)]
    assert t[k - 1] <= min(t) * (1 + 1e-9) and t[k - 1] <= t[0]
    assert all(ti > t[k - 1] * (1 + 1e-12) or i + 1 >= k for i, ti in enumerate(t[: k - 1]))
    if part_s == 0 and nbytes:
        assert k == bound


def test_the_cost_model_cuts_a_long_push_where_the_overlap_pays_and_a_short_one_not_at_all() -> None:
    mib = 1 << 20
    gpu = PartCosts(1.8e12, 1.25e12, 1.8e12, 100e-6)  # one H200's copies and NVLink-like wire, 0.1 ms a part
    assert part_count(16, 512 * mib, MIN_PART_BYTES, gpu) == 2
    assert part_count(16, 512 * mib, MIN_PART_BYTES, PartCosts(1.8e12, 1.25e12, 1.8e12, 0.0)) == 16
    host = PartCosts(5e9, 25e9, 5e9, 100e-6, pack_overlaps=False)  # packs on the posting thread
    assert part_count(16, 4 * mib, 0, host) == 3
    assert part_count(16, 64 * mib, MIN_PART_BYTES, host) == 4
    # A pack that does not overlap the wire saves less by cutting than one that does.
    assert host.seconds(64 * mib, 4) - host.seconds(64 * mib, 1) > PartCosts(5e9, 25e9, 5e9, 100e-6).seconds(
        64 * mib, 4
    ) - PartCosts(5e9, 25e9, 5e9, 100e-6).seconds(64 * mib, 1)


STREAM = 1 << 30


def _schedule(layers: int, region_bytes: int, min_part_bytes: int, lead: int, per_layer: int = 1) -> PartSchedule:
    """A layout of ``layers`` layers of ``per_layer`` regions each."""
    return PartSchedule(tuple(range(per_layer, layers * per_layer + 1, per_layer)), region_bytes, min_part_bytes, lead)


def ready_part_end(sent: int, ready: int, step: int, total: int, nbytes: int, min_part_bytes: int, lead: int) -> int:
    """``PartSchedule.part_end`` of ``total`` regions in layers of ``step`` regions."""
    return _schedule(total // step, nbytes, min_part_bytes, lead, step).part_end(sent, ready)


def _layer_parts(
    layers: int, layer_bytes: int, min_part_bytes: int, per_report: int = 1, lead: int = STREAM
) -> list[tuple[int, int]]:
    """The parts a forward reporting ``per_report`` regions at a time (a layer of that many regions) is posted in."""
    parts, sent = [], 0
    sched = _schedule(layers // per_report, layer_bytes, min_part_bytes, lead, per_report)
    for ready in range(per_report, layers + 1, per_report):
        end = sched.part_end(sent, ready)
        if end > sent:
            parts.append((sent, end))
            sent = end
    return parts


def test_layers_are_grouped_and_the_last_layer_goes_alone() -> None:
    mib = 1 << 20
    # 2k tokens of a Qwen3-32B TP8 rank: 1 MiB layers, parts of >= 16 MiB, the last layer alone.
    assert _layer_parts(64, mib, 16 * mib) == [(0, 16), (16, 32), (32, 48), (48, 63), (63, 64)]
    # 16k tokens: 8 MiB layers.
    parts = _layer_parts(64, 8 * mib, 16 * mib)
    assert parts[:2] == [(0, 2), (2, 4)] and parts[-3:] == [(60, 62), (62, 63), (63, 64)]
    assert _layer_parts(6, mib, 0) == [(i, i + 1) for i in range(6)]
    assert _layer_parts(6, mib, 16 * mib, per_report=2) == [(0, 4), (4, 6)]  # the last report, not a layer
    assert _layer_parts(6, mib, 16 * mib, per_report=6) == [(0, 6)]  # whole-request: one report
    assert ready_part_end(3, 3, 1, 6, mib, 0, STREAM) == 3 and ready_part_end(3, 2, 1, 6, mib, 0, STREAM) == 3


def test_layers_are_held_until_lead_layers_are_left() -> None:
    """The default schedule: nothing is posted until ``lead_layers`` are left, then everything ready at once."""
    mib = 1 << 20
    # lead 1: the held 63 layers go when one is left, then the last layer alone.
    assert _layer_parts(64, 8 * mib, 16 * mib, lead=1) == [(0, 63), (63, 64)]
    assert _layer_parts(64, 8 * mib, 0, lead=1) == [(0, 63), (63, 64)]
    # lead 4: the held layers go when four are left, then grouped by min_part_bytes, the last alone.
    assert _layer_parts(64, 8 * mib, 16 * mib, lead=4) == [(0, 60), (60, 62), (62, 63), (63, 64)]
    assert _layer_parts(64, 8 * mib, 0, lead=4) == [(0, 60), (60, 61), (61, 62), (62, 63), (63, 64)]
    # Two layers a report: "left" counts reports, so lead 2 starts with four layers left.
    assert _layer_parts(12, mib, 0, per_report=2, lead=2) == [(0, 8), (8, 10), (10, 12)]
    # Held bytes under min_part_bytes wait for the one-layer-left rule.
    assert _layer_parts(8, mib, 16 * mib, lead=4) == [(0, 7), (7, 8)]
    # A late registration (everything but the last layer already computed) posts at once.
    assert ready_part_end(0, 63, 1, 64, mib, 16 * mib, 1) == 63
    assert ready_part_end(0, 40, 1, 64, mib, 0, 1) == 0  # 24 layers left: held


def test_wake_at_is_the_first_report_that_starts_a_part() -> None:
    """What ``layer_written`` wakes the push thread for: exactly the reports ``part_end`` posts at."""
    for total in (1, 5, 12):
        for step in range(1, 4):
            # Layers of ``step`` regions; the last one may be shorter (any layout lists layers in order).
            ends = tuple(sorted({*range(step, total, step), total}))
            for sent in (0, *ends[:-1]):
                for min_bytes in (0, 1, 7, 25, 30, 100):
                    for lead in (1, 2, 3, STREAM):
                        sched = PartSchedule(ends, 10, min_bytes, lead)
                        starts = [r for r in ends if r > sent and sched.part_end(sent, r) > sent]
                        assert sched.wake_at(sent) == starts[0], (total, sent, step, min_bytes, lead)


@settings(max_examples=80, deadline=None)
@given(scenarios(), st.sampled_from(["auto", "direct", "staged"]))
def test_a_peer_plan_copies_exactly_the_reference_bytes_whatever_plan_is_configured(scn: Scenario, cfg: str) -> None:
    """A peer plan (P's device writes D's blocks) is chosen over staging and the cost model, and its pieces,
    copied region by region from P's bases to D's as the backend's peer copy does, write exactly the bytes a
    direct push writes."""
    plan = build_plan(
        Config.of(plan=cfg),
        *scn.call_args(),
        staging_local=(1 << 20, 0),
        staging_remote=(1 << 30, 1 << 40, 1),
        peer=True,
    )
    direct = build_plan(Config.of(plan="direct"), *scn.call_args())
    out = scn.dst.arena.copy()
    if direct.kind == "empty":
        assert plan.kind == "empty"
    else:
        assert plan.kind == "peer" and plan.nbytes == direct.nbytes and plan.pack is None
        for rs, rd in zip(scn.src.layout.regions, scn.dst.layout.regions, strict=True):
            local = np.stack([rs.base + plan.merged[:, 0], plan.merged[:, 2], np.zeros_like(plan.merged[:, 2])], 1)
            remote = np.stack([rd.base + plan.merged[:, 1], plan.merged[:, 2], np.zeros_like(plan.merged[:, 2])], 1)
            apply_descriptors(local, remote, scn.src, out, scn.dst)
    np.testing.assert_array_equal(out, reference_dst(scn))


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.integers(0, 8), st.integers(1, 4096))
def test_staging_shortfall_says_exactly_when_the_longest_push_cannot_be_staged(
    scn: Scenario, pages: int, max_tokens: int
) -> None:
    """The warning at start (``staging_shortfall``) agrees with what the region really holds: a region that
    holds a ring's two smallest slots stages any prompt in rounds; a smaller one holds a push of
    ``max_tokens`` with a peer of the same heads size for size (``staged_bytes``), and the tokens it names as
    held fit the region while one block more would not."""
    lay = scn.src.layout
    region = pages * 4096 * (33 if pages % 3 == 0 else 1)  # some regions large enough for a ring
    cfg = Config.from_dict({"staging_bytes": region})
    short = staging_shortfall(cfg, lay, max_tokens)
    need = staged_bytes(lay, lay, -(-max_tokens // lay.block_size) * lay.block_size, 0)
    rounds = region >= 2 * RING_MIN_PART_BYTES
    assert (short is not None) == (region > 0 and need > region and not rounds), (short, need, region)
    if short is not None:
        held, needed = short
        assert needed == need
        assert staged_bytes(lay, lay, held, 0) <= region < staged_bytes(lay, lay, held + lay.block_size, 0)
    assert staging_shortfall(Config.from_dict({"staging_bytes": region, "plan": "direct"}), lay, max_tokens) is None
    assert staging_shortfall(Config.from_dict({"staging_bytes": need}), lay, max_tokens) is None  # exactly fits
