"""How a push starts (``kvpush.prefill.push_start``): one decision, from the registration, the hello and P's slots.

Over random requests, staging grants (none, a slot for the whole payload, a ring) and P's own region (free,
busy, absent), the decision keeps its rules: a D rank P maps gets peer copies and no slot; a ring granted
by D and a ring of P's own make a staged plan one in rounds, P's ring never larger than D's and its slots
D's size; a plan that stages holds exactly one slot of P's, every other plan none (what the slot rule
granted and the plan did not take is given back); a registration asking for more than the prefill
computed is refused and leaves P's slots as they were; what is counted is the plan's kind.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.config import Config
from kvpush.core.counts import Count
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.outcome import PlanKind
from kvpush.core.protocol import Register, StagingGrant
from kvpush.core.staging import SlotAllocator
from kvpush.prefill.decisions import Prefill
from kvpush.prefill.push_start import BadRegistration, Local, Remote, start_push
from kvpush.prefill.slots import StagingSlots
from kvpush.prefill.transfer import Transfer

BLOCKS, BS, HEADS, HB, LAYERS = 64, 16, 2, 64, 2
REGION = BLOCKS * BS * HEADS * HB
P_STAGING, D_STAGING = 1 << 40, 1 << 41


def _layout(base: int) -> KVLayout:
    regions = tuple(Region(base + i * REGION, REGION, 0, 0, i // 2) for i in range(2 * LAYERS))
    return KVLayout(
        block_size=BS,
        num_blocks=BLOCKS,
        block_stride=BS * HEADS * HB,
        head_bytes=HB,
        num_heads=HEADS,
        local_heads=HEADS,
        head_start=0,
        order=TokenOrder.NHD,
        mem=MemKind.DRAM,
        dtype="bfloat16",
        regions=regions,
    ).validate()


P, D = _layout(1 << 30), _layout(1 << 32)
CFG = Config.of(staging_bytes=1 << 20, min_part_bytes=8 << 10, ring_slots=4, staged_min_descriptors=1)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.integers(1, BLOCKS * BS),
    shuffle=st.booleans(),
    grant=st.sampled_from(["none", "slot", "ring"]),
    d_slots=st.integers(1, 4),
    p_region=st.sampled_from([0, 8 << 10, 32 << 10, 1 << 20]),
    busy=st.integers(0, 3),
    mapped=st.booleans(),
    plan=st.sampled_from(["auto", "staged", "direct"]),
    extra=st.integers(0, 1),
    data=st.data(),
)
def test_a_push_starts_by_the_rules(tokens, shuffle, grant, d_slots, p_region, busy, mapped, plan, extra, data) -> None:
    cfg = CFG.replace(plan=plan)
    rng = np.random.default_rng(tokens)
    nb = -(-tokens // BS)
    d_blocks = rng.permutation(BLOCKS)[:nb] if shuffle else np.arange(nb)
    p_blocks = tuple(int(b) for b in rng.permutation(BLOCKS)[:nb])
    payload = tokens * HEADS * HB * 2 * LAYERS
    part = 8 << 10
    staging = None
    if grant == "slot":
        staging = StagingGrant(4096, payload)
    elif grant == "ring":
        staging = StagingGrant(4096, d_slots * part, part, d_slots)
    reg = Register(
        transfer_id="t",
        request_id="d",
        engine_id="D",
        rank=0,
        block_ids=(d_blocks,),
        num_tokens=tokens,
        staging=staging,
    )
    alloc = SlotAllocator(p_region)
    held = [alloc.alloc(4096) for _ in range(busy)] if p_region else []  # other pushes hold part of the region
    slots = StagingSlots(alloc, cfg, P)
    before = alloc.slots_in_use
    local = Local(cfg, P, (P_STAGING, 0) if p_region else None, (2, 4), 5e9, False, False)
    remote = Remote(D, (D_STAGING, 0), mapped)
    prefill = Prefill("t", "p", (p_blocks,), tokens - extra if extra and tokens > 1 else tokens)
    if prefill.num_tokens < tokens:
        with pytest.raises(BadRegistration, match="asks for"):
            start_push(local, slots, prefill, reg, remote, Transfer())
        assert alloc.slots_in_use == before
        return
    start = start_push(local, slots, prefill, reg, remote, Transfer())
    kind = start.plan.kind
    assert Count.plan(kind) in start.counts
    if mapped:
        assert kind is PlanKind.PEER and start.slot is None
    staged = kind in (PlanKind.STAGED, PlanKind.ROUNDS)
    assert (start.slot is not None) == staged, (kind, start.slot)
    assert alloc.slots_in_use == before + staged, "a slot kept by a plan that does not stage, or lost by one that does"
    if staged:
        assert staging is not None and p_region
    if kind is PlanKind.ROUNDS:
        ring = start.plan.ring
        assert grant == "ring" and ring is not None
        assert ring.d_slots == d_slots and 1 <= ring.p_slots <= d_slots and ring.part_bytes == part
        assert start.job_plan.slices is not None and set(start.job_plan.slices) == set(ring.slices())
        assert sum(t.nbytes for t in ring.tiles) == start.plan.nbytes
    if grant == "ring" and staged:
        assert kind is PlanKind.ROUNDS, "a ring granted, a plan that stages in one slot"
    if plan == "direct" and not mapped:
        assert kind in (PlanKind.DIRECT, PlanKind.EMPTY)
    for off in held:
        if off is not None:
            alloc.free(off)
