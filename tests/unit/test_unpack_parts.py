"""D's side of a staged push cut into overlapping parts (``kvpush.decode.fencing``, ``.incoming``), over every
interleaving.

P writes a staged push of ``n`` regions into D's staging slot as ``N``
parts, each its own WRITE with its own notification; D unpacks each part
when its notification arrives, while later parts are still on the wire.
The state machine drives a real ``Fencing`` with one transfer and one
writer through random but legal events: the parts' WRITEs land and their
notifications arrive in any order (NIXL over EFA does not order them), a
notification arrives twice or names regions D does not have, a stale one
names another transfer, unpacks land in any order on their own markers and
are polled or waited for, P gives up (its ``Failure`` after its last WRITE
ended) and D aborts. What D promises, checked on every action:

* a part's unpack starts only after that part's notification was fed in
  (its WRITE landed), from that part's place in the slot, once per part:
  every region is unpacked at most once, and exactly once when it succeeds;
* nothing is unpacked once the writer ended;
* the slot goes back and the transfer is reported only after every unpack
  started has ended (a running unpack still writes the blocks and reads the
  slot); reported ok only after every part's unpack ended, and then each
  region was unpacked exactly once;
* the transfer is reported once.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpush.core import protocol
from kvpush.core.outcome import Cause, Failed, PlanKind, Stage
from kvpush.core.parts import split_regions
from kvpush.core.staging import FreeSlot
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import (
    AwaitUnpacks,
    Report,
    SendAbort,
    SendRegister,
    Stale,
    StartUnpack,
    WaitUnpacks,
)
from kvpush.decode.incoming import Asked

RB = 64
"""Bytes per region in the staged payload."""

SLOT = 8192
CONN = ("p", 0)


@dataclass(eq=False)
class Marker:
    """An unpack's device marker."""

    r0: int
    r1: int
    reached: bool = False
    fed: bool = False  # reported to the fencing as ended (``Fencing.unpacked``)


class UnpackPartsMachine(RuleBasedStateMachine):
    UNPACK_FAILURES = True
    """Whether the backend may refuse an unpack (``test_a_refused_unpack_waits_for_the_parts_unpacking``)."""

    @initialize(n=st.integers(1, 40), parts=st.integers(1, 16))
    def setup(self, n: int, parts: int) -> None:
        self.n = n
        self.cut = split_regions(0, n, parts)  # P's cut (``push_parts=N, min_part_bytes=0``)
        self.fencing = Fencing(n, 1e9, 5.0)
        self.now = 0.0
        self.grant = protocol.StagingGrant(SLOT, n * RB)
        self.slot_held = True
        self.unwritten = list(self.cut)  # parts whose WRITE has not landed yet
        self.net: list[protocol.Completion | protocol.Failure] = []  # notifications on their way, any order
        self.fed: list[tuple[int, int]] = []  # parts whose notification D was given
        self.unpacks: list[Marker] = []  # started, in order
        self.started: set[tuple[int, int]] = set()
        self.per_region = [0] * n  # unpacks started per region
        self.reports: list[Report] = []
        self.p_stopped = False  # P gave up: writes nothing more
        self.bogus = False  # a duplicate or foreign notification reached D: the writer may fail
        self.aborted = False
        self.unpack_fails = False  # the backend refuses the next unpack (``StartUnpack`` answered ``writer_failed``)
        [reg] = self.fencing.register(Asked("t", "d", ((1,),), 16), {0: CONN}, self.now)
        assert isinstance(reg, SendRegister)
        self.inc = reg.incoming
        self._do(self.fencing.register_sent(self.inc, 0, self.grant, "pieces", RB, True, self.now))

    # -- the receiver's shell ------------------------------------------------------------
    def _do(self, actions: list) -> None:
        todo = list(actions)
        while todo:
            todo[:0] = self._act(todo.pop(0))

    def _act(self, a) -> list:
        if isinstance(a, StartUnpack):
            return self._start_unpack(a)
        if isinstance(a, AwaitUnpacks):
            running = [m for m in self.unpacks if not m.fed]
            assert list(a.markers) == running, "AwaitUnpacks lists the writer's unpacks running, oldest first"
            if a.block:
                for m in a.markers:
                    m.reached = True  # the shell waits for them
            out: list = []
            for m in a.markers:
                if not m.reached:
                    break
                m.fed = True
                out += self.fencing.unpacked(self.inc, 0, m, self.now)
            return out
        if isinstance(a, WaitUnpacks):
            for m in a.markers:
                m.reached = True
        elif isinstance(a, FreeSlot):
            assert a.offset == SLOT and self.slot_held, "the slot freed twice"
            assert all(m.reached for m in self.unpacks), "the slot freed while an unpack still reads it"
            self.slot_held = False
        elif isinstance(a, Report):
            self._report(a)
        elif isinstance(a, SendAbort):
            self._p_stops(protocol.Failure("t", "d", 0, Stage.TRANSFER, Cause.ABORTED, "aborted by D"))
        else:
            assert isinstance(a, Stale), a
        return []

    def _start_unpack(self, a: StartUnpack) -> list:
        part = (a.r0, a.r1)
        assert not self.reports, f"{a} after the transfer was reported"
        assert part in self.fed, f"unpack of {part} before its notification arrived (its WRITE may not have landed)"
        assert part not in self.started, f"unpack of {part} started twice"
        assert (a.part.region_start, a.part.region_end) == part and a.part.staging == self.grant, a
        assert (a.at, a.units, a.unpack) == (SLOT + a.r0 * RB, part, "pieces"), a
        assert a.incoming is self.inc and a.p_rank == 0
        if self.unpack_fails:
            self.unpack_fails = False
            why = Failed(Stage.UNPACK, Cause.OTHER, "unpack failed: device error")
            return self.fencing.writer_failed(self.inc, 0, why, self.now)
        self.started.add(part)
        for r in range(*part):
            self.per_region[r] += 1
            assert self.per_region[r] == 1, f"region {r} unpacked twice"
        m = Marker(*part)
        self.unpacks.append(m)
        return self.fencing.unpack_started(a, m, 0.0, self.now)

    def _report(self, a: Report) -> None:
        assert a.incoming is self.inc
        assert not self.reports, "reported twice"
        assert a.result.fenced, "an early report with no writer quarantined"
        assert all(m.reached for m in self.unpacks), "reported while an unpack still writes the blocks"
        self.reports.append(a)
        if a.result.ok:
            assert sorted(self.started) == self.cut, f"reported ok with parts {sorted(self.started)} of {self.cut}"
            assert all(m.fed for m in self.unpacks), "reported ok before every part's unpack was seen to end"
            assert self.per_region == [1] * self.n, self.per_region
            assert a.result.stats.parts == len(self.cut), a.result.stats

    def _p_stops(self, failure: protocol.Failure) -> None:
        """P writes no more parts and says so once its last WRITE ended (after the notifications already sent)."""
        if self.p_stopped:
            return
        self.p_stopped = True
        self.unwritten = []
        self.net.append(failure)

    def _completion(self, r0: int, r1: int, tid: str = "t") -> protocol.Completion:
        return protocol.Completion(tid, "d", 0, PlanKind.STAGED, (r1 - r0) * RB, 1, self.grant, 0, r0, r1)

    # -- the world ---------------------------------------------------------------------
    @precondition(lambda self: self.unwritten)
    @rule(which=st.integers(0, 15))
    def a_write_lands(self, which: int) -> None:
        """Any part's WRITE lands; its notification follows (after the bytes)."""
        r0, r1 = self.unwritten.pop(which % len(self.unwritten))
        self.net.append(self._completion(r0, r1))

    @precondition(lambda self: self.net)
    @rule(which=st.integers(0, 15))
    def a_message_arrives(self, which: int) -> None:
        """Notifications (and P's failure) arrive in any order."""
        self.now += 0.001
        msg = self.net.pop(which % len(self.net))
        if isinstance(msg, protocol.Completion):
            self.fed.append((msg.region_start, msg.region_end))
            self._do(self.fencing.completion(msg, self.now, sender=CONN))
        else:
            self._do(self.fencing.failure(msg, self.now, sender=CONN))

    @precondition(lambda self: self.fed)
    @rule(which=st.integers(0, 15))
    def a_notification_arrives_twice(self, which: int) -> None:
        """A duplicate: D refuses it (the writer fails); it never starts a second unpack of the part."""
        self.bogus = True
        r0, r1 = self.fed[which % len(self.fed)]
        self._do(self.fencing.completion(self._completion(r0, r1), self.now, sender=CONN))

    @rule(kind=st.sampled_from(["outside", "other transfer"]))
    def an_unknown_part_arrives(self, kind: str) -> None:
        """Regions past D's (the writer fails, nothing is unpacked) or a transfer D has no record of (stale)."""
        if kind == "outside":
            self.bogus = True
            msg = self._completion(self.n, self.n + 1)
        else:
            msg = self._completion(0, 1, tid="other")
        self._do(self.fencing.completion(msg, self.now, sender=CONN))

    @precondition(lambda self: any(not m.reached for m in self.unpacks))
    @rule(which=st.integers(0, 15))
    def an_unpack_lands(self, which: int) -> None:
        """Any running unpack lands, not only the oldest (each on its own marker)."""
        left = [m for m in self.unpacks if not m.reached]
        left[which % len(left)].reached = True

    @rule()
    def poll(self) -> None:
        """The receiver's loop looks at the unpacks running."""
        self._do(self.fencing.poll_unpacks())

    @precondition(lambda self: not self.p_stopped)
    @rule()
    def p_gives_up(self) -> None:
        self._p_stops(protocol.Failure("t", "d", 0, Stage.PACK, Cause.POST_ERROR, "pack failed"))

    @precondition(lambda self: self.UNPACK_FAILURES and not self.bogus)
    @rule()
    def the_next_unpack_fails_to_start(self) -> None:
        self.bogus = self.unpack_fails = True

    @precondition(lambda self: not self.aborted)
    @rule()
    def d_aborts(self) -> None:
        self.aborted = True
        self._do(self.fencing.abort("t", Failed(Stage.TRANSFER, Cause.ABORTED, "client went away"), self.now))

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def unpacks_follow_notifications(self) -> None:
        assert self.started <= set(self.fed)
        assert all(c <= 1 for c in self.per_region)

    def teardown(self) -> None:
        """Everything lands and arrives, every unpack ends: one report; an undisturbed transfer is ok."""
        if not hasattr(self, "inc"):
            return
        for _ in range(4 * self.n + 8):
            while self.unwritten:
                self.a_write_lands(0)
            while self.net:
                self.a_message_arrives(0)
            for m in self.unpacks:
                m.reached = True
            self.poll()
            if self.reports:
                break
        assert len(self.reports) == 1, "never reported"
        assert not self.slot_held, "the slot was never freed"
        assert not self.fencing.current and self.fencing.poll_unpacks() == [], "the transfer is still tracked"
        if not (self.p_stopped or self.bogus or self.aborted):
            assert self.reports[0].result.ok, self.reports[0].result


UnpackPartsMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)
test_unpack_parts_state_machine = UnpackPartsMachine.TestCase


def test_a_refused_unpack_waits_for_the_parts_unpacking() -> None:
    """Part 0's unpack runs; the backend refuses part 1's (``StartUnpack`` answered ``writer_failed`` at stage
    UNPACK). The writer fails, but part 0's unpack still writes the blocks and reads the slot: D must wait for
    it before the slot goes back and the blocks are reported. ``Incoming.writer_failed`` clears the writer's
    running unpacks on any UNPACK failure ("a failed unpack cannot be waited for") before, so with overlapping parts
    it let go of the slot and the blocks under a running unpack."""
    m = UnpackPartsMachine()
    m.setup(n=2, parts=2)
    m.a_write_lands(0)
    m.a_message_arrives(0)
    assert [(u.r0, u.r1, u.reached) for u in m.unpacks] == [(0, 1, False)]
    m.unpack_fails = True
    m.a_write_lands(0)
    m.a_message_arrives(0)  # _act checks every unpack ended before FreeSlot and Report
    assert len(m.reports) == 1 and not m.reports[0].result.ok
