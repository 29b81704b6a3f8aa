"""D's side of a push in rounds (``kvpush.decode.fencing``, ``.incoming``), over every interleaving.

D grants a writer a ring of ``slots`` slots of ``part_bytes``; P writes part ``j`` into slot ``j % slots``
only once D's credits say the part before it there was unpacked. The state machine drives a real
``Fencing`` with one transfer and one writer, and plays a P that follows D's credits as they reach it
(late, or lost and repeated by D's timer): WRITEs land and their notifications arrive in any order, a
notification arrives twice or names a part outside the ring's cut, unpacks land in any order and are
polled, P gives up and D aborts. What D promises:

* a part's unpack starts only after its notification, from that part's slot of the ring, with D's unpack
  list cut to the part's stream range, once per part;
* D credits a prefix of parts only once each of them was unpacked (so a slot P writes again is empty);
  credits only grow, and D repeats its latest on its timer while parts are owed;
* the ring goes back and the transfer is reported only after every unpack started has ended, ok only once
  every part was unpacked exactly once; the transfer is reported once.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.core import protocol
from kvpush.core.outcome import Cause, Failed, PlanKind, Stage
from kvpush.core.rounds import make_ring, slice_pieces
from kvpush.core.staging import FreeSlot
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import (
    AwaitUnpacks,
    Report,
    SendAbort,
    SendCredit,
    SendRegister,
    Stale,
    StartUnpack,
    WaitUnpacks,
)
from kvpush.decode.incoming import Asked

SLOT = 1 << 20
CONN = ("p", 0)
PIECES = np.array([[0, 1000], [4096, 2000], [9000, 512]], dtype=np.int64)  # D's unpack list: 3512 bytes a region
RB = int(PIECES[:, 1].sum())
CREDIT_EVERY = 1.0


@dataclass(eq=False)
class Marker:
    part: int
    reached: bool = False
    fed: bool = False


class UnpackRoundsMachine(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 12), part_bytes=st.sampled_from([1024, 2048, 4096, 8192]), slots=st.integers(1, 4))
    def setup(self, n: int, part_bytes: int, slots: int) -> None:
        self.ring = make_ring(n, RB, part_bytes, slots, 1)
        self.parts = self.ring.parts
        self.fencing = Fencing(n, 1e9, 1e9, credit_every=CREDIT_EVERY)
        self.now = 0.0
        self.grant = protocol.StagingGrant(SLOT, slots * part_bytes, part_bytes, slots)
        self.slot_held = True
        self.p_credit = 0  # the credit P has received
        self.next_write = 0  # P writes parts in order
        self.in_flight: list[int] = []  # posted parts whose bytes have not landed
        self.net: list[protocol.Completion | protocol.Failure] = []
        self.to_p: list[int] = []  # credits on their way to P
        self.sent_credit = 0
        self.unpacks: list[Marker] = []
        self.ended: set[int] = set()  # parts whose unpack ended
        self.started: list[int] = []
        self.reports: list[Report] = []
        self.p_stopped = self.aborted = self.bogus = False
        [reg] = self.fencing.register(Asked("t", "d", ((1,),), 16), {0: CONN}, self.now)
        assert isinstance(reg, SendRegister)
        self.inc = reg.incoming
        self._do(self.fencing.register_sent(self.inc, 0, self.grant, PIECES, RB, True, self.now))

    # -- the receiver's shell ------------------------------------------------------
    def _do(self, actions: list) -> None:
        todo = list(actions)
        while todo:
            todo[:0] = self._act(todo.pop(0))

    def _act(self, a) -> list:
        if isinstance(a, StartUnpack):
            j = a.part.part
            assert not self.reports or not self.reports[-1].result.fenced, f"{a} after the report"
            assert j not in self.started, f"part {j} unpacked twice"
            assert any(c.part == j for c in self.fed), f"part {j} unpacked before its notification"
            tile = self.ring.tiles[j]
            assert (a.r0, a.r1) == (tile.r0, tile.r1) and a.units == (j, j + 1)
            assert a.at == SLOT + (j % self.ring.d_slots) * self.ring.part_bytes, a
            np.testing.assert_array_equal(a.unpack, slice_pieces(PIECES, tile.q0, tile.q1))
            self.started.append(j)
            m = Marker(j)
            self.unpacks.append(m)
            return self.fencing.unpack_started(a, m, 0.0, self.now)
        if isinstance(a, AwaitUnpacks):
            for m in a.markers:  # each answer carried out before the next unpack is looked at
                if not m.reached:
                    break
                m.fed = True
                self.ended.add(m.part)
                self._do(self.fencing.unpacked(self.inc, 0, m, self.now))
            return []
        if isinstance(a, WaitUnpacks):
            for m in a.markers:
                m.reached = m.fed = True
                self.ended.add(m.part)
            return []
        if isinstance(a, SendCredit):
            assert (a.conn, a.transfer_id) == (CONN, "t")
            assert a.parts >= self.sent_credit, "a credit went back"
            assert all(k in self.ended for k in range(a.parts)), f"credited {a.parts} before those parts were unpacked"
            self.sent_credit = a.parts
            self.to_p.append(a.parts)
            return []
        if isinstance(a, FreeSlot):
            assert a.offset == SLOT and self.slot_held
            assert all(m.fed for m in self.unpacks), "the ring went back while an unpack still reads it"
            self.slot_held = False
            return []
        if isinstance(a, Report):
            assert all(m.fed for m in self.unpacks), "reported while an unpack still writes the blocks"
            if a.result.ok:
                assert sorted(self.started) == list(range(self.parts)), "ok without every part unpacked once"
            self.reports.append(a)
            return []
        if isinstance(a, SendAbort):
            self._p_stops(protocol.Failure("t", "d", 0, Stage.TRANSFER, Cause.ABORTED, "aborted by D"))
            return []
        assert isinstance(a, Stale), a
        return []

    @property
    def fed(self) -> list[protocol.Completion]:
        return getattr(self, "_fed", [])

    def _completion(self, j: int) -> protocol.Completion:
        tile = self.ring.tiles[j]
        return protocol.Completion(
            "t", "d", 0, PlanKind.ROUNDS, tile.nbytes, 1, self.grant, region_start=tile.r0, region_end=tile.r1, part=j
        )

    def _p_stops(self, failure: protocol.Failure) -> None:
        if not self.p_stopped:
            self.p_stopped = True
            if not self.in_flight:
                self.net.append(failure)
            else:
                self._pending_failure = failure

    # -- the world ---------------------------------------------------------------------
    @precondition(lambda self: not self.p_stopped and self.next_write < self.parts)
    @rule()
    def p_writes(self) -> None:
        """P posts its next part, if the credits it has let it write that slot."""
        j = self.next_write
        if not self.ring.may_post(j, self.p_credit):
            return
        earlier = j - self.ring.d_slots
        assert earlier < 0 or earlier in self.ended, f"P writes part {j} over part {earlier}, not unpacked yet"
        self.next_write += 1
        self.in_flight.append(j)

    @precondition(lambda self: self.in_flight)
    @rule(which=st.integers(0, 3))
    def write_lands(self, which: int) -> None:
        j = self.in_flight.pop(which % len(self.in_flight))
        self.net.append(self._completion(j))
        if self.p_stopped and not self.in_flight and getattr(self, "_pending_failure", None) is not None:
            self.net.append(self._pending_failure)
            self._pending_failure = None

    @precondition(lambda self: self.net)
    @rule(which=st.integers(0, 3))
    def notification_arrives(self, which: int) -> None:
        msg = self.net.pop(which % len(self.net))
        self.now += 0.01
        if isinstance(msg, protocol.Completion):
            self._fed = [*self.fed, msg]
            self._do(self.fencing.completion(msg, self.now, sender=CONN))
        else:
            self._do(self.fencing.failure(msg, self.now, sender=CONN))

    @precondition(lambda self: self.fed)
    @rule(which=st.integers(0, 3), outside=st.booleans())
    def bogus_notification(self, which: int, outside: bool) -> None:
        """A part announced twice, or one outside the ring's cut: the writer may fail, never unpack twice."""
        self.bogus = True
        msg = self.fed[which % len(self.fed)]
        if outside:
            msg = msgspec.structs.replace(msg, part=self.parts + 3)
        self._do(self.fencing.completion(msg, self.now, sender=CONN))

    @precondition(lambda self: any(not m.reached for m in self.unpacks))
    @rule(which=st.integers(0, 3))
    def unpack_lands(self, which: int) -> None:
        pending = [m for m in self.unpacks if not m.reached]
        pending[which % len(pending)].reached = True
        self._do(self.fencing.poll_unpacks())

    @precondition(lambda self: self.to_p)
    @rule(lost=st.booleans())
    def credit_reaches_p(self, lost: bool) -> None:
        c = self.to_p.pop(0)
        if not lost:
            self.p_credit = max(self.p_credit, c)

    @rule()
    def time_passes(self) -> None:
        self.now += CREDIT_EVERY
        self._do(self.fencing.expire(self.now))

    @precondition(lambda self: not self.p_stopped)
    @rule()
    def p_gives_up(self) -> None:
        self._p_stops(protocol.Failure("t", "d", 0, Stage.POST, Cause.POST_ERROR, "post failed"))

    @precondition(lambda self: not self.aborted)
    @rule()
    def d_aborts(self) -> None:
        self.aborted = True
        self._do(self.fencing.abort("t", Failed(Stage.TRANSFER, Cause.ABORTED, "aborted on D"), self.now))

    @invariant()
    def reported_once(self) -> None:
        assert sum(r.result.fenced for r in self.reports) <= 1

    def teardown(self) -> None:
        """P and the device finish what they owe: the transfer is reported, fenced, once; undisturbed, ok."""
        for _ in range(20 * (self.parts + 2)):
            if any(r.result.fenced for r in self.reports):
                break
            for m in self.unpacks:
                m.reached = True
            self._do(self.fencing.poll_unpacks())
            while self.to_p:
                self.credit_reaches_p(False)
            if not self.p_stopped and self.next_write < self.parts:
                self.p_writes()
            while self.in_flight:
                self.write_lands(0)
            while self.net:
                self.notification_arrives(0)
            self.time_passes()
        assert any(r.result.fenced for r in self.reports), "never reported"
        if not (self.p_stopped or self.aborted or self.bogus):
            assert self.reports[-1].result.ok, self.reports[-1]
        assert not self.slot_held


TestUnpackRounds = UnpackRoundsMachine.TestCase
TestUnpackRounds.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
