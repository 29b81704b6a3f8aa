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

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.protocol import Register
from kvpush.rendezvous import Prefill, Push, Refuse, Release, Rendezvous, TransferState

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
    assert rv.on_abort("nope", now=0.0) == []


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
    rv.on_register(reg(), 0.0)
    assert rv.on_abort("t1", 0.5) == []
    assert len(rv) == 0


def test_abort_before_pairing_prefill_only() -> None:
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    assert rv.on_abort("t1", 0.5, reason="client went away") == [Release(p, "client went away")]
    assert len(rv) == 0


def test_abort_after_push_finished_but_before_release() -> None:
    """Rank 0 pushed, rank 1 never registered: abort releases the prefill now instead of at lease expiry."""
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(rank=0), 0.0, expected=2)
    rv.on_pushed("t1", "d", 0)
    assert rv.on_abort("t1", 1.0) == [Release(p, "aborted")]
    assert len(rv) == 0


def test_abort_while_in_flight_waits_for_the_write() -> None:
    rv = Rendezvous()
    p = prefill()
    rv.on_prefill(p, 0.0)
    rv.on_register(reg(rank=0), 0.0, expected=2)
    assert rv.on_abort("t1", 1.0) == []
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
    rv.on_abort("t1", 1.0)
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
            elif isinstance(d, Refuse):
                assert any(d.reg is r for r in self.registered), "Refuse of an unknown registration"
                assert id(d.reg) not in self.fate, f"Refuse of a {self.fate[id(d.reg)]} registration"
                self.fate[id(d.reg)] = "refused"
                if self.current.get(self._key(d.reg)) is d.reg:
                    del self.current[self._key(d.reg)]
            else:  # pragma: no cover
                raise AssertionError(f"unknown decision {d!r}")

    # -- rules
    @rule(tid=st.sampled_from(TIDS), blocks=st.lists(st.integers(0, 99), min_size=1, max_size=3, unique=True))
    def finish_prefill(self, tid: str, blocks: list[int]) -> None:
        """P (re)finishes a prefill; a fresh request id each time, as a re-issue gets."""
        p = Prefill(tid, f"{tid}-p{next(self.ids)}", (tuple(blocks),), 40)
        self.prefills.append(p)
        self.latest[tid] = p
        self._apply(self.rv.on_prefill(p, self.now))

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
        if any(k[0] == tid for k in self.outstanding):
            self.aborted.add(tid)
        self._apply(self.rv.on_abort(tid, self.now))
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
        assert len(probe) == len({k[0] for k in self.outstanding})

    def teardown(self) -> None:
        """Finish every write, let every deadline pass: all released once, all registrations answered, empty."""
        while self.outstanding:
            self._finish(sorted(self.outstanding)[0])
        self.now += 1e6
        self._apply(self.rv.expire(self.now))
        assert len(self.rv) == 0, f"left behind: {self.rv._entries}"
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
    from kvpush.protocol import Register
    from kvpush.rendezvous import Prefill, Release, Rendezvous

    r = Rendezvous(prefill_lease_s=60)
    reg = Register(transfer_id="t", request_id="d", engine_id="D", rank=0, block_ids=((1,),), num_tokens=8)
    assert r.on_register(reg, now=0.0) == []
    assert r.on_abort("t", now=1.0) == []
    (rel,) = r.on_prefill(Prefill("t", "p", ((3,),), 8), now=2.0)
    assert isinstance(rel, Release) and "aborted" in rel.reason
    assert len(r) == 0
    # The memory of the abort expires with the lease; a new transfer under the id then pairs normally.
    r.expire(now=100.0)
    assert r.on_prefill(Prefill("t", "p2", ((3,),), 8), now=101.0) == []
    assert len(r) == 1
