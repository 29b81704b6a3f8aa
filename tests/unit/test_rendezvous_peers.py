"""P's rules about *who*: a transfer belongs to the D key that registered it first (only that key may
register it again or abort it), and each D rank's holdings are bounded (open registrations, block ids,
registration rate, tombstones its aborts leave). Sans-I/O, driven by hypothesis over every interleaving
of honest D ranks, an intruder with a key of its own, prefills, WRITEs ending, aborts, dead peers and time."""

from __future__ import annotations

import itertools

from helpers_rendezvous import check_holdings
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.core.limits import PeerLimits
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.protocol import Register
from kvpush.prefill.decisions import Prefill, Push, Refuse, Release
from kvpush.prefill.rendezvous import Rendezvous

TIDS = ("t0", "t1", "t2")
EXPECTED = {"t0": 1, "t1": 2, "t2": 1}  # t1 waits for two D ranks: a lease can run out with one pushed
RANKS = (("dA", 0), ("dA", 1), ("dB", 0), ("intruder", 0))
KEY = {"dA": "key-A", "dB": "key-B", "intruder": "key-X"}
LIMITS = PeerLimits(
    max_registrations=2, max_block_ids=4, registrations_per_s=1e9, max_tombstones=3, max_peer_tombstones=2
)


def reg(tid: str, who: tuple[str, int], nblocks: int, serial: int, attempt: int = 0) -> Register:
    blocks = tuple(range(serial * 10, serial * 10 + nblocks))
    return Register(tid, f"{tid}-d", who[0], who[1], (blocks,), 16 * nblocks, lease_ms=4000, attempt=attempt)


def test_a_registration_from_another_key_is_refused_and_changes_nothing() -> None:
    rv = Rendezvous()
    victim = reg("t", ("dA", 0), 2, 1)
    assert rv.on_register(victim, 0.0, owner="key-A") == []
    thief = reg("t", ("dX", 0), 2, 2)
    [refuse] = rv.on_register(thief, 0.1, owner="key-X")
    assert isinstance(refuse, Refuse) and refuse.reg is thief and refuse.cause is Cause.REFUSED
    [push] = rv.on_prefill(Prefill("t", "p", ((5, 6),), 32), 0.2)
    assert isinstance(push, Push) and push.reg is victim


def test_a_parked_prefill_goes_to_the_first_key_only() -> None:
    rv = Rendezvous()
    rv.on_prefill(Prefill("t", "p", ((5, 6),), 32), 0.0)
    [push] = rv.on_register(reg("t", ("dA", 0), 2, 1), 0.1, owner="key-A")
    assert isinstance(push, Push)
    [refuse] = rv.on_register(reg("t", ("dX", 0), 2, 2), 0.2, owner="key-X")
    assert isinstance(refuse, Refuse)


def test_only_the_owner_may_abort_a_registered_transfer() -> None:
    rv = Rendezvous()
    rv.on_register(reg("t", ("dA", 0), 2, 1), 0.0, owner="key-A")
    assert "another D" in rv.may_abort("t", "key-X", ("dX", 0))
    assert rv.may_abort("t", "key-A", ("dA", 0)) == ""
    # nothing registered yet: any D may cancel (it gave up before it had blocks)
    rv.on_prefill(Prefill("parked", "p", ((5,),), 16), 0.0)
    assert rv.may_abort("parked", "key-X", ("dX", 0)) == ""
    assert rv.may_abort("never-seen", "key-X", ("dX", 0)) == ""


def test_aborts_of_unregistered_transfers_leave_a_bounded_number_of_tombstones() -> None:
    limits = PeerLimits(max_tombstones=100, max_peer_tombstones=3)
    rv = Rendezvous(limits=limits)
    for i in range(10):
        if rv.may_abort(f"u{i}", "key-X", ("dX", 0)) == "":
            rv.cancel(f"u{i}", 0.0, Failed(Stage.RENDEZVOUS, Cause.ABORTED, "x"), by=("dX", 0))
    assert rv.tombstones() == 3
    assert "limit 3" in rv.may_abort("u9", "key-X", ("dX", 0))
    assert rv.may_abort("u0", "key-X", ("dX", 0)) == ""  # an abort again of one it left costs nothing new
    assert rv.may_abort("u9", "key-B", ("dB", 0)) == ""  # another D rank has its own budget
    rv.expire(1e9)
    assert rv.tombstones() == 0 and rv.may_abort("u9", "key-X", ("dX", 0)) == ""


def test_limits_refuse_with_their_reason() -> None:
    rv = Rendezvous(limits=LIMITS)
    assert rv.on_register(reg("a", ("dA", 0), 3, 1), 0.0, owner="key-A") == []
    [r] = rv.on_register(reg("b", ("dA", 0), 2, 2), 0.0, owner="key-A")
    assert r.cause is Cause.OVER_LIMIT and "block ids" in r.reason
    assert rv.on_register(reg("b", ("dA", 0), 1, 3), 0.0, owner="key-A") == []
    [r] = rv.on_register(reg("c", ("dA", 0), 0, 4), 0.0, owner="key-A")
    assert r.cause is Cause.OVER_LIMIT and "open registrations" in r.reason
    # a re-registration of the same transfer replaces the earlier one: no new registration, no new ids
    [replaced] = rv.on_register(reg("b", ("dA", 0), 1, 5, attempt=1), 0.0, owner="key-A")
    assert replaced.cause is Cause.SUPERSEDED and replaced.reg.attempt == 0
    # another D rank has its own budget; a tighter cap (its cache) applies to it
    [r] = rv.on_register(reg("c", ("dB", 0), 3, 6), 0.0, owner="key-B", cap=2)
    assert "limit 2" in r.reason
    slow = Rendezvous(limits=PeerLimits(registrations_per_s=2.0))
    assert [slow.on_register(reg(f"r{i}", ("dA", 0), 1, i), 0.0, owner="k") for i in range(3)][2][0].cause is (
        Cause.OVER_LIMIT
    )
    assert slow.on_register(reg("r9", ("dA", 0), 1, 9), 1.0, owner="k") == []


def test_tombstones_are_bounded() -> None:
    rv = Rendezvous(limits=LIMITS)
    for i in range(10):
        rv.cancel(f"gone-{i}", 0.0, Failed(Stage.RENDEZVOUS, Cause.ABORTED, "x"))  # P's own: only the total bound
    assert rv.tombstones() == LIMITS.max_tombstones
    # the newest are kept: a prefill of the last aborted transfer is still released at once
    [release] = rv.on_prefill(Prefill("gone-9", "p", ((1,),), 16), 0.1)
    assert isinstance(release, Release)


class PeersMachine(RuleBasedStateMachine):
    """Honest D ranks (two keys) and an intruder (a key of its own) register, re-register and abort in any
    order with prefills, WRITEs ending and time; small limits so they bite."""

    def __init__(self) -> None:
        super().__init__()
        self.rv = Rendezvous(prefill_lease_s=5.0, limits=LIMITS)
        self.now = 0.0
        self.serial = itertools.count(1)
        self.attempt = itertools.count(1)
        self.flying: set[tuple[str, str, int]] = set()
        self.owner: dict[str, str] = {}  # tid -> the key of the first registration taken since the entry appeared

    def _forget_gone(self) -> None:
        for tid in list(self.owner):
            if self.rv.stage(tid) is None:
                del self.owner[tid]

    def _apply(self, decisions: list, owner: str | None = None, tid: str | None = None) -> None:
        for d in decisions:
            if isinstance(d, Push):
                key = (d.reg.transfer_id, d.reg.engine_id, d.reg.rank)
                assert KEY[d.reg.engine_id] == self.owner[d.reg.transfer_id], "pushed to a D that does not own it"
                self.flying.add(key)
        self._forget_gone()

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(RANKS), nblocks=st.integers(0, 3), again=st.booleans())
    def register(self, tid: str, who: tuple[str, int], nblocks: int, again: bool) -> None:
        r = reg(tid, who, nblocks, next(self.serial), next(self.attempt) if again else 0)
        known = self.rv.stage(tid) is not None
        out = self.rv.on_register(r, self.now, expected=EXPECTED[tid], owner=KEY[who[0]])
        taken = not any(isinstance(d, Refuse) and d.reg is r for d in out)
        if taken and tid not in self.owner:
            self.owner[tid] = KEY[who[0]]
        if taken:
            assert self.owner[tid] == KEY[who[0]], "a second key's registration was taken"
        elif known and self.owner.get(tid) not in (None, KEY[who[0]]):
            pass  # refused as the non-owner it is
        self._apply(out)

    @rule(tid=st.sampled_from(TIDS))
    def prefill(self, tid: str) -> None:
        self._apply(self.rv.on_prefill(Prefill(tid, f"{tid}-p{next(self.serial)}", ((1, 2, 3),), 40), self.now))

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def written(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.flying)))
        self.flying.discard(key)
        self._apply(self.rv.on_pushed(*key))

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(RANKS))
    def remote_abort(self, tid: str, who: tuple[str, int]) -> None:
        key = KEY[who[0]]
        if self.rv.may_abort(tid, key, who) == "":
            assert self.owner.get(tid) in (None, key), "an abort allowed to a key that does not own the transfer"
            self._apply(self.rv.cancel(tid, self.now, Failed(Stage.RENDEZVOUS, Cause.ABORTED, "x"), by=who))

    @rule(who=st.sampled_from(RANKS))
    def peer_gone(self, who: tuple[str, int]) -> None:
        """A D rank is forgotten (dead, or said hello again): what it registered goes."""
        self._apply(self.rv.drop_peer(who, self.now, "declared dead"))

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.rv.expire(self.now))

    @invariant()
    def holdings_are_what_the_entries_hold(self) -> None:
        check_holdings(self.rv, TIDS, RANKS)

    @invariant()
    def tombstones_are_bounded_and_counted(self) -> None:
        assert self.rv.tombstones() <= LIMITS.max_tombstones
        for k in RANKS:
            assert self.rv.tombstones(by=k) <= LIMITS.max_peer_tombstones, k
        assert sum(self.rv.tombstones(by=k) for k in RANKS) <= self.rv.tombstones()

    @invariant()
    def no_rank_over_its_limits(self) -> None:
        for k in RANKS:
            n, ids = self.rv.holdings.held(k)
            assert n <= LIMITS.max_registrations and ids <= LIMITS.max_block_ids, (k, n, ids)


PeersMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_peers_state_machine = PeersMachine.TestCase
