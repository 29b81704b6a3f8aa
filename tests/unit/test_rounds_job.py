"""P's push in rounds (``kvpush.prefill.rounds_job``): the sans-I/O rules of writing through a ring of slots.

The state machine plays the engine thread, the device, NIXL and D around a real ``RoundsJob``: the forward
reports layers under markers reached later, packs and WRITEs end (or fail) whenever the device or NIXL
says so, D unpacks the parts that landed and its credits arrive late, repeated, out of date or not at all
for a while, and a cancel or D giving up can come at any point. Every action is answered as the shell
would, and the ring's promises are checked against a model of both rings:

* a part is packed only into a P slot no earlier part still uses (its pack, its WRITE in flight), and only
  once its regions' KV is ready;
* a part is written only into a D slot D has emptied: the part there before was unpacked and credited;
* parts are posted in order, each once, at their slots' addresses, each no larger than a slot;
* nothing is packed or posted after a cancel, ``SendFailure`` goes only when nothing is in flight or
  packing, ``Done`` comes once and last; an undisturbed push writes every part.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.core.outcome import Cause, Failed, PlanKind, Stage, XferState
from kvpush.core.parts import PartSchedule
from kvpush.core.plan import Plan
from kvpush.core.protocol import Register, StagingGrant
from kvpush.core.rounds import make_ring
from kvpush.prefill.job_plan import JobPlan
from kvpush.prefill.push_actions import QUESTIONS, CheckPack, Done, Notify, Post, SendFailure, StartPack
from kvpush.prefill.rounds_job import RoundsJob
from kvpush.prefill.transfer import Transfer

P_SLOT, D_SLOT = 1 << 20, 3 << 20  # the rings' starts in P's and D's regions


@dataclass(eq=False)
class Marker:
    reached: bool = False


@dataclass(eq=False)
class Handle:
    part: int
    state: XferState = XferState.PROC


class RoundsJobMachine(RuleBasedStateMachine):
    @initialize(
        layers=st.integers(1, 6),
        per_layer=st.sampled_from([1, 2]),
        region_bytes=st.sampled_from([512, 1024, 1536, 4096]),
        part_bytes=st.sampled_from([1024, 2048, 4096]),
        d_slots=st.integers(1, 4),
        p_slots=st.integers(1, 4),
        chain=st.booleans(),
        lead=st.sampled_from([1, 2, 100]),
    )
    def setup(self, layers, per_layer, region_bytes, part_bytes, d_slots, p_slots, chain, lead) -> None:
        self.n = layers * per_layer
        self.per_layer = per_layer
        ring = make_ring(self.n, region_bytes, part_bytes, d_slots, p_slots)
        self.ring = ring
        plan = Plan(PlanKind.ROUNDS, self.n * region_bytes, self.n, 1, self.n, np.zeros((0, 3), np.int64), ring=ring)
        sched = PartSchedule(tuple(range(per_layer, self.n + 1, per_layer)), region_bytes, 0, lead)
        grant = StagingGrant(D_SLOT, d_slots * part_bytes, part_bytes, d_slots)
        reg = Register(
            transfer_id="t", request_id="d", engine_id="D", rank=0, block_ids=((1,),), num_tokens=16, staging=grant
        )
        self.rec = Transfer()
        self.job = RoundsJob(reg, JobPlan(plan, sched, chain=chain), self.rec.times, 0.0, 0.0, P_SLOT, dead_s=1.0)
        self.rec.jobs[self.job.key] = self.job
        self.chain = chain
        self.reported = 0
        self.markers: list[tuple[int, Marker]] = []
        self.packs: dict[int, Marker] = {}  # part -> its pack's marker
        self.p_ring: dict[int, int] = {}  # P slot -> the part using it (packing, packed or in flight)
        self.d_ring: dict[int, int] = {}  # D slot -> the part in it, until D unpacked it
        self.landed: deque[int] = deque()  # parts in D's ring, not unpacked yet, in landing order
        self.unpacked: set[int] = set()
        self.credit = 0  # the prefix D credited (latest sent)
        self.flying: list[Handle] = []
        self.posted: list[int] = []
        self.packed: set[int] = set()
        self.stopped = False
        self.discarded = False
        self.errors = False
        self.fail: Failed | None = None
        self.done: Done | None = None
        self.now = 0.0
        self._data = None

    # -- the shell ----------------------------------------------------------------
    def _reached(self) -> int:
        return max((r for r, m in self.markers if m.reached), default=0)

    def _step(self) -> None:
        rec, job = self.rec, self.job
        if not job.plan.chain and not job.stopped:
            while (m := rec.unconfirmed()) is not None and m.marker.reached:
                rec.confirm()
        self.now += 0.001
        self._carry_out(job.ready(*rec.readiness(job.sent, job.plan.chain), self.now))
        self._carry_out(job.check_packs())
        for h in list(job.flying):
            if h.state is not XferState.PROC:
                self.flying.remove(h)
                self._ended(h)
                self._carry_out(job.written(h, h.state, self.now))

    def _ended(self, h: Handle) -> None:
        """A WRITE is over: its P slot is free; done, its part landed in D's slot."""
        self.p_ring.pop(h.part % self.ring.p_slots, None)
        if h.state is XferState.DONE:
            self.landed.append(h.part)

    def _carry_out(self, actions: list) -> None:
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            assert not isinstance(a, QUESTIONS) or not todo, f"{a} does not end its list"
            assert self.done is None, f"{a} after Done"
            if isinstance(a, Notify):
                assert not self.posted and not self.stopped
            elif isinstance(a, StartPack):
                todo.extend(self._start_pack(a))
            elif isinstance(a, CheckPack):
                todo.extend(self._check_pack(a))
            elif isinstance(a, Post):
                todo.extend(self._post(a))
            elif isinstance(a, SendFailure):
                assert not self.flying and not self.job.packing, "SendFailure while a part is in flight or packing"
                self.fail = a.failed
            elif isinstance(a, Done):
                assert not self.flying and not self.job.packing, "Done while a part is in flight or packing"
                assert a.slot == P_SLOT and a.key == self.job.key
                self.done = a
                self.rec.end_job(self.job, a.failed, self.now)

    def _start_pack(self, a: StartPack) -> list:
        j = a.part
        ring = self.ring
        assert not self.stopped, f"{a} after a cancel"
        assert j == len(self.packs), f"part {j} packed out of order"
        tile = ring.tiles[j]
        assert (a.r0, a.r1) == (tile.r0, tile.r1) and a.offset == P_SLOT + ring.p_offset(j), a
        assert j % ring.p_slots not in self.p_ring, f"part {j} packed into a P slot part {self.p_ring} still uses"
        if self.chain:
            assert self.reported >= a.r1, "a pack of regions not reported"
        else:
            assert self._reached() >= a.r1, "a pack of regions whose KV is not reached"
        if self._fails(12):
            self.errors = True
            return self.job.failed(Failed(Stage.PACK, Cause.POST_ERROR, "pack failed"))
        self.p_ring[j % ring.p_slots] = j
        m = self.packs[j] = Marker()
        return self.job.pack_started(m, 0.0)

    def _check_pack(self, a: CheckPack) -> list:
        if a.block and (a.after is None or a.after.reached):
            a.marker.reached = True
        if a.marker.reached:
            j = next(k for k, m in self.packs.items() if m is a.marker)
            self.packed.add(j)
            if self.stopped or self.job.stopped:
                self.p_ring.pop(j % self.ring.p_slots, None)  # never posted: its slot is done with
            return self.job.packed()
        return self.job.pack_pending()

    def _post(self, a: Post) -> list:
        j, ring = a.part, self.ring
        assert not self.stopped, f"{a} after a cancel"
        assert j in self.packed, "posted before its pack ended"
        assert j == len(self.posted), f"parts out of order: {self.posted} then {j}"
        tile = ring.tiles[j]
        assert a.nbytes == tile.nbytes <= ring.part_bytes
        assert a.at == (P_SLOT + ring.p_offset(j), D_SLOT + ring.d_offset(j)), a
        s = j % ring.d_slots
        assert s not in self.d_ring, f"part {j} written into D's slot {s}, which still holds part {self.d_ring[s]}"
        assert j - ring.d_slots < self.credit or j < ring.d_slots, "a D slot written before its credit arrived"
        if self._fails(20):
            self.errors = True
            self.p_ring.pop(j % ring.p_slots, None)
            return self.job.failed(Failed(Stage.POST, Cause.POST_ERROR, "post failed"))
        self.posted.append(j)
        self.d_ring[s] = j
        h = Handle(j)
        state = XferState.PROC if self._data is None or self._data.draw(st.integers(0, 2)) else XferState.DONE
        if state is XferState.PROC:
            self.flying.append(h)
        else:
            h.state = XferState.DONE
            self._ended(h)
        return self.job.posted(h, 1, state, self.now, self.now)

    def _fails(self, one_in: int) -> bool:
        return self._data is not None and self._data.draw(st.integers(0, one_in - 1)) == 0

    # -- the world ------------------------------------------------------------------
    @precondition(lambda self: self.reported < self.n)
    @rule(data=st.data(), layers=st.integers(1, 2))
    def forward_reports(self, data, layers: int) -> None:
        self._data = data
        self.reported = min(self.n, self.reported + layers * self.per_layer)
        m = Marker()
        self.markers.append((self.reported, m))
        self.rec.report(self.reported, m, self.n)
        self._step()

    @precondition(lambda self: any(not m.reached for _, m in self.markers))
    @rule(data=st.data())
    def kv_reached(self, data) -> None:
        self._data = data
        next(m for _, m in self.markers if not m.reached).reached = True
        self._step()

    @precondition(lambda self: any(not m.reached for m in self.packs.values()))
    @rule(data=st.data())
    def pack_lands(self, data) -> None:
        self._data = data
        next(m for m in self.packs.values() if not m.reached).reached = True
        self._step()

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), ok=st.booleans(), which=st.integers(0, 3))
    def write_ends(self, data, ok: bool, which: int) -> None:
        self._data = data
        h = self.flying[which % len(self.flying)]
        h.state = XferState.DONE if ok or data.draw(st.integers(0, 4)) else XferState.ERR
        self.errors |= h.state is XferState.ERR
        self._step()

    @precondition(lambda self: self.landed)
    @rule(which=st.integers(0, 3))
    def d_unpacks(self, which: int) -> None:
        """D unpacks a part that landed (in any order); its slot is empty again, and the credit D sends is the
        prefix of parts unpacked (it may reach P later: ``credit_arrives``)."""
        j = self.landed[which % len(self.landed)]
        self.landed.remove(j)
        self.unpacked.add(j)
        self.d_ring.pop(j % self.ring.d_slots, None)
        while self.credit in self.unpacked:
            self.credit += 1

    @rule(data=st.data(), stale=st.integers(0, 3))
    def credit_arrives(self, data, stale: int) -> None:
        """A credit reaches P: the latest D sent, or an older one (reordered, repeated)."""
        self._data = data
        self._carry_out(self.job.credit(max(0, self.credit - stale)))
        self._step()

    @precondition(lambda self: not self.stopped and self.done is None)
    @rule(data=st.data(), discard=st.booleans())
    def cancel(self, data, discard: bool) -> None:
        """An abort on P, or D gave up (its abort, its rank forgotten)."""
        self._data = data
        self.stopped = True
        self.discarded |= discard
        self.job.cancel(Cause.DEAD_PEER if discard else Cause.ABORTED, "gone", discard=discard)
        self._step()

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def slots_never_shared(self) -> None:
        assert len(self.job.packing) + len(self.job.waiting_post) + len(self.job.flying) <= self.ring.p_slots

    def teardown(self) -> None:
        """Everything the world still owes happens (KV, packs, WRITEs, D's unpacks and credits): the job ends,
        once; an undisturbed push wrote every part."""
        self._data = None
        for _ in range(4 * (self.ring.parts + self.n) + 20):
            if self.done is not None:
                break
            self.reported = self.n
            m = Marker(reached=True)
            self.markers.append((self.n, m))
            self.rec.report(self.n, m, self.n)
            for _, mk in self.markers:
                mk.reached = True
            for mk in self.packs.values():
                mk.reached = True
            for h in self.flying:
                h.state = XferState.DONE
            self._step()
            while self.landed:
                self.d_unpacks(0)
            self._carry_out(self.job.credit(self.credit))
            self._step()
        assert self.done is not None, "the job never ended"
        if not (self.stopped or self.errors):
            assert self.posted == list(range(self.ring.parts)), self.posted
            assert self.done.failed is None and self.fail is None, self.done
        if self.discarded:
            assert self.done.failed is not None, "a push D gave up on reported success"


TestRoundsJob = RoundsJobMachine.TestCase
TestRoundsJob.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
