"""P's part scheduler (``kvpush.prefill.push_job``): a staged push cut into overlapping parts, over every interleaving.

A staged push of ``n`` regions cut into ``N`` parts packs part k+1 while
part k is on the wire. The state machine drives a real ``PushJob`` (cut
exactly ``N`` ways: ``min_part_bytes=0``, no cost model) through random but
legal answers of its shell: packs that land late, at once or out of order
(the device reports each on its own marker), WRITEs that end in any order,
fail or end at once within their post, and a cancel, a fault or D giving
up at any point. Its promises, checked on every action:

* a part is posted only after its own pack was started and a ``CheckPack``
  of that pack was answered ``packed`` (never before its bytes are in the
  slot);
* parts are posted in order and tile ``[0, n)`` with no overlap and no gap,
  each region in exactly one part, cut as ``split_regions`` says; an
  undisturbed push posts every region;
* the next part's pack is already started when a part is posted (the
  overlap the parts are for);
* nothing is packed or posted once the job is cancelled or failed;
* ``SendFailure`` only when nothing is in flight or packing; ``Done``
  exactly once, after every WRITE posted ended and every pack started was
  answered.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_push_job import Handle, Marker

from kvpush.core.outcome import Cause, Failed, PlanKind, Stage, XferState
from kvpush.core.parts import PartSchedule, split_regions
from kvpush.core.plan import Plan
from kvpush.core.protocol import Register
from kvpush.prefill.job_plan import JobPlan
from kvpush.prefill.push_actions import QUESTIONS, CheckPack, Done, Notify, Post, ReleaseMade, SendFailure, StartPack
from kvpush.prefill.push_job import PushJob
from kvpush.prefill.transfer import Transfer

RB = 64
"""Bytes per region."""

SLOT = 4096
"""The job's staging slot."""


def job_of(n: int, parts: int, chain: bool) -> tuple[Transfer, PushJob, JobPlan]:
    """A staged job of ``n`` regions whose whole KV is reported at once, cut into exactly ``parts`` parts
    (fewer only when there are fewer regions)."""
    plan = Plan(PlanKind.STAGED, n * RB, n, 1, n, np.zeros((0, 3), dtype=np.int64))
    sched = PartSchedule((n,), RB, 0, 1)
    jp = JobPlan(plan, sched, push_parts=parts, chain=chain, min_part_bytes=0, costs=None)
    rec = Transfer()
    reg = Register(transfer_id="t", request_id="d", engine_id="D", rank=0, block_ids=((1,),), num_tokens=16)
    job = PushJob(reg, jp, rec.times, 0.0, 0.001, slot=SLOT)
    rec.jobs[job.key] = job
    return rec, job, jp


class PartsPushMachine(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 40), parts=st.integers(1, 16), chain=st.booleans())
    def setup(self, n: int, parts: int, chain: bool) -> None:
        self.n = n
        self.rec, self.job, jp = job_of(n, parts, chain)
        self.cut = split_regions(0, n, jp.parts(n))
        assert len(self.cut) == min(parts, n), (n, parts, self.cut)  # exactly N parts where n allows
        self.chain = chain
        self.kv = Marker()  # the KV of the whole request (the forward's last marker)
        self.packs: list[tuple[StartPack, Marker]] = []  # started, in order
        self.answered: set[int] = set()  # indices into packs whose CheckPack said packed (or failed)
        self.packed: set[tuple[int, int]] = set()  # parts whose CheckPack answered packed
        self.posted: list[tuple[int, int]] = []
        self.flying: list[Handle] = []
        self.stopped = False  # the shell stopped the job (cancel, fault) or something it did failed
        self.disturbed = False
        self.fail: SendFailure | None = None
        self.done: Done | None = None
        self.now = 0.0
        self._data = None

    # -- the shell ----------------------------------------------------------------------
    def _step(self) -> None:
        job = self.job
        self.now += 0.001
        if self.chain or self.kv.reached:
            # A chaining backend queues the packs behind the KV's marker; another reports the KV once reached.
            self._carry_out(job.ready(self.n, self.kv if self.chain and not self.kv.reached else None, None, self.now))
        self._carry_out(job.check_packs())
        for h in list(self.flying):
            if h.state is not XferState.PROC:
                self.flying.remove(h)
                self._carry_out(job.written(h, h.state, self.now))

    def _carry_out(self, actions: list) -> None:
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            assert not isinstance(a, QUESTIONS) or not todo, f"{a} does not end its list"
            assert self.done is None, f"{a} after Done"
            if isinstance(a, StartPack):
                todo.extend(self._start_pack(a))
            elif isinstance(a, CheckPack):
                todo.extend(self._check_pack(a))
            elif isinstance(a, Post):
                todo.extend(self._post(a))
            elif isinstance(a, SendFailure):
                assert not self.flying, "SendFailure while a WRITE is in flight"
                assert self._running() == [], "SendFailure while a pack is running"
                assert self.fail is None, "SendFailure twice"
                self.fail = a
            elif isinstance(a, Done):
                assert not self.flying, "Done while a WRITE is in flight"
                assert self._running() == [], "Done while a pack may still write the slot"
                self.done = a
                self.rec.end_job(self.job, a.failed, self.now)
            else:
                assert isinstance(a, Notify | ReleaseMade), a

    def _running(self) -> list[int]:
        """Packs started and not yet answered by a check (they may still write the slot)."""
        return [i for i in range(len(self.packs)) if i not in self.answered]

    def _start_pack(self, a: StartPack) -> list:
        assert not self.stopped, f"{a} after the job was stopped"
        want = self.cut[len(self.packs)] if len(self.packs) < len(self.cut) else None
        assert (a.r0, a.r1) == want, f"pack {a} is not the next part of the cut {self.cut}"
        assert a.offset == SLOT + a.r0 * RB, a
        assert a.after is (self.kv if self.chain and not self.kv.reached else None), a
        if self._fails(12):
            self.stopped = self.disturbed = True
            return self.job.failed(Failed(Stage.PACK, Cause.POST_ERROR, "pack failed"))
        m = Marker()
        self.packs.append((a, m))
        return self.job.pack_started(m, 0.0)

    def _check_pack(self, a: CheckPack) -> list:
        running = self._running()
        assert running, "a check with no pack running"
        i = running[0]
        sp, m = self.packs[i]
        assert a.marker is m, "CheckPack is not about the oldest pack running"
        # Waiting for a pack would hold back the flying WRITEs' completions and notifications (only P's
        # thread drives NIXL): the job polls then.
        assert not (a.block and self.flying), "the shell is told to wait for a pack while a WRITE flies"
        if self._fails(15):
            self.answered.add(i)
            self.stopped = self.disturbed = True
            return self.job.failed(Failed(Stage.PACK, Cause.POST_ERROR, "pack failed"))
        if a.block and (a.after is None or a.after.reached):
            m.reached = True  # the shell waits for it
        if not m.reached:
            return self.job.pack_pending()
        self.answered.add(i)
        self.packed.add((sp.r0, sp.r1))
        return self.job.packed()

    def _post(self, a: Post) -> list:
        assert not self.stopped, f"{a} after the job was stopped"
        assert (a.r0, a.r1) in self.packed, f"{a} posted before a check answered that its pack is done"
        assert any(sp.r0 == a.r0 and sp.r1 == a.r1 and m.reached for sp, m in self.packs), a
        assert (a.r0, a.r1) not in self.posted, f"{a} posted twice"
        assert a.r0 == (self.posted[-1][1] if self.posted else 0), f"{a} after {self.posted}: a gap or an overlap"
        assert a.nbytes == (a.r1 - a.r0) * RB, a
        k = self.cut.index((a.r0, a.r1))
        if k + 1 < len(self.cut):
            assert len(self.packs) > k + 1, f"part {k} posted before part {k + 1}'s pack was started: no overlap"
        if self._fails(20):
            self.stopped = self.disturbed = True
            return self.job.failed(Failed(Stage.POST, Cause.POST_ERROR, "post failed"))
        self.posted.append((a.r0, a.r1))
        h = Handle(a.r0, a.r1)
        at_once = self._data is not None and self._data.draw(st.integers(0, 3)) == 0
        if at_once:
            h.state = XferState.DONE  # ended within its post (shared memory)
        else:
            self.flying.append(h)
        return self.job.posted(h, 1, h.state, self.now, self.now)

    def _fails(self, one_in: int) -> bool:
        return self._data is not None and self._data.draw(st.integers(0, one_in - 1)) == 0

    # -- the world ---------------------------------------------------------------------
    @precondition(lambda self: not self.kv.reached)
    @rule(data=st.data())
    def kv_reached(self, data) -> None:
        self._data = data
        self.kv.reached = True
        self._step()

    @precondition(lambda self: any(not m.reached for _, m in self.packs))
    @rule(data=st.data(), which=st.integers(0, 15))
    def a_pack_lands(self, data, which: int) -> None:
        """Any running pack lands, not only the oldest (each has its own marker)."""
        if self.chain and not self.kv.reached:
            return  # queued behind the KV
        self._data = data
        left = [m for _, m in self.packs if not m.reached]
        left[which % len(left)].reached = True
        self._step()

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), which=st.integers(0, 15), ok=st.integers(0, 9))
    def a_write_ends(self, data, which: int, ok: int) -> None:
        """Any WRITE in flight ends, in any order; one in ten fails."""
        self._data = data
        h = self.flying[which % len(self.flying)]
        h.state = XferState.DONE if ok else XferState.ERR
        if h.state is XferState.ERR:
            self.stopped = self.disturbed = True
        self._step()

    @precondition(lambda self: self.done is None)
    @rule(data=st.data(), how=st.sampled_from(["cancel", "discard", "peer_gone", "fault"]))
    def stop(self, data, how: str) -> None:
        self._data = data
        self.stopped = self.disturbed = True
        if how == "cancel":
            self.job.cancel(Cause.ABORTED, "client went away")
        elif how == "discard":
            self.job.cancel(Cause.DEAD_PEER, "D gave up", discard=True)
        elif how == "peer_gone":
            self.job.peer_gone("D said hello again")
        else:
            self.job.fault(Failed(Stage.POST, Cause.OTHER, "push failed: boom"))
        self._step()

    @rule(data=st.data())
    def idle_step(self, data) -> None:
        self._data = data
        self._step()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def posted_parts_are_a_prefix_of_the_cut(self) -> None:
        assert self.posted == self.cut[: len(self.posted)], (self.posted, self.cut)
        assert self.job.nposted == sum(b - a for a, b in self.posted)

    def teardown(self) -> None:
        """Let every marker land and every WRITE end: the job ends once; an undisturbed one posted the whole cut."""
        if not hasattr(self, "job"):
            return
        self._data = None
        for _ in range(4 * self.n + 8):
            self.kv.reached = True
            for _, m in self.packs:
                m.reached = True
            for h in self.flying:
                h.state = XferState.DONE
            self._step()
            if self.done is not None:
                break
        assert self.done is not None, "the job never ended"
        assert self._running() == [] and not self.flying
        if not self.disturbed:
            assert self.posted == self.cut and self.fail is None and self.done.failed is None, (self.posted, self.done)
            assert sorted(r for a, b in self.posted for r in range(a, b)) == list(range(self.n))
            assert self.job.stats.parts == len(self.cut)
        else:
            assert (self.fail is not None) == (self.done.failed is not None), (self.fail, self.done)
            assert self.done.failed is not None or self.posted == self.cut, "a stopped push short of parts succeeded"
        assert not self.rec.jobs


PartsPushMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)
test_push_parts_state_machine = PartsPushMachine.TestCase
