"""P's staging-slot rule without NIXL (``kvpush.prefill.slots.StagingSlots``): who holds each slot, and when.

A state machine plays P's engine around a real ``SlotAllocator`` (it raises
on a double free; the test's subclass also refuses a free while a pack at
hand-over may still write the slot): prefills handed over and packed into a
slot (or the pack failing to start), packs ending on the device, the engine
polling their markers, pushes paired and planned (staged with the packed
slot, staged with a fresh one, direct or empty as a fallback, or planning
failing), jobs ending, prefills ending, and shutdown.

Promises checked: every slot allocated is freed exactly once, and only once
no pack may write it; a push that falls back to a direct plan (or fails to
plan) leaks no slot; a parked slot is taken back for a registered push only
once its pack has ended, the oldest first; a push gets the packed slot only
for the very pack list it plans with and only when it fits D's slot; every
slot is a push's, a parked prefill's or set aside (no leak), and once all
have ended the whole region is one free slot again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from helpers_layout import Scenario, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.config import Config
from kvpush.core.layout import heads_overlap
from kvpush.core.outcome import PlanKind
from kvpush.core.payload import pack_pieces
from kvpush.core.staging import ALIGN, SlotAllocator
from kvpush.prefill.prepack import Prepack, Prepacks, packs_at_hand_over
from kvpush.prefill.slots import Evicted, Grant, PackEnded, PackParked, StagingSlots


@dataclass(eq=False)
class Marker:
    reached: bool = False


def _reached(m: Marker | None) -> bool:
    return m is None or m.reached


class CheckedAllocator(SlotAllocator):
    """The real allocator, counting allocations and frees and refusing to free a slot a pack may still write."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.writer: dict[int, Marker | None] = {}  # the pack at hand-over writing each parked slot
        self.allocs = 0
        self.frees = 0

    def alloc(self, size: int) -> int | None:
        offset = super().alloc(size)
        self.allocs += offset is not None
        return offset

    def free(self, offset: int) -> None:
        assert _reached(self.writer.pop(offset, None)), "a slot freed while its pack at hand-over may still write it"
        super().free(offset)  # raises on a slot not allocated: freed twice
        self.frees += 1


class SlotsMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 16), share=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    def setup(self, capacity: int, share: float) -> None:
        self.alloc = CheckedAllocator(capacity * ALIGN)
        self.slots = StagingSlots(self.alloc, Config(), None, Prepacks(capacity * ALIGN, share))  # type: ignore[arg-type]
        self.next = 0
        self.parked: dict[str, tuple[int, int, np.ndarray, Marker | None]] = {}  # tid -> the pack at hand-over
        self.jobs: dict[str, tuple[int, Marker | None]] = {}  # tid -> (its job's slot, the hand-over pack it took)
        self.sizes: dict[int, int] = {}  # every slot a push or a parked prefill holds: its size

    def _tid(self) -> str:
        self.next += 1
        return f"t{self.next}"

    # -- hand-over ------------------------------------------------------------------
    @rule(blocks=st.integers(1, 8), on_device=st.booleans(), fails=st.booleans(), again=st.booleans())
    def hand_over(self, blocks: int, on_device: bool, fails: bool, again: bool) -> None:
        """A parked prefill the rule packs: a slot if the share admits one free now; the pack may fail to start.
        ``again``: a re-issued prefill (same transfer id) replaces its packed slot."""
        tid = next(iter(self.parked)) if again and self.parked else self._tid()
        size = blocks * ALIGN
        in_use = self.alloc.slots_in_use
        acts = self.slots.park(tid, size)
        if not acts:
            assert self.alloc.slots_in_use == in_use, "no pack, but a slot was taken"
            return
        (a,) = acts
        assert isinstance(a, PackParked) and (a.transfer_id, a.size) == (tid, size)
        assert a.offset not in self.sizes, "a slot handed out twice"
        if fails:
            self.slots.park_failed(a.offset)
            return
        marker = Marker() if on_device else None
        pack = np.zeros((blocks, 2), dtype=np.int64)
        self.alloc.writer[a.offset] = marker
        self.sizes[a.offset] = size
        old = self.parked.pop(tid, None)
        self.slots.parked_packed(tid, Prepack(a.offset, size, pack, None, marker))
        if old is not None:
            self.sizes.pop(old[0])
        self.parked[tid] = (a.offset, size, pack, marker)

    @precondition(lambda self: any(not _reached(m) for m in self.alloc.writer.values()))
    @rule(i=st.integers(0, 7))
    def pack_ends(self, i: int) -> None:
        running = [m for m in self.alloc.writer.values() if not _reached(m)]
        running[i % len(running)].reached = True

    @rule()
    def engine_polls(self) -> None:
        """The engine polls the packs' markers: each newly ended pack of a parked prefill is told once."""
        before = {t for t, (_, _, _, m) in self.parked.items() if not self.slots.ledger.get(t).reached}
        acts = self.slots.poll(_reached)
        ended = {a.transfer_id for a in acts if isinstance(a, PackEnded)}
        assert len(ended) == len(acts)
        assert ended == {t for t in before if _reached(self.parked[t][3])}, (ended, before)

    @precondition(lambda self: self.parked)
    @rule(i=st.integers(0, 7))
    def prefill_ends(self, i: int) -> None:
        """Lease expiry, abort, D dead, released after its push: the parked slot is dropped (freed, or set aside)."""
        tid = list(self.parked)[i % len(self.parked)]
        self.slots.prefill_ended(tid)
        self.sizes.pop(self.parked.pop(tid)[0])

    # -- pushes ---------------------------------------------------------------------
    @rule(
        i=st.integers(0, 7),
        parked=st.booleans(),
        want=st.one_of(st.none(), st.integers(1, 20)),
        same_list=st.booleans(),
        kind=st.sampled_from(list(PlanKind)),
        planning_fails=st.booleans(),
        takes_list=st.booleans(),
        ring=st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(1, 5))),
    )
    def pairing(
        self,
        i: int,
        parked: bool,
        want: int | None,
        same_list: bool,
        kind,
        planning_fails: bool,
        takes_list: bool,
        ring: tuple[int, int] | None,
    ) -> None:
        """D registered (``want``: its slot's blocks when both sides can stage; ``same_list``: the list built at
        hand-over fits it; ``ring``: D granted a ring of (slots, blocks per slot)): the push is planned
        (``takes_list``: with that list, else one of its own)."""
        tid = list(self.parked)[i % len(self.parked)] if parked and self.parked else self._tid()
        held = self.parked.get(tid)
        ahead = held[2] if held is not None and same_list else None
        want_b = want * ALIGN if want is not None else None
        ring_b = (ring[0], ring[1] * ALIGN) if ring is not None and want_b is not None else None
        if ring_b is not None:
            want_b = ring_b[0] * ring_b[1]
        ended = [t for t in self.parked if t != tid and self.slots.ledger.get(t).reached]
        acts = self.slots.pair(tid, want_b, ahead, ring_b)
        grants = [a for a in acts if isinstance(a, Grant)]
        evicted = [a.transfer_id for a in acts if isinstance(a, Evicted)]
        assert len(grants) + len(evicted) == len(acts) and len(grants) <= 1 and (not grants or acts[-1] is grants[0])
        assert evicted == ended[: len(evicted)], "a parked slot taken back before its pack ended, or not the oldest"
        kept = held is not None and self.slots.ledger.get(tid) is not None  # the packed slot stays in the running
        fits = held is not None and want_b is not None and ring_b is None and ahead is held[2] and held[1] <= want_b
        assert kept == fits, "a packed slot kept for a push it does not fit, or dropped for one it fits"
        self._forget_dropped()
        offset = grants[0].offset if grants else None
        if offset is not None:
            assert want_b is not None, "a slot for a push that cannot stage"
            if kept:
                assert offset == held[0] and ahead is held[2] and held[1] <= want_b, "the packed slot, wrongly"
            else:
                assert offset not in self.sizes, "a slot handed out twice"
                if ring_b is not None:
                    assert 1 <= grants[0].slots <= ring_b[0], "a ring of P's own has 1 to D's count of slots"
                    self.sizes[offset] = grants[0].slots * ring_b[1]
                else:
                    assert grants[0].slots == 0
                    self.sizes[offset] = want_b
        else:
            assert not kept, "the packed slot fits, yet the push goes without it"
            left = [t for t in self.parked if self.slots.ledger.get(t).reached]
            least = ring_b[1] if ring_b is not None else want_b
            assert least is None or least > self.alloc.capacity or not left, "went without, a parked slot ended"
        if planning_fails:
            self.slots.plan_failed(tid, offset)
            self._after_plan(offset, [], kept)
            return
        staged = (PlanKind.STAGED, PlanKind.ROUNDS)
        if offset is None and kind in staged:
            kind = PlanKind.DIRECT  # build_plan stages only with a slot on both sides
        pack = ahead if ahead is not None and takes_list else np.zeros((1, 2), dtype=np.int64)
        got = self.slots.planned(tid, offset, kind, pack)
        if got:
            (g,) = got
            assert isinstance(g, Grant) and kind in staged and g.offset == offset
            if g.prepack is not None:
                assert kept and g.prepack.pack is held[2] is pack, "took a pack made for another list"
                self.parked.pop(tid)  # claimed: the slot is the job's now
            else:
                assert not kept or pack is not held[2], "a staged plan with the packed list did not claim it"
            self.jobs[self._tid()] = (g.offset, g.prepack.marker if g.prepack is not None else None)
        else:
            assert kind not in staged or kept, "a staged plan with a fresh slot lost it"
            assert self.slots.ledger.get(tid) is None, "a packed slot the plan did not take is still held"
        self._after_plan(offset, got, kept)

    def _forget_dropped(self) -> None:
        """The ledger dropped these parked prefills' slots (freed, or set aside until their pack ends)."""
        for tid in [t for t in self.parked if self.slots.ledger.get(t) is None]:
            self.sizes.pop(self.parked.pop(tid)[0])

    def _after_plan(self, offset: int | None, got: list, kept: bool) -> None:
        """A fresh slot the push did not keep is freed; a packed one not claimed is dropped."""
        if offset is not None and not got and not kept:
            self.sizes.pop(offset)
        self._forget_dropped()

    @precondition(lambda self: self.jobs)
    @rule(i=st.integers(0, 7))
    def job_done(self, i: int) -> None:
        """A push job ends: a job that took a packed slot ends only after that pack (``PushJob``'s rule)."""
        tid = list(self.jobs)[i % len(self.jobs)]
        offset, marker = self.jobs.pop(tid)
        if marker is not None:
            marker.reached = True
        self.slots.job_done(offset)
        self.sizes.pop(offset)

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def every_slot_accounted_for(self) -> None:
        if not hasattr(self, "slots"):
            return
        held = sorted(p.slot for _, p in self.slots.ledger.held())
        assert held == sorted(o for o, *_ in self.parked.values())
        jobs = sorted(o for o, _ in self.jobs.values())
        assert sorted(self.slots.pushes) == jobs
        owned = held + jobs
        assert len(owned) == len(set(owned)) and set(owned) == set(self.sizes), "a slot owned twice, or lost"
        assert self.slots.ledger.draining + len(owned) == self.alloc.slots_in_use == self.slots.in_use, "a leak"
        assert self.alloc.allocs - self.alloc.frees == self.alloc.slots_in_use

    @invariant()
    def parked_slots_keep_to_the_share(self) -> None:
        if hasattr(self, "slots"):
            ledger = self.slots.ledger
            assert len(ledger) <= 1 or ledger.held_bytes <= ledger.limit

    def teardown(self) -> None:
        """Shutdown: the engine waits for every pack, the parked slots come back, the jobs end; then every slot
        allocated was freed exactly once and the region is whole again."""
        if not hasattr(self, "slots"):
            return
        for m in self.slots.markers():
            m.reached = True
        self.slots.close()
        assert self.slots.gauges() == {"parked_staging_slots": 0, "parked_staging_bytes": 0}
        for offset, marker in self.jobs.values():
            if marker is not None:
                marker.reached = True
            self.slots.job_done(offset)
        assert self.alloc.slots_in_use == 0 and self.alloc.allocs == self.alloc.frees
        assert self.alloc.alloc(self.alloc.capacity) == 0, "bytes of a freed slot never came back"


SlotsMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_staging_slots_state_machine = SlotsMachine.TestCase


def test_a_registered_push_takes_back_only_ended_parked_slots_oldest_first() -> None:
    """Two parked slots fill the region; the older one's pack still runs: a registered push takes the younger
    (ended) one; with neither ended it goes without a slot (a direct plan), taking nothing."""
    slots = StagingSlots(SlotAllocator(2 * ALIGN), Config(), None, Prepacks(2 * ALIGN, 1.0))  # type: ignore[arg-type]
    running, ended = Marker(), Marker(reached=True)
    for tid, m in (("old", running), ("young", ended)):
        (a,) = slots.park(tid, ALIGN)
        slots.parked_packed(tid, Prepack(a.offset, ALIGN, np.zeros((1, 2)), None, m))
    slots.poll(_reached)
    acts = slots.pair("new", ALIGN, None)
    assert acts == [Evicted("young"), Grant(ALIGN)], acts
    assert slots.pair("other", ALIGN, None) == [], "took a slot whose pack may still run"
    assert slots.in_use == 2 and slots.ledger.draining == 0


def test_a_direct_fallback_gives_its_slot_back() -> None:
    """A push granted a fresh slot whose plan comes out direct frees it at once; one granted the packed slot
    and planned with another list drops it (set aside until the pack ends)."""
    alloc = SlotAllocator(4 * ALIGN)
    slots = StagingSlots(alloc, Config(), None)  # type: ignore[arg-type]
    (g,) = slots.pair("t", ALIGN, None)
    assert slots.planned("t", g.offset, PlanKind.DIRECT, None) == [] and alloc.slots_in_use == 0
    pm, pack = Marker(), np.zeros((1, 2))
    (a,) = slots.park("p", ALIGN)
    slots.parked_packed("p", Prepack(a.offset, ALIGN, pack, None, pm))
    (g,) = slots.pair("p", ALIGN, pack)
    assert g == Grant(a.offset)
    assert slots.planned("p", g.offset, PlanKind.STAGED, pack.copy()) == []
    assert slots.ledger.draining == 1 and alloc.slots_in_use == 1
    pm.reached = True
    slots.poll(_reached)
    assert alloc.slots_in_use == 0


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.sampled_from([None, PlanKind.STAGED, PlanKind.DIRECT]), st.booleans())
def test_the_pack_at_hand_over_follows_the_last_plan_made_with_a_slot(scn: Scenario, last, on: bool) -> None:
    """``wants_pack`` is ``prepack.packs_at_hand_over`` judged with the kind of the last plan that had a slot on
    both sides (a plan without one leaves it), and never with ``pack_at_hand_over`` off or a hybrid layout."""
    scn = replace(scn, start_token=0)
    sl, dl = scn.src.layout, scn.dst.layout
    pack = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, 0)
    cfg = Config.of(pack_at_hand_over=on)
    slots = StagingSlots(SlotAllocator(1 << 20), cfg, sl)
    if last is not None:
        (g,) = slots.pair("t", ALIGN, None)
        slots.planned("t", g.offset, last, pack)
    slots.planned("u", None, PlanKind.DIRECT, None)  # no slot: the last plan with one stands
    assert slots.last_staging_plan is last
    want = on and not sl.hybrid and packs_at_hand_over(cfg, sl, scn.src_blocks, scn.num_tokens, pack, 5e9, last)
    assert slots.wants_pack(pack, scn.src_blocks, scn.num_tokens, 5e9) == want


@given(st.integers(0, 8), st.integers(-ALIGN, 10 * ALIGN))
def test_a_region_holds_a_slot_exactly_when_an_empty_region_grants_it(pages: int, size: int) -> None:
    """``holds`` (D's "this push can never be staged here") agrees with what the empty region grants."""
    empty = SlotAllocator(pages * ALIGN)
    assert empty.holds(size) == (empty.alloc(size) is not None)
