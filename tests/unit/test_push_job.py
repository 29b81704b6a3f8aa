"""P's push job (``kvpush.prefill.push_job``): the sans-I/O rules of posting one transfer to one D rank.

The state machine plays the engine thread and the device around a real
``Transfer`` record and ``PushJob``: the forward reports layers under
markers that are reached later, packs and WRITEs end (or fail) whenever the
device or NIXL says so, and a cancel can come at any point. Every action the
job asks for is answered the way the shell would, and the invariants are the
job's promises: nothing is packed or posted after a cancel, a part is posted
only once its KV (and, staged, its pack) is ready, parts tile the regions
once, D is sent its ``Failure`` (``SendFailure``) only when nothing is in flight, every prebuilt WRITE
and the job itself end exactly once, and an undisturbed job writes
everything. A push D gave up on before it ended (D's abort or its rank
forgotten, or P frozen past ``peer_dead_s`` with a part posted) fails,
whatever landed: D no longer counts it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.core.outcome import Cause, Failed, PlanKind, Stage, XferState
from kvpush.core.parts import MIN_PART_BYTES, PartSchedule
from kvpush.core.plan import Plan
from kvpush.core.protocol import Register
from kvpush.prefill.job_plan import JobPlan, Prepacked
from kvpush.prefill.push_actions import QUESTIONS, CheckPack, Done, Notify, Post, ReleaseMade, SendFailure, StartPack
from kvpush.prefill.push_job import PushJob
from kvpush.prefill.transfer import Transfer


@dataclass(eq=False)
class Marker:
    """A device event: the KV of some layers, or a pack."""

    reached: bool = False


@dataclass(eq=False)
class Handle:
    """A NIXL WRITE (prebuilt or built when posted)."""

    r0: int
    r1: int
    state: XferState = XferState.PROC


DEAD_S = 1.0
"""``peer_dead_s``: D gives up a P rank silent this long."""


def _reg() -> Register:
    return Register(transfer_id="t", request_id="d", engine_id="D", rank=0, block_ids=((1,),), num_tokens=16)


def _job(
    kind: PlanKind,
    layers: int,
    per_layer: int,
    parts: int,
    chain: bool,
    min_layers: int,
    lead: int,
    ahead: bool,
    prepacked: Prepacked | None = None,
    rec: Transfer | None = None,
    dead_s: float = float("inf"),
):
    n = layers * per_layer
    rb = 0 if kind is PlanKind.EMPTY else MIN_PART_BYTES  # a staged push of n regions can be cut in n parts
    plan = Plan(kind, n * rb, n, 1, n, np.zeros((0, 3), dtype=np.int64))
    sched = PartSchedule(tuple(range(per_layer, n + 1, per_layer)), rb, min_layers * per_layer * rb, lead)
    jp = JobPlan(plan, sched, parts, chain and kind is PlanKind.STAGED)
    made = {}
    if ahead and kind is PlanKind.STAGED:
        from kvpush.core.parts import split_regions

        made = {(a, b): (Handle(a, b), 1) for a, b in split_regions(0, n, jp.parts(n))}
    rec = Transfer() if rec is None else rec
    job = PushJob(_reg(), jp, rec.times, 0.0, 0.001, slot=0, made=made, prepacked=prepacked, dead_s=dead_s)
    rec.jobs[job.key] = job
    return rec, job, made


class PushJobMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(list(PlanKind)),
        layers=st.integers(1, 6),
        per_layer=st.sampled_from([1, 2]),
        parts=st.integers(1, 4),
        chain=st.booleans(),
        min_layers=st.integers(0, 3),
        lead=st.sampled_from([1, 2, 100]),
        ahead=st.booleans(),
        prepacked=st.booleans(),
    )
    def setup(self, kind, layers, per_layer, parts, chain, min_layers, lead, ahead, prepacked) -> None:
        self.n = layers * per_layer
        self.per_layer = per_layer
        self.reported = 0  # regions reported by the forward
        self.markers: list[tuple[int, Marker]] = []  # (regions, marker) per report
        self.packs: list[tuple[StartPack, Marker]] = []  # packs started, in order
        # Packed at hand-over (``kvpush.prefill.prepack``): a finished prefill, its whole KV reported under one marker
        # that the pack is queued behind (chain) or that was reached before the pack started (not chain).
        self.prepacked = prepacked and kind is PlanKind.STAGED
        rec, pre = None, None
        if self.prepacked:
            rec, kv, pm = Transfer(), Marker(reached=not chain), Marker()
            self.reported = self.n
            self.markers.append((self.n, kv))
            rec.report(self.n, kv, self.n)
            self.packs.append((StartPack(0, self.n, kv if chain else None), pm))
            pre = Prepacked(pm, kv if chain else None)
        self.rec, self.job, made = _job(
            kind, layers, per_layer, parts, chain, min_layers, lead, ahead, pre, rec, dead_s=DEAD_S
        )
        self.kind = kind
        self.made = set(made.values())
        self.released_made: list[Handle] = []
        self.packed: set[tuple[int, int]] = set()  # parts whose pack is done
        self.flying: list[Handle] = []
        self.posted: list[tuple[int, int]] = []
        self.cancelled = False
        self.fail: Failed | None = None
        self.done: Done | None = None
        self.notified = 0
        self.now = 0.0
        self.errors = False  # a pack, post or WRITE failed
        self.discarded = False  # D gave up on the push before it ended
        self.frozen_unposted = False  # P froze before posting: D gave up; the push may fail or land
        self.heard_t = 0.0  # when P last read a word from D
        self._data = None  # the current rule's draws (the shell's random outcomes)

    # -- the shell ----------------------------------------------------------------
    def _reached(self) -> int:
        return max((r for r, m in self.markers if m.reached), default=0)

    def _step(self) -> None:
        rec, job = self.rec, self.job
        job.heard(self.heard_t, self.now)  # the shell looks at D's silence, then reads the side channel
        self.heard_t = self.now
        if not job.plan.chain and not job.stopped:
            while (m := rec.unconfirmed()) is not None and m.marker.reached:
                rec.confirm()
        self.now += 0.001
        self._carry_out(job.ready(*rec.readiness(job.sent, job.plan.chain), self.now))
        self._carry_out(job.check_packs())
        for h in list(job.flying):
            if h.state is not XferState.PROC:
                self.flying.remove(h)
                self._carry_out(job.written(h, h.state, self.now))

    def _carry_out(self, actions: list) -> None:
        """Carry out a list of the job's actions; a question's answer continues it."""
        job = self.job
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            assert not isinstance(a, QUESTIONS) or not todo, f"{a} does not end its list"
            assert self.done is None, f"{a} after Done"
            if isinstance(a, Notify):
                assert not self.posted and not self.cancelled, "heads-up after a post or a cancel"
                assert a.reg is job.reg
                self.notified += 1
            elif isinstance(a, StartPack):
                todo.extend(self._start_pack(a))
            elif isinstance(a, CheckPack):
                todo.extend(self._check_pack(a))
            elif isinstance(a, Post):
                todo.extend(self._post(a))
            elif isinstance(a, ReleaseMade):
                for h in a.handles:
                    assert h not in self.released_made, "a prebuilt WRITE given back twice"
                    self.released_made.append(h)
            elif isinstance(a, SendFailure):
                assert not self.flying and not job.packing, "SendFailure while a part is in flight or packing"
                assert self.fail is None
                self.fail = a.failed
            elif isinstance(a, Done):
                assert not self.flying and not job.packing, "Done while a part is in flight or packing"
                if self.prepacked:  # the job frees the slot: the pack at hand-over must have ended
                    assert self.packs[0][1].reached, "Done while the pack at hand-over may still write the slot"
                assert a.key == job.key and a.slot == job.slot
                self.done = a
                self.rec.end_job(job, a.failed, self.now)

    def _start_pack(self, a: StartPack) -> list:
        assert self.kind is PlanKind.STAGED and not self.cancelled, f"{a} after a cancel"
        assert not self.prepacked, f"{a} in a job packed at hand-over"
        if self.job.plan.chain:
            # Queued behind the KV of its regions on the device.
            assert a.after is None or any(m is a.after and r >= a.r1 for r, m in self.markers), a
            assert self.reported >= a.r1, "a pack of regions not reported"
        else:
            assert self._reached() >= a.r1, "a pack of regions whose KV is not reached"
        if self._fails(10):
            self.errors = True
            return self.job.failed(Failed(Stage.PACK, Cause.POST_ERROR, "pack failed"))
        assert a.offset == self.job.slot + a.r0 * self.job.plan.region_bytes, a
        m = Marker()
        self.packs.append((a, m))
        return self.job.pack_started(m, 0.0)

    def _check_pack(self, a: CheckPack) -> list:
        if a.block and (a.after is None or a.after.reached):
            a.marker.reached = True  # waited for
        if a.marker.reached:
            assert any(m is a.marker for _, m in self.packs), "a check of no pack started"
            head = self.job.packing[0]  # the part whose pack (its own, or the slot's at hand-over) is done
            self.packed.add((head.r0, head.r1))
            return self.job.packed()
        return self.job.pack_pending()

    def _post(self, a: Post) -> list:
        assert not self.cancelled, f"{a} after a cancel"
        if self.kind is PlanKind.STAGED:
            assert (a.r0, a.r1) in self.packed, "posted before its pack was done"
        elif self.kind is PlanKind.DIRECT:
            assert self._reached() >= a.r1, "posted regions whose KV is not reached"
        assert not self.posted or self.posted[-1][1] == a.r0, f"parts out of order: {self.posted} then {a}"
        assert a.r0 == (self.posted[-1][1] if self.posted else 0)
        if a.made is not None:
            assert a.made in self.made and a.made[0] not in self.released_made, "a prebuilt WRITE used twice"
            self.made.discard(a.made)
        if self._fails(20):
            self.errors = True
            return self.job.failed(Failed(Stage.POST, Cause.POST_ERROR, "post failed"))
        self.posted.append((a.r0, a.r1))
        if self.kind is PlanKind.EMPTY:
            return self.job.posted(None, 0, XferState.DONE, self.now, self.now)
        h = a.made[0] if a.made is not None else Handle(a.r0, a.r1)
        state = XferState.PROC if self._data is None or self._data.draw(st.integers(0, 2)) else XferState.DONE
        if state is XferState.PROC:
            self.flying.append(h)
        return self.job.posted(h, 1, state, self.now, self.now)

    def _fails(self, one_in: int) -> bool:
        """Whether the backend or NIXL call fails this time (never in teardown)."""
        return self._data is not None and self._data.draw(st.integers(0, one_in - 1)) == 0

    # -- the world ------------------------------------------------------------------
    @precondition(lambda self: self.reported < self.n)
    @rule(data=st.data(), layers=st.integers(1, 2))
    def forward_reports(self, data, layers: int) -> None:
        """The forward wrote one or more layers (a marker orders them); P hears of it at its next step."""
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

    @precondition(lambda self: any(not m.reached for _, m in self.packs))
    @rule(data=st.data())
    def pack_lands(self, data) -> None:
        self._data = data
        next(m for _, m in self.packs if not m.reached).reached = True
        self._step()

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), ok=st.booleans(), which=st.integers(0, 3))
    def write_ends(self, data, ok: bool, which: int) -> None:
        self._data = data
        h = self.flying[which % len(self.flying)]
        h.state = XferState.DONE if ok or data.draw(st.integers(0, 4)) else XferState.ERR
        self.errors |= h.state is XferState.ERR
        self._step()

    @precondition(lambda self: not self.cancelled and self.done is None)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        self._data = data
        self.cancelled = True
        self.job.cancel(Cause.ABORTED, "client went away")
        self._step()

    @precondition(lambda self: self.done is None)
    @rule(data=st.data())
    def d_gives_up(self, data) -> None:
        """D aborts the transfer, or P forgets D's rank (declared dead, or it said hello again)."""
        self._data = data
        self.cancelled = self.discarded = True
        self.job.cancel(Cause.DEAD_PEER, "D gave up", discard=True)
        self._step()

    @rule(data=st.data())
    def p_frozen(self, data) -> None:
        """P's thread stops for twice ``peer_dead_s`` (SIGSTOP, a VM pause): D hears nothing and gives it up, so
        a push with a part posted does not count; one with nothing posted yet hears D's abort if D sent one."""
        self._data = data
        self.now += 2 * DEAD_S
        if self.job.nposted and self.done is None:
            self.discarded = True
        elif self.done is None:
            # Nothing posted yet: D gave up all the same; P learns it by D's abort (not modelled here) or by
            # the silence its next post sees, so the push may fail (the pessimistic side) or, heard again, land.
            self.frozen_unposted = True
        self._step()

    @rule(data=st.data())
    def idle_step(self, data) -> None:
        self._data = data
        self._step()

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def parts_tile_what_was_posted(self) -> None:
        covered = [r for a, b in self.posted for r in range(a, b)]
        assert covered == list(range(len(covered))), self.posted
        assert self.job.nposted == (len(covered) if self.kind is not PlanKind.EMPTY else self.job.nposted)

    @invariant()
    def heads_up_once(self) -> None:
        assert self.notified <= 1

    def teardown(self) -> None:
        """Let everything happen: the job ends once, every prebuilt WRITE ends once, an undisturbed job
        wrote every region without telling D it failed, and one D gave up on failed."""
        if not hasattr(self, "job"):
            return
        self._data = None
        while self.reported < self.n:
            self.reported = self.n
            m = Marker()
            self.markers.append((self.n, m))
            self.rec.report(self.n, m, self.n)
        for _ in range(4 * self.n + 8):
            for _, m in self.markers + [(0, m) for _, m in self.packs]:
                m.reached = True
            for h in self.flying:
                h.state = XferState.DONE
            self._step()
            if self.done is not None:
                break
        assert self.done is not None, "the job never ended"
        assert not self.made or all(h in self.released_made for h, _ in self.made), "a prebuilt WRITE leaked"
        if self.discarded:
            assert self.done.failed is not None and self.fail is not None, f"D gave up, P counted it: {self.done}"
        if not self.cancelled and not self.errors and not self.discarded and not self.frozen_unposted:
            assert self.done.failed is None and self.fail is None, self.done
            covered = [r for a, b in self.posted for r in range(a, b)]
            assert covered == list(range(self.n)), self.posted
        else:
            assert (self.fail is not None) == (self.done.failed is not None)
        assert not self.rec.jobs, "the record still holds the job"


PushJobMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_push_job_state_machine = PushJobMachine.TestCase


# -- examples ----------------------------------------------------------------------------------


def _drain(job: PushJob, actions: list) -> list[object]:
    """Carry out an event's actions as the shell would, answers included; every action in order."""
    out, todo = [], deque(actions)
    while todo:
        a = todo.popleft()
        out.append(a)
        if isinstance(a, StartPack):
            todo.extend(job.pack_started(Marker(), 0.0))
        elif isinstance(a, CheckPack):
            todo.extend(job.packed() if a.marker.reached else job.pack_pending())
        elif isinstance(a, Post):
            todo.extend(job.posted(Handle(a.r0, a.r1), 1, XferState.PROC, 0.0, 0.0))
    return out


def _step(job: PushJob, ready: int, now: float) -> list[object]:
    """The shell's step: readiness, then the packs that may be done."""
    return _drain(job, job.ready(ready, None, None, now)) + _drain(job, job.check_packs())


def test_one_pack_ahead_of_the_post() -> None:
    """A staged push cut into parts launches part k+1's pack before it asks about part k's: the first WRITE
    waits for one pack, not for all of them."""
    _, job, _ = _job(PlanKind.STAGED, 4, 1, 4, False, 0, 100, False)
    kinds = [type(a).__name__ for a in _step(job, 4, 1.0)]
    assert kinds[:4] == ["StartPack", "Notify", "StartPack", "CheckPack"], kinds


def test_cancel_stops_packs_and_posts_but_waits_for_what_flies() -> None:
    _, job, _ = _job(PlanKind.DIRECT, 4, 1, 1, False, 0, 1, False)
    acts = _drain(job, job.ready(3, None, None, 1.0))  # three layers, one left: posted at once
    [post] = [a for a in acts if isinstance(a, Post)]
    assert (post.r0, post.r1) == (0, 3)
    job.cancel(Cause.ABORTED, "client went away")
    assert _drain(job, job.ready(4, None, None, 2.0)) == [], "posted after the cancel, or ended with a WRITE in flight"
    (h,) = job.flying
    fail, done = job.written(h, XferState.DONE, 3.0)  # and nothing after them
    assert isinstance(fail, SendFailure) and fail.failed.cause is Cause.ABORTED
    assert isinstance(done, Done) and done.failed == fail.failed and _drain(job, job.check_packs()) == []


def test_a_failed_write_fails_the_job_with_its_stage_and_cause() -> None:
    _, job, _ = _job(PlanKind.DIRECT, 2, 1, 1, False, 0, 1, False)
    _drain(job, job.ready(2, None, None, 1.0))
    (h,) = job.flying
    fail = job.written(h, XferState.ERR, 2.0)[0]
    assert isinstance(fail, SendFailure) and (fail.failed.stage, fail.failed.cause) == (Stage.WRITE, Cause.WRITE_ERROR)
    assert "WRITE to D D rank 0 failed" in fail.failed.reason


def test_prebuilt_writes_are_posted_or_given_back() -> None:
    _, job, made = _job(PlanKind.STAGED, 4, 1, 2, True, 0, 100, True)
    assert len(made) == 2
    job.peer_gone("D D rank 0 said hello again")
    a, fail, done = job.ready(0, None, None, 1.0)  # the shell drives the job right after
    assert isinstance(a, ReleaseMade) and set(a.handles) == {h for h, _ in made.values()}
    assert isinstance(fail, SendFailure) and isinstance(done, Done)


def test_every_wake_up_report_starts_a_part() -> None:
    """``wake_at`` is the report that can start the next part: one region short of it, nothing is posted."""
    for lead, min_layers in itertools.product((1, 2, 100), (0, 2)):
        _, job, _ = _job(PlanKind.DIRECT, 6, 2, 1, False, min_layers, lead, False)
        at = job.wake_at()
        acts = _drain(job, job.ready(at - 2, None, None, 1.0))  # the layer before
        assert not [a for a in acts if isinstance(a, Post)], (lead, min_layers)
        acts = _drain(job, job.ready(at, None, None, 1.0))
        assert [a for a in acts if isinstance(a, Post)], (lead, min_layers)


def _prepacked(parts: int, marker: Marker) -> tuple[Transfer, PushJob]:
    rec = Transfer()
    rec.report(4, None, 4)
    rec, job, _ = _job(PlanKind.STAGED, 4, 1, parts, False, 0, 100, False, Prepacked(marker, None), rec)
    return rec, job


def test_packed_at_hand_over_posts_every_part_without_packing() -> None:
    """The slot was packed at hand-over: the job tells D, waits for that pack once, and posts its parts,
    1 or 4, tiling the regions, with no pack of its own."""
    for parts, want in ((1, [(0, 4)]), (4, [(0, 1), (1, 2), (2, 3), (3, 4)])):
        _, job = _prepacked(parts, Marker(reached=True))
        acts = _step(job, 4, 1.0)
        assert not any(isinstance(a, StartPack) for a in acts), acts
        assert isinstance(acts[0], Notify) and isinstance(acts[1], CheckPack) and acts[1].block, acts
        assert [(a.r0, a.r1) for a in acts if isinstance(a, Post)] == want, acts
        assert job.stats.pack_s == 0.0


def test_packed_at_hand_over_waits_for_its_pack_even_when_cancelled() -> None:
    """A push cancelled before its packed slot's pack ended does not end (and free the slot) until that pack
    is over: the device writes the slot until then."""
    pm = Marker()
    _, job = _prepacked(2, pm)
    job.cancel(Cause.ABORTED, "client went away")
    acts = _step(job, 4, 1.0)
    assert not any(isinstance(a, Done | Post) for a in acts), acts
    pm.reached = True
    acts = _drain(job, job.check_packs())
    assert not any(isinstance(a, Post) for a in acts) and isinstance(acts[-1], Done), acts


def test_a_push_d_gave_up_while_its_write_flew_fails() -> None:
    """Every part posted, then D aborts (or P forgets D's rank): what lands is not counted, so the push fails."""
    _, job, _ = _job(PlanKind.DIRECT, 2, 1, 1, False, 0, 1, False)
    _drain(job, job.ready(2, None, None, 0.1))
    (h,) = job.flying
    job.cancel(Cause.ABORTED, "aborted by D: client went away", discard=True)
    fail, done = job.written(h, XferState.DONE, 0.2)
    assert isinstance(fail, SendFailure) and isinstance(done, Done) and done.failed == fail.failed
    assert done.failed.stage is Stage.WRITE and "does not count" in done.failed.reason


def test_a_push_p_made_while_frozen_past_peer_dead_fails() -> None:
    """P posts, is frozen for longer than ``peer_dead_s``, resumes and its WRITE ends: D has given P up."""
    _, job, _ = _job(PlanKind.DIRECT, 2, 1, 1, False, 0, 1, False, dead_s=DEAD_S)
    job.heard(0.0, 0.0)
    _drain(job, job.ready(2, None, None, 0.1))
    (h,) = job.flying
    job.heard(0.1, 0.1 + 3 * DEAD_S)  # looked at before reading the side channel: D's last word is old
    job.heard(0.1 + 3 * DEAD_S, 0.1 + 3 * DEAD_S)  # a word D sent before giving up, read only now
    fail, done = job.written(h, XferState.DONE, 0.2 + 3 * DEAD_S)
    assert isinstance(fail, SendFailure) and isinstance(done, Done)
    assert done.failed.cause is Cause.DEAD_PEER and "silent for" in done.failed.reason


def test_p_aborting_its_own_posted_push_still_counts() -> None:
    """P's own abort once every part is posted does not fail it: D knows nothing of it and counts what lands."""
    _, job, _ = _job(PlanKind.DIRECT, 2, 1, 1, False, 0, 1, False)
    _drain(job, job.ready(2, None, None, 0.1))
    (h,) = job.flying
    job.cancel(Cause.ABORTED, "request aborted on P")
    (done,) = job.written(h, XferState.DONE, 0.2)
    assert isinstance(done, Done) and done.failed is None


def test_a_forgotten_d_rank_gets_its_prebuilt_writes_back_before_what_flies_ends() -> None:
    """``peer_gone`` gives back the WRITEs built ahead and not posted at the job's next event, while a part is
    still in flight: the peer table unloads D's agent next, and those handles name it."""
    _, job, made = _job(PlanKind.STAGED, 4, 1, 2, True, 0, 100, True)
    _step(job, 4, 1.0)
    job.packing[0].marker.reached = True
    acts = _drain(job, job.check_packs())
    assert [(a.r0, a.r1) for a in acts if isinstance(a, Post)] == [(0, 2)] and len(job.flying) == 1
    job.peer_gone("D D rank 0 said hello again")
    acts = _drain(job, job.ready(4, None, None, 2.0))
    assert isinstance(acts[0], ReleaseMade) and acts[0].handles == (made[(2, 4)][0],), acts
    assert not any(isinstance(a, Post | Done) for a in acts), acts


def test_a_fault_stops_the_job_and_fails_it_once_nothing_flies() -> None:
    """An error outside the job's questions (``fault``): nothing more is posted, what flies still ends, then
    D is sent its ``Failure`` and the job is ``Done`` with that failure."""
    _, job, _ = _job(PlanKind.DIRECT, 4, 1, 1, False, 0, 1, False)
    acts = _drain(job, job.ready(3, None, None, 1.0))  # three layers, one left: posted at once
    assert [(a.r0, a.r1) for a in acts if isinstance(a, Post)] == [(0, 3)]
    job.fault(Failed(Stage.POST, Cause.OTHER, "push failed: boom"))
    assert _drain(job, job.ready(4, None, None, 2.0)) == [], "posted after a fault, or ended with a WRITE in flight"
    (h,) = job.flying
    fail, done = job.written(h, XferState.DONE, 3.0)
    assert isinstance(fail, SendFailure) and fail.failed.reason == "push failed: boom" and fail.reg is job.reg
    assert isinstance(done, Done) and done.failed == fail.failed and done.slot == job.slot
