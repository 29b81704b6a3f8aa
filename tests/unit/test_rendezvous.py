"""Rendezvous: pairing D's registrations with P's finished prefills, in any order, under re-issue, abort and expiry.

The rendezvous decides when P may free a prefill's blocks (``Release``) and
when to write D's blocks (``Push``). A Release too early lets P reuse blocks a
WRITE is still reading; a missing Release leaks P's KV cache; a Push after
Release ships garbage. The example tests pin each path; the state machine
checks the invariants over arbitrary interleavings.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from msgspec.structs import replace as msgspec_replace

from kvpush.core.outcome import Cause, Failed, PlanKind, PrefillState, Stage, XferState
from kvpush.core.parts import PartSchedule
from kvpush.core.plan import Plan
from kvpush.core.protocol import Register
from kvpush.prefill.decisions import Acknowledge, Hold, Prefill, Push, Refuse, Release, TransferState
from kvpush.prefill.job_plan import JobPlan
from kvpush.prefill.push_actions import Done, Post
from kvpush.prefill.push_job import PushJob
from kvpush.prefill.rendezvous import Rendezvous

LEASE_S = 10.0


def prefill(tid: str = "t1", rid: str = "p-req-1", blocks: tuple[int, ...] = (1, 2), n: int = 20) -> Prefill:
    return Prefill(transfer_id=tid, request_id=rid, block_ids=(blocks,), num_tokens=n)


def reg(tid: str = "t1", rank: int = 0, blocks: tuple[int, ...] = (7, 8), lease_ms: int = 5000, engine: str = "d"):
    return Register(
        transfer_id=tid,
        request_id=f"d-req-{tid}",
        engine_id=engine,
        rank=rank,
        block_ids=(blocks,),
        num_tokens=20,
        lease_ms=lease_ms,
    )


def kinds(decisions) -> list[str]:
    return [type(d).__name__ for d in decisions]


ABORTED = Failed(Stage.RENDEZVOUS, Cause.ABORTED, "aborted")


def abort(rv: Rendezvous, tid: str, now: float, reason: str = "aborted") -> list:
    """P's abort of a transfer, as the sender makes it (``Rendezvous.cancel``)."""
    return rv.cancel(tid, now, Failed(Stage.RENDEZVOUS, Cause.ABORTED, reason))


def start(rv: Rendezvous, now: float) -> None:
    """What the sender does at a step's end: start a push job for every push paired in it (in the record)."""
    for tid, rec in list(rv.pushing()):
        for push in rv.unstarted(tid):
            plan = Plan(PlanKind.DIRECT, 10, 1, 1, 1, np.zeros((0, 3), dtype=np.int64))
            job = PushJob(push.reg, JobPlan(plan, PartSchedule((1,), 10, 0, 1)), rec.times, now, 0.0)
            rec.jobs[job.key] = job


# -- pairing in either order --------------------------------------------------------


def test_register_then_prefill() -> None:
    rv = Rendezvous(prefill_lease_s=LEASE_S)
    r, p = reg(), prefill()
    assert rv.on_register(r, now=0.0) == []
    assert rv.stage("t1") is TransferState.WAITING_FOR_PREFILL
    assert rv.on_prefill(p, now=1.0) == [Push(p, r)]
    assert rv.stage("t1") is TransferState.TRANSFERRING
    assert rv.pending() == {"parked_prefills": 0, "waiting_registrations": 0, "in_flight": 1}
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]
    assert len(rv) == 0 and rv.stage("t1") is None


def test_prefill_then_register() -> None:
    rv = Rendezvous(prefill_lease_s=LEASE_S)
    r, p = reg(), prefill()
    assert rv.on_prefill(p, now=0.0) == []
    assert rv.stage("t1") is TransferState.WAITING_FOR_REGISTRATION
    assert rv.pending()["parked_prefills"] == 1
    assert rv.on_register(r, now=1.0) == [Push(p, r)]
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]
    assert len(rv) == 0


def test_unknown_pushed_is_ignored() -> None:
    rv = Rendezvous()
    assert rv.on_pushed("nope", "d", 0) == []
    assert abort(rv, "nope", now=0.0) == []


def test_transfers_are_independent() -> None:
    rv = Rendezvous()
    p1, p2 = prefill("a", "ra"), prefill("b", "rb")
    rv.on_prefill(p1, 0.0)
    assert rv.on_register(reg("b"), 0.0) == []
    assert rv.on_register(reg("a"), 0.0) == [Push(p1, reg("a"))]
    assert rv.on_prefill(p2, 0.0) == [Push(p2, reg("b"))]
    assert rv.on_pushed("b", "d", 0) == [Release(p2, "pushed")]
    assert rv.stage("a") is TransferState.TRANSFERRING


# -- re-issue ---------------------------------------------------------------------------


def test_reissued_prefill_before_registration_releases_the_old() -> None:
    rv = Rendezvous()
    old, new = prefill(rid="r1", blocks=(1,)), prefill(rid="r2", blocks=(9,))
    rv.on_prefill(old, 0.0)
    out = rv.on_prefill(new, 1.0)
    assert out == [Release(old, "re-issued under a new request id")]
    assert rv.on_register(reg(), 2.0) == [Push(new, reg())]
    assert rv.on_pushed("t1", "d", 0) == [Release(new, "pushed")]


def test_reissued_prefill_after_registration_pushes_the_new() -> None:
    """Old prefill already pushed to one of two D ranks: release it, push the new one to that rank again."""
    rv = Rendezvous()
    old, new, r0 = prefill(rid="r1"), prefill(rid="r2", blocks=(5, 6)), reg(rank=0)
    rv.on_prefill(old, 0.0)
    assert rv.on_register(r0, 0.0, expected=2) == [Push(old, r0)]
    assert rv.on_pushed("t1", "d", 0) == []  # rank 1 still missing
    out = rv.on_prefill(new, 1.0)
    assert out == [Release(old, "re-issued under a new request id"), Push(new, r0)]
    assert rv.on_pushed("t1", "d", 0) == []
    r1 = reg(rank=1)
    assert rv.on_register(r1, 2.0, expected=2) == [Push(new, r1)]
    assert rv.on_pushed("t1", "d", 1) == [Release(new, "pushed")]


def test_reissued_prefill_while_old_is_in_flight_is_released_at_once() -> None:
    """The old blocks are being read: the new prefill cannot be parked too, so it is let go immediately."""
    rv = Rendezvous()
    old, new = prefill(rid="r1"), prefill(rid="r2")
    rv.on_prefill(old, 0.0)
    rv.on_register(reg(), 0.0)
    assert kinds(rv.on_prefill(new, 1.0)) == ["Release"]
    assert rv.on_pushed("t1", "d", 0) == [Release(old, "pushed")]


def test_same_prefill_announced_twice_is_idempotent() -> None:
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(), 0.0)
    assert rv.on_prefill(p, 0.5) == []
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]


def test_reregistration_before_prefill_replaces() -> None:
    rv = Rendezvous()
    first, second = reg(blocks=(1,)), reg(blocks=(2,))
    rv.on_register(first, 0.0)
    rv.on_register(second, 0.5)
    p = prefill()
    assert rv.on_prefill(p, 1.0) == [Push(p, second)]


def test_reregistration_after_push_pushes_new_blocks() -> None:
    """D preempted and re-allocated after our WRITE: its new blocks are written while P still holds the KV."""
    rv = Rendezvous()
    p, first, second = prefill(), reg(rank=0, blocks=(1,)), reg(rank=0, blocks=(2,))
    rv.on_prefill(p, 0.0)
    rv.on_register(first, 0.0, expected=2)
    assert rv.on_pushed("t1", "d", 0) == []
    assert rv.on_register(second, 1.0, expected=2) == [Push(p, second)]
    rv.on_pushed("t1", "d", 0)
    assert rv.on_register(reg(rank=1), 1.0, expected=2) == [Push(p, reg(rank=1))]
    assert rv.on_pushed("t1", "d", 1) == [Release(p, "pushed")]


def test_reregistration_while_in_flight_is_refused() -> None:
    rv = Rendezvous()
    p, first, second = prefill(), reg(blocks=(1,)), reg(blocks=(2,))
    rv.on_prefill(p, 0.0)
    rv.on_register(first, 0.0)
    out = rv.on_register(second, 0.1)
    assert kinds(out) == ["Refuse"] and out[0].reg == second
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]


def test_new_attempt_while_the_old_is_written_waits_for_it() -> None:
    """D re-allocated (a new attempt) while P writes the old attempt's blocks: the new one is held until that
    WRITE ends, then pushed; an even newer attempt replaces the held one, which is refused."""
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    first = reg()
    assert rv.on_register(first, 0.0) == [Push(p, first)]
    second, third = msgspec_replace(reg(blocks=(2,)), attempt=1), msgspec_replace(reg(blocks=(3,)), attempt=2)
    assert rv.on_register(second, 0.1) == [Hold(second)]
    out = rv.on_register(third, 0.2)
    assert kinds(out) == ["Refuse", "Hold"] and out[0].reg == second and out[0].cause is Cause.SUPERSEDED
    assert rv.on_pushed("t1", "d", 0) == [Push(p, third)]
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]


def test_new_attempt_after_the_push_was_released_is_refused_at_once() -> None:
    """D re-allocated while P wrote the old attempt, but its registration came after the push ended and P had
    released the KV: it is refused at once (D fails the attempt and recomputes), not parked for a prefill that
    will never finish again; a prefill finishing again under the id is a new transfer, paired as any other."""
    rv = Rendezvous(prefill_lease_s=LEASE_S)
    p, first = prefill(), reg()
    rv.on_prefill(p, 0.0)
    assert rv.on_register(first, 0.0) == [Push(p, first)]
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]
    late = msgspec_replace(reg(blocks=(2,)), attempt=1)
    out = rv.on_register(late, 0.1)
    assert kinds(out) == ["Refuse"] and out[0].reg == late and out[0].cause is Cause.SUPERSEDED, out
    assert len(rv) == 0 and rv.pending()["waiting_registrations"] == 0
    again = prefill(rid="p-req-2")
    assert rv.on_prefill(again, 1.0) == []
    assert rv.on_register(late, 1.1) == [Push(again, late)]
    rv.on_pushed("t1", "d", 0)
    # A prefill finished again and expired unpaired was never pushed: a registration for it waits as any does.
    rv.on_prefill(again, 2.0)
    assert kinds(rv.expire(3.0 + LEASE_S)) == ["Release"]
    assert rv.on_register(msgspec_replace(late, attempt=2), 20.0) == []


# -- several D ranks ------------------------------------------------------------------------


def test_two_ranks_release_after_both() -> None:
    rv = Rendezvous()
    p, r0, r1 = prefill(), reg(rank=0), reg(rank=1)
    assert rv.on_register(r0, 0.0, expected=2) == []
    assert rv.on_prefill(p, 0.0) == [Push(p, r0)]
    assert rv.on_pushed("t1", "d", 0) == []
    assert rv.stage("t1") is TransferState.WAITING_FOR_REGISTRATION
    assert rv.on_register(r1, 0.0, expected=2) == [Push(p, r1)]
    assert rv.on_pushed("t1", "d", 1) == [Release(p, "pushed")]


def test_two_ranks_both_in_flight() -> None:
    rv = Rendezvous()
    p, r0, r1 = prefill(), reg(rank=0), reg(rank=1)
    rv.on_register(r0, 0.0, expected=2)
    rv.on_register(r1, 0.0, expected=2)
    assert rv.on_prefill(p, 0.0) == [Push(p, r0), Push(p, r1)]
    assert rv.pending()["in_flight"] == 2
    assert rv.on_pushed("t1", "d", 1) == []
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]


def test_same_rank_of_two_engines_are_distinct() -> None:
    """Registrations are keyed by (engine, rank): rank 0 of two D instances are two destinations."""
    rv = Rendezvous()
    p, a, b = prefill(), reg(engine="dA"), reg(engine="dB")
    rv.on_prefill(p, 0.0)
    assert rv.on_register(a, 0.0, expected=2) == [Push(p, a)]
    assert rv.on_register(b, 0.0, expected=2) == [Push(p, b)]
    assert rv.on_pushed("t1", "dA", 0) == []
    assert rv.on_pushed("t1", "dB", 0) == [Release(p, "pushed")]


# -- expiry -----------------------------------------------------------------------------------


def test_parked_prefill_lease_expires() -> None:
    rv = Rendezvous(prefill_lease_s=LEASE_S)
    p = prefill()
    rv.on_prefill(p, now=100.0)
    assert rv.expire(100.0 + LEASE_S - 0.001) == []
    out = rv.expire(100.0 + LEASE_S)
    assert kinds(out) == ["Release"] and out[0].prefill == p and "lease expired" in out[0].reason
    assert len(rv) == 0
    assert rv.expire(1e9) == []


def test_lease_expires_when_second_rank_never_registers() -> None:
    """One of two ranks pushed; the other never came: release anyway, nothing to refuse."""
    rv = Rendezvous(prefill_lease_s=LEASE_S)
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(rank=0), 0.0, expected=2)
    rv.on_pushed("t1", "d", 0)
    out = rv.expire(LEASE_S)
    assert kinds(out) == ["Release"]
    assert len(rv) == 0


def test_waiting_registration_expires_with_refuse() -> None:
    rv = Rendezvous()
    r = reg(lease_ms=2000)
    rv.on_register(r, now=50.0)
    assert rv.expire(51.999) == []
    out = rv.expire(52.0)
    assert kinds(out) == ["Refuse"] and out[0].reg == r and "expired" in out[0].reason
    assert len(rv) == 0
    p = prefill()
    assert rv.on_prefill(p, 53.0) == []  # the prefill now parks alone and expires on its own lease
    assert rv.stage("t1") is TransferState.WAITING_FOR_REGISTRATION


def test_reregistration_renews_the_deadline() -> None:
    rv = Rendezvous()
    rv.on_register(reg(lease_ms=1000), now=0.0)
    rv.on_register(reg(lease_ms=1000, blocks=(3,)), now=0.9)
    assert rv.expire(1.5) == []
    assert kinds(rv.expire(1.9)) == ["Refuse"]


def test_in_flight_never_expires() -> None:
    """A WRITE in progress keeps its blocks however long it takes; the release comes from on_pushed."""
    rv = Rendezvous(prefill_lease_s=1.0)
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(lease_ms=1), 0.0)
    assert rv.expire(1e6) == []
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]


# -- abort ------------------------------------------------------------------------------------


def test_abort_before_pairing_registration_only() -> None:
    rv = Rendezvous()
    r = reg()
    rv.on_register(r, 0.0)
    assert abort(rv, "t1", 0.5) == [Refuse(r, "aborted", Cause.ABORTED)]  # the waiting registration is answered
    assert len(rv) == 0


def test_abort_before_pairing_prefill_only() -> None:
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    assert abort(rv, "t1", 0.5, reason="client went away") == [Release(p, "client went away")]
    assert len(rv) == 0


def test_abort_after_push_finished_but_before_release() -> None:
    """Rank 0 pushed, rank 1 never registered: abort releases the prefill now instead of at lease expiry."""
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(rank=0), 0.0, expected=2)
    rv.on_pushed("t1", "d", 0)
    assert abort(rv, "t1", 1.0) == [Release(p, "aborted")]
    assert len(rv) == 0


def test_abort_while_in_flight_waits_for_the_write() -> None:
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(rank=0), 0.0, expected=2)
    start(rv, 0.0)
    assert abort(rv, "t1", 1.0) == []
    assert rv.stage("t1") is TransferState.TRANSFERRING
    assert rv.expire(1e9) == []
    # Only the write in flight is awaited; rank 1 is no longer expected.
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]
    assert len(rv) == 0


def test_no_push_after_abort_while_in_flight() -> None:
    """After D aborted, a late registration or prefill for the transfer must not start a new WRITE."""
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(rank=0), 0.0, expected=2)
    start(rv, 0.0)
    abort(rv, "t1", 1.0)
    late = reg(rank=1)
    out = rv.on_register(late, 1.5, expected=2)
    assert kinds(out) == ["Refuse"] and out[0].reg == late
    new = prefill(rid="p-req-2")
    assert rv.on_prefill(new, 1.6) == [Release(new, "superseded prefill still transferring")]
    assert rv.on_pushed("t1", "d", 0) == [Release(p, "pushed")]
    assert len(rv) == 0


# -- state machine ------------------------------------------------------------------------------

TIDS = ("t0", "t1")
EXPECTED = {"t0": 1, "t1": 2}
RANKS = (("dA", 0), ("dA", 1), ("dB", 0))


class RendezvousMachine(RuleBasedStateMachine):
    """Arbitrary interleavings of prefill/register/pushed/abort/expire, with invariants checked at every step.

    The model keeps only what an outside observer can know: which prefills were
    announced and released, which WRITEs are outstanding, and what became of
    each registration (pushed, refused, replaced by the same rank, or dropped by
    an abort).
    """

    def __init__(self) -> None:
        super().__init__()
        self.rv = Rendezvous(prefill_lease_s=LEASE_S)
        self.now = 0.0
        self.ids = itertools.count()
        self.prefills: list[Prefill] = []  # every prefill announced
        self.latest: dict[str, Prefill] = {}  # latest prefill per transfer
        self.released: list[Prefill] = []
        self.outstanding: dict[tuple[str, str, int], Prefill] = {}  # (tid, engine, rank) -> prefill being read
        self.registered: list[Register] = []
        self.current: dict[tuple[str, str, int], Register] = {}  # latest live registration per D rank
        self.fate: dict[int, str] = {}  # id(reg) -> pushed / refused / replaced / dropped
        self.aborted: set[str] = set()  # aborted while a WRITE was in flight (entry still alive)
        self.queue: dict[str, PrefillState] = {}  # what P's scheduler last said of a prefill not finished
        self.acked: dict[int, PrefillState] = {}  # id(reg) -> the state it was last told

    @staticmethod
    def _key(r: Register) -> tuple[str, str, int]:
        return (r.transfer_id, r.engine_id, r.rank)

    def _apply(self, decisions) -> None:
        for d in decisions:
            if isinstance(d, Push):
                key = self._key(d.reg)
                assert d.prefill.transfer_id == d.reg.transfer_id
                assert any(d.prefill is p for p in self.prefills), "Push of a prefill never announced"
                assert d.prefill not in self.released, "Push of a prefill already released"
                assert key not in self.outstanding, "two WRITEs to one D rank at once"
                assert d.reg.transfer_id not in self.aborted, "Push after abort"
                assert self.fate.get(id(d.reg)) in (None, "pushed"), (
                    f"Push of a {self.fate.get(id(d.reg))} registration"
                )
                self.outstanding[key] = d.prefill
                self.fate[id(d.reg)] = "pushed"
            elif isinstance(d, Release):
                assert any(d.prefill is p for p in self.prefills), "Release of a prefill never announced"
                assert d.prefill not in self.released, f"{d.prefill.request_id} released twice"
                assert d.prefill not in self.outstanding.values(), "Release while its blocks are still being read"
                self.released.append(d.prefill)
            elif isinstance(d, Acknowledge):
                tid = d.reg.transfer_id
                assert any(d.reg is r for r in self.registered), "Acknowledge of an unknown registration"
                assert id(d.reg) not in self.fate, f"Acknowledge of a {self.fate[id(d.reg)]} registration"
                assert d.state is self.queue.get(tid), f"acknowledged {d.state}, P's scheduler said {self.queue}"
                assert self.acked.get(id(d.reg)) is not d.state, "acknowledged the same state twice"
                self.acked[id(d.reg)] = d.state
            elif isinstance(d, Refuse):
                assert any(d.reg is r for r in self.registered), "Refuse of an unknown registration"
                assert not (d.cause is Cause.EXPIRED and d.reg.transfer_id in self.queue), (
                    "a registration expired while P's scheduler holds its prefill queued or running"
                )
                assert id(d.reg) not in self.fate, f"Refuse of a {self.fate[id(d.reg)]} registration"
                self.fate[id(d.reg)] = "refused"
                if self.current.get(self._key(d.reg)) is d.reg:
                    del self.current[self._key(d.reg)]
            else:  # pragma: no cover
                raise AssertionError(f"unknown decision {d!r}")
        start(self.rv, self.now)  # the sender starts what was paired at the step's end

    # -- rules
    @rule(tid=st.sampled_from(TIDS), blocks=st.lists(st.integers(0, 99), min_size=1, max_size=3, unique=True))
    def finish_prefill(self, tid: str, blocks: list[int]) -> None:
        """P (re)finishes a prefill; a fresh request id each time, as a re-issue gets."""
        p = Prefill(tid, f"{tid}-p{next(self.ids)}", (tuple(blocks),), 40)
        self.prefills.append(p)
        self.latest[tid] = p
        self.queue.pop(tid, None)
        self._apply(self.rv.on_prefill(p, self.now))

    @rule(tid=st.sampled_from(TIDS), state=st.sampled_from(list(PrefillState)), ahead=st.integers(0, 9999))
    def scheduler_says(self, tid: str, state: PrefillState, ahead: int) -> None:
        """P's scheduler holds the prefill queued or running, or no longer (UNKNOWN)."""
        if state in (PrefillState.QUEUED, PrefillState.RUNNING):
            self.queue[tid] = state
        else:
            self.queue.pop(tid, None)
        self._apply(self.rv.on_prefill_state(tid, state, ahead))

    @precondition(lambda self: any(p not in self.released for p in self.latest.values()))
    @rule(data=st.data())
    def duplicate_prefill(self, data) -> None:
        """The same finished prefill announced again (a retried hook) changes nothing."""
        p = data.draw(st.sampled_from([p for p in self.latest.values() if p not in self.released]))
        self._apply(self.rv.on_prefill(p, self.now))

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(RANKS), lease_ms=st.sampled_from([1000, 5000, 20000]))
    def register(self, tid: str, who: tuple[str, int], lease_ms: int) -> None:
        """A D rank registers, or re-registers new blocks (preempted and re-allocated)."""
        r = Register(
            transfer_id=tid,
            request_id=f"{tid}-d",
            engine_id=who[0],
            rank=who[1],
            block_ids=((next(self.ids),),),
            num_tokens=40,
            lease_ms=lease_ms,
        )
        self.registered.append(r)
        old = self.current.get(self._key(r))
        self._apply(self.rv.on_register(r, self.now, expected=EXPECTED[tid]))
        if self.fate.get(id(r)) != "refused":
            if old is not None and id(old) not in self.fate:
                self.fate[id(old)] = "replaced"
            self.current[self._key(r)] = r

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def write_finished(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.outstanding)))
        self._finish(key)

    def _finish(self, key: tuple[str, str, int]) -> None:
        del self.outstanding[key]
        self._apply(self.rv.on_pushed(*key))
        if not any(k[0] == key[0] for k in self.outstanding):
            self.aborted.discard(key[0])

    @rule(tid=st.sampled_from(TIDS))
    def abort(self, tid: str) -> None:
        self.queue.pop(tid, None)
        if any(k[0] == tid for k in self.outstanding):
            self.aborted.add(tid)
        self._apply(abort(self.rv, tid, self.now))
        for key in [k for k in self.current if k[0] == tid]:
            r = self.current.pop(key)
            self.fate.setdefault(id(r), "dropped")

    @rule(dt=st.sampled_from([0.1, 1.0, 3.0, LEASE_S]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.rv.expire(self.now))

    # -- invariants
    @invariant()
    def in_flight_matches(self) -> None:
        assert self.rv.pending()["in_flight"] == len(self.outstanding)
        for tid, _, _ in self.outstanding:
            assert self.rv.stage(tid) is TransferState.TRANSFERRING

    @invariant()
    def nothing_idle_outlives_its_lease(self) -> None:
        """A minute on (leases are at most 20 s), only transfers with a WRITE in flight may remain."""
        probe = copy.deepcopy(self.rv)
        for d in probe.expire(self.now + 60.0):
            assert not isinstance(d, Push)
        kept = {k[0] for k in self.outstanding}
        assert len(probe) >= len(kept)
        # Registrations waiting for a prefill P's scheduler holds live as long as it does.
        known = {t for t in TIDS if probe.stage(t) is not None}
        assert known <= kept | set(self.queue), (known, kept, self.queue)

    def teardown(self) -> None:
        """Finish every write, let every deadline pass: all released once, all registrations answered, empty."""
        while self.outstanding:
            self._finish(sorted(self.outstanding)[0])
        for tid in list(self.queue):
            self.scheduler_says(tid, PrefillState.UNKNOWN, 0)
        self.now += 1e6
        self._apply(self.rv.expire(self.now))
        assert len(self.rv) == 0, f"left behind: {[(t, self.rv.stage(t)) for t in TIDS]}"
        assert sorted(p.request_id for p in self.released) == sorted(p.request_id for p in self.prefills)
        unanswered = [r for r in self.registered if id(r) not in self.fate]
        assert not unanswered, f"registrations never pushed, refused, replaced or dropped: {unanswered}"
        super().teardown()


RendezvousMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=25, deadline=None)
test_rendezvous_state_machine = RendezvousMachine.TestCase


@pytest.mark.parametrize("order", list(itertools.permutations(["prefill", "reg0", "reg1"])))
def test_all_arrival_orders_two_ranks(order) -> None:
    """Whatever order the three events arrive in, both ranks are pushed once and the prefill released once."""
    rv = Rendezvous()
    p = prefill()
    pushes, releases = [], []
    for ev in order:
        out = rv.on_prefill(p, 0.0) if ev == "prefill" else rv.on_register(reg(rank=int(ev[-1])), 0.0, expected=2)
        pushes += [d for d in out if isinstance(d, Push)]
        releases += [d for d in out if isinstance(d, Release)]
    assert sorted(d.reg.rank for d in pushes) == [0, 1]
    assert releases == []
    releases += rv.on_pushed("t1", "d", 0) + rv.on_pushed("t1", "d", 1)
    assert releases == [Release(p, "pushed")]


def test_prefill_finishing_after_an_abort_is_released_at_once() -> None:
    """A transfer D aborted before P's prefill finished must not hold P's blocks for a lease."""
    from kvpush.core.protocol import Register
    from kvpush.prefill.decisions import Prefill, Release
    from kvpush.prefill.rendezvous import Rendezvous

    r = Rendezvous(prefill_lease_s=60)
    reg = Register(transfer_id="t", request_id="d", engine_id="D", rank=0, block_ids=((1,),), num_tokens=8)
    assert r.on_register(reg, now=0.0) == []
    assert abort(r, "t", now=1.0) == [Refuse(reg, "aborted", Cause.ABORTED)]
    (rel,) = r.on_prefill(Prefill("t", "p", ((3,),), 8), now=2.0)
    assert isinstance(rel, Release) and "aborted" in rel.reason
    assert len(r) == 0
    # The memory of the abort expires with the lease; a new transfer under the id then pairs normally.
    r.expire(now=100.0)
    assert r.on_prefill(Prefill("t", "p2", ((3,),), 8), now=101.0) == []
    assert len(r) == 1


# -- the whole of P's per-transfer rules: pairing, re-registered attempts, pushes, aborts, dead peers --------


class TransferMachine(RuleBasedStateMachine):
    """The rendezvous with its records and push jobs, driven as the sender drives them.

    D ranks register and re-register (a new attempt while the previous one
    is being written waits for it: ``Hold``), prefills finish, paired pushes
    start at the step's end unless an abort came first, WRITEs end, either
    side aborts, a D rank is dropped (dead or restarted), time passes. Every
    registration gets one answer (pushed, refused, or dropped with its dead
    peer); each prefill is released once, never while a job of it runs; a
    held attempt is pushed only after the previous attempt's WRITE ended;
    nothing starts after an abort; the record goes with its entry.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rv = Rendezvous(prefill_lease_s=LEASE_S)
        self.now = 0.0
        self.ids = itertools.count()
        self.attempts: dict[tuple[str, str, int], int] = {}
        self.prefills: list[Prefill] = []
        self.released: list[Prefill] = []
        self.fate: dict[int, str] = {}  # id(reg) -> pushed / refused / dropped / replaced
        self.regs: list[Register] = []
        self.jobs: dict[tuple[str, str, int], PushJob] = {}  # (tid, engine, rank) -> running job
        self.started: list[tuple[Register, Prefill]] = []
        self.aborted: set[str] = set()
        self.gone: set[tuple[str, int]] = set()
        self.decided: set[int] = set()  # id(reg) of pushes decided and not started

    def _apply(self, decisions) -> None:
        for d in decisions:
            if isinstance(d, Release):
                assert d.prefill not in self.released, f"{d.prefill.request_id} released twice"
                live = [k for k, j in self.jobs.items() if k[0] == d.prefill.transfer_id]
                assert not live or d.prefill is not self._prefill_of(live[0]), "released while its push runs"
                self.released.append(d.prefill)
            elif isinstance(d, Refuse):
                if self.fate.get(id(d.reg)) == "dropped":
                    continue  # the sender has nobody to tell any more
                # A registration is refused before it is pushed, or when a push decided for it again (a
                # re-issued prefill) is cancelled before it started.
                fate = self.fate.get(id(d.reg))
                assert fate in (None, "held") or id(d.reg) in self.decided, f"refused a {fate} reg"
                self.decided.discard(id(d.reg))
                self.fate[id(d.reg)] = "refused"
            elif isinstance(d, Push):
                self.decided.add(id(d.reg))
            elif isinstance(d, Hold):
                self.fate[id(d.reg)] = "held"

    def _prefill_of(self, key: tuple[str, str, int]) -> Prefill:
        return next(p for r, p in reversed(self.started) if (r.transfer_id, r.engine_id, r.rank) == key)

    def _end_of_step(self) -> None:
        """What the sender does at a step's end: start the pushes paired in it."""
        self._prune()
        self._start_paired()

    def _prune(self) -> None:
        """An abort's memory lasts as long as the aborted entry: a registration after that is a new transfer."""
        self.aborted = {t for t in self.aborted if self.rv.stage(t) is not None}

    def _start_paired(self) -> None:
        for tid, rec in list(self.rv.pushing()):
            for push in self.rv.unstarted(tid):
                key = (tid, push.reg.engine_id, push.reg.rank)
                if key[1:] in self.gone:  # the sender finds the D rank gone: the push ends unstarted
                    gone = Failed(Stage.RENDEZVOUS, Cause.DEAD_PEER, "is gone")
                    self._apply(self.rv.push_ended(tid, key[1:], gone))
                    continue
                assert tid not in self.aborted, "a push started after its transfer was aborted"
                assert key not in self.jobs, "two WRITEs to one D rank at once"
                assert push.prefill not in self.released, "a push of a released prefill"
                before = [p for r, p in self.started if r is push.reg]
                # A registration is pushed once, or again for a re-issued prefill (new blocks on P).
                assert self.fate.get(id(push.reg)) in (None, "held") or push.prefill not in before, push
                self.fate[id(push.reg)] = "pushed"
                self.decided.discard(id(push.reg))
                plan = Plan(PlanKind.DIRECT, 10, 1, 1, 1, np.zeros((0, 3), dtype=np.int64))
                jp = JobPlan(plan, PartSchedule((1,), 10, 0, 1))
                job = PushJob(push.reg, jp, rec.times, self.now, 0.0)
                rec.jobs[job.key] = job
                self.jobs[key] = job
                self.started.append((push.reg, push.prefill))
                self._run(tid, rec, job, job.ready(1, None, None, self.now))

    def _run(self, tid: str, rec, job: PushJob, actions: list | None = None) -> None:
        """Carry out the job's actions (None: those its next step brings, after a cancel)."""
        todo = list(job.check_packs() if actions is None else actions)
        while todo:
            a = todo.pop(0)
            if isinstance(a, Post):
                todo += job.posted(object(), 1, XferState.PROC, self.now, self.now)
            elif isinstance(a, Done):
                rec.end_job(job, a.failed, self.now)
                del self.jobs[(tid, *job.key)]
                self._apply(self.rv.push_ended(tid, job.key, a.failed))

    @rule(tid=st.sampled_from(TIDS))
    def finish_prefill(self, tid: str) -> None:
        self._prune()
        p = Prefill(tid, f"{tid}-p{next(self.ids)}", ((1,),), 40)
        self.prefills.append(p)
        self._apply(self.rv.on_prefill(p, self.now))

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(RANKS), again=st.booleans())
    def register(self, tid: str, who: tuple[str, int], again: bool) -> None:
        """A D rank registers; ``again``: a new attempt of its registration (D re-allocated)."""
        self._prune()
        if who in self.gone:
            return
        key = (tid, *who)
        attempt = self.attempts.get(key, 0) + (1 if again and key in self.attempts else 0)
        self.attempts[key] = attempt
        r = msgspec_replace(reg(tid, who[1], (next(self.ids),), engine=who[0]), num_tokens=40, attempt=attempt)
        self.regs.append(r)
        self._apply(self.rv.on_register(r, self.now, expected=EXPECTED[tid]))

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), ok=st.booleans())
    def write_ends(self, data, ok: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs[key]
        rec = self.rv.record(key[0])
        assert rec is not None and rec.jobs.get(job.key) is job, "the job outlived its record"
        (h,) = job.flying
        self._run(key[0], rec, job, job.written(h, XferState.DONE if ok else XferState.ERR, self.now))

    @rule(tid=st.sampled_from(TIDS))
    def abort(self, tid: str) -> None:
        if any(k[0] == tid for k in self.jobs) or self.rv.stage(tid) is not None:
            self.aborted.add(tid)
        self._apply(self.rv.cancel(tid, self.now, Failed(Stage.RENDEZVOUS, Cause.ABORTED, "client went away")))
        for tid_, rec in list(self.rv.pushing()):
            for job in list(rec.jobs.values()):
                self._run(tid_, rec, job)

    @rule(who=st.sampled_from(RANKS))
    def peer_dropped(self, who: tuple[str, int]) -> None:
        self.gone.add(who)
        for r in self.regs:
            if ((r.engine_id, r.rank) == who and id(r) not in self.fate) or (
                (r.engine_id, r.rank) == who and self.fate[id(r)] == "held"
            ):
                self.fate[id(r)] = "dropped"
        self._apply(self.rv.drop_peer(who, self.now, "D declared dead"))
        for tid, rec in list(self.rv.pushing()):
            for job in list(rec.jobs.values()):
                self._run(tid, rec, job)

    @rule(dt=st.sampled_from([1.0, LEASE_S, 200.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.rv.expire(self.now))

    @rule()
    def step_ends(self) -> None:
        """The engine step ends: every message of the step was read, paired pushes start now."""
        self._end_of_step()

    @invariant()
    def jobs_live_in_their_records(self) -> None:
        for (tid, e, r), job in self.jobs.items():
            rec = self.rv.record(tid)
            assert rec is not None and rec.jobs.get((e, r)) is job

    def teardown(self) -> None:
        self._end_of_step()
        while self.jobs:
            key = sorted(self.jobs)[0]
            job = self.jobs[key]
            self._run(key[0], self.rv.record(key[0]), job, job.written(job.flying[0], XferState.DONE, self.now))
            self._end_of_step()
        self.now += 1e6
        self._apply(self.rv.expire(self.now))
        assert len(self.rv) == 0, "an entry (and its record) outlived every deadline"
        assert sorted(p.request_id for p in self.released) == sorted(p.request_id for p in self.prefills)
        # Every registration was answered: pushed, refused, dropped with its peer, or replaced by a later
        # registration of the same D rank before anything was decided for it (the rendezvous keeps the latest).
        latest = {(r.transfer_id, r.engine_id, r.rank): r for r in self.regs}
        for r in self.regs:
            f = self.fate.get(id(r))
            assert f in ("pushed", "refused", "dropped") or latest[(r.transfer_id, r.engine_id, r.rank)] is not r, r
        super().teardown()


TransferMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_transfer_state_machine = TransferMachine.TestCase
