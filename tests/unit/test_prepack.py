"""P's pack at hand-over without NIXL: the slots' ledger (``kvpush.prefill.prepack``) and the rule that allows the pack.

The ledger is driven against a real ``SlotAllocator`` (it raises on a double
free) by a state machine that plays the shell: prefills handed over (packed
synchronously or on the device), packs ending, pushes claiming a packed slot
or planning without it, registered pushes taking parked slots back, every end
of a parked prefill, and shutdown. Invariants: every allocated slot is held,
set aside, a job's or a registered push's (no leak, no double free), no two
slots share a byte, and once all are freed the whole region is one free slot
again; no slot is freed while a pack may still write it; parked slots keep to
the share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import pytest
from helpers_layout import Scenario, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.config import Config
from kvpush.core.layout import heads_overlap
from kvpush.core.outcome import PlanKind
from kvpush.core.payload import pack_pieces
from kvpush.core.plan import build_plan
from kvpush.core.staging import ALIGN, FreeSlot, SlotAllocator
from kvpush.prefill.prepack import Prepack, Prepacks, packs_at_hand_over, staged_on_p_alone


@dataclass(eq=False)
class Marker:
    reached: bool = False


def _reached(m: Marker | None) -> bool:
    return m is None or m.reached


class PrepackMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 16), share=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    def setup(self, capacity: int, share: float) -> None:
        self.slots = SlotAllocator(capacity * ALIGN)
        self.ledger = Prepacks(capacity * ALIGN, share)
        self.sizes: dict[int, int] = {}  # every allocated slot's size
        self.jobs: dict[str, tuple[int, Marker | None]] = {}  # claimed slots, freed at the job's Done
        self.pushes: list[int] = []  # slots of registered pushes that packed themselves
        self.lists: dict[str, np.ndarray] = {}
        self.next = 0
        self.writer: dict[int, Marker | None] = {}  # the pack at hand-over writing each parked slot

    # -- the shell ----------------------------------------------------------------
    def _free(self, frees: list[FreeSlot]) -> None:
        for f in frees:
            writing = [p.marker for _, p in self.ledger.held() if p.slot == f.offset] + [
                m for s, m in self.jobs.values() if s == f.offset
            ]
            assert not writing, "a slot freed while the ledger or a job still has it"
            assert _reached(self.writer.pop(f.offset, None)), "a slot freed while its pack may still write it"
            self.slots.free(f.offset)
            self.sizes.pop(f.offset)

    def _alloc(self, size: int) -> int | None:
        slot = self.slots.alloc(size)
        if slot is not None:
            self.sizes[slot] = size
        return slot

    # -- the world ------------------------------------------------------------------
    @rule(blocks=st.integers(1, 8), on_device=st.booleans())
    def hand_over(self, blocks: int, on_device: bool) -> None:
        """A finished prefill: packed into a slot when the ledger admits one and the allocator has it."""
        tid = f"t{self.next}"
        self.next += 1
        size = blocks * ALIGN
        if not self.ledger.admits(size) or (slot := self._alloc(size)) is None:
            return
        pack = np.zeros((blocks, 2), dtype=np.int64)
        self.lists[tid] = pack
        self.writer[slot] = Marker() if on_device else None
        self._free(self.ledger.hold(tid, Prepack(slot, size, pack, None, self.writer[slot])))

    @precondition(lambda self: self.ledger.markers())
    @rule(i=st.integers(0, 7))
    def pack_ends(self, i: int) -> None:
        markers = self.ledger.markers()
        markers[i % len(markers)].reached = True

    @rule()
    def engine_step(self) -> None:
        """The engine polls the packs' markers: ended ones are noted, set-aside slots freed."""
        self._free(self.ledger.reached(_reached))
        for tid, (slot, m) in list(self.jobs.items()):
            if _reached(m):  # the job's check saw its pack end: it posts, completes, frees the slot (Done)
                del self.jobs[tid]
                self.writer.pop(slot, None)
                self.slots.free(slot)
                self.sizes.pop(slot)

    @precondition(lambda self: len(self.ledger))
    @rule(i=st.integers(0, 7), same_list=st.booleans())
    def pairing(self, i: int, same_list: bool) -> None:
        """D registered: the plan takes the packed slot (same list) or not (then the slot is dropped)."""
        tid = self.ledger.held()[i % len(self.ledger)][0]
        p = self.ledger.get(tid)
        assert p is not None
        took = self.ledger.claim(tid, p.pack if same_list else p.pack.copy())
        if same_list:
            assert took is p and self.ledger.get(tid) is None
            self.jobs[tid] = (p.slot, None if p.reached else p.marker)
        else:
            assert took is None and self.ledger.get(tid) is p
            self._free(self.ledger.drop(tid))

    @precondition(lambda self: len(self.ledger))
    @rule(i=st.integers(0, 7))
    def prefill_ends(self, i: int) -> None:
        """Lease expiry, abort, D dead, a re-issue: the parked prefill's slot is dropped."""
        tid = self.ledger.held()[i % len(self.ledger)][0]
        self._free(self.ledger.drop(tid))

    @rule(blocks=st.integers(1, 16))
    def registered_push(self, blocks: int) -> None:
        """A push whose D registered needs a slot: parked slots whose pack ended are taken back, oldest first."""
        size = blocks * ALIGN
        while (slot := self._alloc(size)) is None and size <= self.slots.capacity:
            victim = self.ledger.evictable()
            if victim is None:
                break
            p = self.ledger.get(victim)
            assert p is not None and p.reached, "a parked slot taken back while its pack may still run"
            assert victim == next(t for t, q in self.ledger.held() if q.reached), "not the oldest ended one"
            self._free(self.ledger.drop(victim))
        if slot is not None:
            self.pushes.append(slot)
        elif size <= self.slots.capacity:
            # Nothing parked could be taken back: only packs still running or other pushes' slots are in the way.
            assert self.ledger.evictable() is None

    @precondition(lambda self: self.pushes)
    @rule()
    def registered_push_done(self) -> None:
        slot = self.pushes.pop(0)
        self.slots.free(slot)
        self.sizes.pop(slot)

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def every_slot_accounted_for(self) -> None:
        held = [p.slot for _, p in self.ledger.held()]
        owned = held + [s for s, _ in self.jobs.values()] + self.pushes
        assert len(owned) == len(set(owned)), "a slot owned twice"
        assert self.ledger.draining + len(owned) == self.slots.slots_in_use, "a slot leaked"
        spans = sorted((s, s + -(-n // ALIGN) * ALIGN) for s, n in self.sizes.items())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "two slots share bytes"
        assert not spans or spans[-1][1] <= self.slots.capacity

    @invariant()
    def parked_slots_keep_to_the_share(self) -> None:
        assert len(self.ledger) <= 1 or self.ledger.held_bytes <= self.ledger.limit

    def teardown(self) -> None:
        """Shutdown: the shell waits for every pack, then every parked slot comes back."""
        if not hasattr(self, "ledger"):
            return
        for m in self.ledger.markers():
            m.reached = True
        self._free(self.ledger.drop_all())
        assert len(self.ledger) == 0 and self.ledger.draining == 0 and self.ledger.held_bytes == 0
        assert self.slots.slots_in_use == len(self.jobs) + len(self.pushes)
        for slot in [s for s, _ in self.jobs.values()] + self.pushes:
            self.slots.free(slot)
        assert self.slots.alloc(self.slots.capacity) == 0, "bytes of a freed slot never came back"


PrepackMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_prepack_ledger_state_machine = PrepackMachine.TestCase


def test_a_slot_whose_pack_may_run_is_set_aside_until_it_ends() -> None:
    slots = SlotAllocator(4 * ALIGN)
    ledger = Prepacks(slots.capacity)
    m = Marker()
    slot = slots.alloc(ALIGN)
    assert slot is not None
    ledger.hold("t", Prepack(slot, ALIGN, np.zeros((1, 2)), None, m))
    assert ledger.drop("t") == [] and ledger.draining == 1 and ledger.markers() == [m]
    assert ledger.reached(_reached) == []
    m.reached = True
    assert ledger.reached(_reached) == [FreeSlot(slot)] and ledger.draining == 0


def test_the_share_admits_one_slot_of_any_size_and_more_only_within_it() -> None:
    ledger = Prepacks(8 * ALIGN, 0.5)
    assert ledger.admits(8 * ALIGN)  # the only parked slot: a staging region sized for one request serves
    ledger.hold("big", Prepack(0, 8 * ALIGN, np.zeros((1, 2)), None, None))
    assert not ledger.admits(ALIGN)
    ledger.drop("big")
    ledger.hold("a", Prepack(0, 2 * ALIGN, np.zeros((1, 2)), None, None))
    assert ledger.admits(2 * ALIGN) and not ledger.admits(3 * ALIGN) and not ledger.admits(0)
    with pytest.raises(ValueError, match="share"):
        Prepacks(ALIGN, 1.5)


def test_a_re_issued_prefill_replaces_its_slot() -> None:
    ledger = Prepacks(8 * ALIGN)
    ledger.hold("t", Prepack(0, ALIGN, np.zeros((1, 2)), None, None))
    assert ledger.hold("t", Prepack(ALIGN, ALIGN, np.zeros((1, 2)), None, None)) == [FreeSlot(0)]
    assert len(ledger) == 1


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.floats(1e-7, 1e-4), st.floats(1e8, 1e11), st.sampled_from([1e8, 5e9, 1e12]))
def test_packing_at_hand_over_agrees_with_the_plan_at_pairing(scn: Scenario, desc_s, link, pack_bw) -> None:
    """When P's side alone says staging wins, the plan made at pairing, for whatever D, is staged and takes
    that very pack list (so the pack done at hand-over is the one posted); a forced plan agrees too."""
    scn = replace(scn, start_token=0)  # the list at hand-over is built for the whole prompt
    sl, dl = scn.src.layout, scn.dst.layout
    pack = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, 0)
    kw = {"staging_local": (1 << 20, 0), "staging_remote": (1 << 30, 1 << 40, 1), "pack_bw": pack_bw}
    for mode in ("auto", "staged", "direct"):
        cfg = Config.of(plan=mode, descriptor_cost_us=desc_s * 1e6, link_gbps=link / 1e9)
        if not staged_on_p_alone(cfg, sl, scn.src_blocks, scn.num_tokens, pack, pack_bw):
            assert mode != "staged" or pack.shape[0] == 0
            continue
        assert mode != "direct"
        plan = build_plan(cfg, *scn.call_args(), **kw, pack=pack)
        assert plan.kind == "staged" and plan.pack is pack, plan.kind


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.sampled_from([None, PlanKind.STAGED, PlanKind.DIRECT]))
def test_packing_at_hand_over_follows_the_last_staging_plan_under_auto(scn: Scenario, last) -> None:
    """With ``plan=auto`` a parked prefill is also packed when the last plan made with staging on both
    sides was staged (P's runs bound the direct plan only from below); never under ``plan=direct``, always
    under ``plan=staged``, and a direct or no last plan adds nothing to P's own bound."""
    scn = replace(scn, start_token=0)
    sl, dl = scn.src.layout, scn.dst.layout
    pack = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, 0)
    args = (sl, scn.src_blocks, scn.num_tokens, pack, 5e9)
    for mode in ("auto", "staged", "direct"):
        cfg = Config.of(plan=mode)
        alone = staged_on_p_alone(cfg, *args)
        got = packs_at_hand_over(cfg, *args, last)
        if mode == "auto" and last is PlanKind.STAGED and pack.shape[0] > 0:
            assert got
        else:
            assert got == alone, (mode, last, got, alone)
