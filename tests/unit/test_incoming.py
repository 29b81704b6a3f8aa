"""D's fencing (``kvpush.decode.fencing``, ``.incoming``): when D may report a transfer, over every interleaving.

The state machine plays the receiver thread, the network and an honest P
around a real ``Fencing``: D registers (and re-registers, a new attempt),
connections come up or are refused, P writes parts (direct or staged, in any
order, each its own completion), acknowledges registrations (queued,
running), answers aborts, forgets D (dropping what it had not started and
refusing D's next registrations for want of a hello, to which D says hello
again and registers once more), supersedes old attempts the way P does (a new
attempt is written only after the previous one's WRITE ended), or freezes
and is declared dead -- and may then resume and go on writing, as a P
stopped by SIGSTOP does; unpacks land whenever the device says so. The
central invariant: **D gives a transfer's blocks back (a fenced Report)
only when no writer can still write into them** (it finished, failed,
answered an abort, was fenced by a hello it answered after its WRITEs
ended, or never got the registration), after every unpack into them ended.
Never on a timer: a P may stay frozen for any time and resume, and a P
killed for good keeps its quarantined blocks out (reported ``Overdue`` once,
after ``quarantine_s``) until a P restarted at its address answers a hello
or the operator fences it for good (``Fencing.fenced_for_good``, only ever
for a P rank that was killed).
Each attempt is reported once (plus once early, failed, while a writer is
quarantined),
every staging slot freed exactly once, a transfer reported ok has every
region of every writer, and D gives up on a transfer P vouches for only at
the hard cap.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.core import protocol
from kvpush.core.outcome import Cause, Failed, PlanKind, PrefillState, Stage
from kvpush.core.staging import FreeSlot
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import (
    Acknowledged,
    AwaitUnpacks,
    Cancel,
    Foreign,
    HelloAgain,
    Overdue,
    Report,
    SendAbort,
    SendRegister,
    Stale,
    StartUnpack,
    WaitUnpacks,
)
from kvpush.decode.incoming import Asked, Incoming
from kvpush.decode.link import Dead, Ready, Refused

NREGIONS = 4
TIDS = ("t0", "t1")
P_RANKS = (0, 1)
PEER_DEAD_S = 5.0
TIMEOUT_S = 30.0
HARD_CAP_S = 100.0
QUARANTINE_S = 60.0


@dataclass(eq=False)
class Marker:
    reached: bool = False


@dataclass
class Session:
    """What P knows of one registration it received: (transfer, attempt, P rank)."""

    tid: str
    attempt: int
    p: int
    staged: bool
    grant: protocol.StagingGrant | None
    left: list[tuple[int, int]]  # parts not written yet
    writing: bool = True  # P may still write into D's blocks
    aborted: bool = False  # D's abort reached P
    answered: bool = False  # P sent its failure/abort answer


@dataclass
class Network:
    """Messages on their way to D, delivered in any order."""

    msgs: list[protocol.Completion | protocol.Failure] = field(default_factory=list)


class FencingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fencing = Fencing(NREGIONS, TIMEOUT_S, PEER_DEAD_S, HARD_CAP_S, QUARANTINE_S)
        self.now = 0.0
        self.conns: dict[int, str] = {}  # P rank -> "pending" | "ready" | "refused" | "dead"
        self.epoch: dict[int, int] = {}  # P rank -> the epoch of D's latest hello to it
        self.answered_ok: dict[int, list[int]] = {}  # P rank -> the epochs of the hellos P answered ok
        self.failed_early: set[int] = set()  # id(incoming) reported failed while a writer was quarantined
        self.vouched: dict[int, float] = {}  # id(incoming) -> when it was registered, once P vouched for it
        self.sessions: list[Session] = []
        self.net = Network()
        self.slots = itertools.count(4096, 4096)
        self.granted: dict[int, bool] = {}  # offset -> still held
        self.unpacks: dict[int, list[Marker]] = {}  # id(incoming) -> unpack markers started
        self.reported: dict[int, Report] = {}  # id(incoming) -> its report
        self.incomings: list[Incoming] = []
        self.dead: set[int] = set()  # P ranks killed (they never write nor answer again, until they restart)
        self.overdue: set[tuple[int, int]] = set()  # (id(incoming), P rank) reported overdue
        self.shape: dict[int, tuple[bool, bool]] = {}  # id(incoming) -> (staged, two parts)
        self.forgot: set[int] = set()  # P ranks that forgot this D rank and have not had a hello from it since
        self.refused_unknown: dict[tuple[str, int, int], int] = {}  # (tid, attempt, P rank) -> refusals for no hello

    # -- the receiver's shell -------------------------------------------------------
    def _do(self, actions: list) -> None:
        todo = list(actions)
        while todo:
            todo[:0] = self._act(todo.pop(0))

    def _act(self, a) -> list:
        if isinstance(a, SendRegister):
            return self._send_register(a)
        if isinstance(a, SendAbort):
            inc = a.incoming
            assert (a.conn, a.transfer_id, a.attempt) == (("p", a.p_rank), inc.transfer_id, inc.attempt), a
            if self.conns.get(a.p_rank) == "ready":
                for s in self._sessions_of(inc, a.p_rank):
                    s.aborted = True
                return []
            if self.conns.get(a.p_rank) == "dead":
                for s in self._sessions_of(inc, a.p_rank):
                    s.aborted = True  # queued on the link: a frozen P reads it when it resumes
            return self.fencing.unreachable(inc, a.p_rank, a.reason, self.now)
        if isinstance(a, StartUnpack):
            w = a.incoming.writers[a.p_rank]
            at = w.grant.offset + a.r0 * 16 if w.grant is not None else None
            assert (a.at, a.units, a.unpack) == (at, (a.r0, a.r1), "pieces"), a
            m = Marker()
            self.unpacks.setdefault(id(a.incoming), []).append(m)
            return self.fencing.unpack_started(a, m, 0.0, self.now)
        if isinstance(a, AwaitUnpacks):
            w = a.incoming.writers[a.p_rank]
            assert a.markers == tuple(u[2] for u in w.unpacking), "the action carries the unpacks running"
            if a.block:
                for m in a.markers:
                    m.reached = True
            out: list = []
            for m in a.markers:
                if not m.reached:
                    break
                out += self.fencing.unpacked(a.incoming, a.p_rank, m, self.now)
            return out
        if isinstance(a, WaitUnpacks):
            for m in a.markers:
                m.reached = True
        elif isinstance(a, FreeSlot):
            assert self.granted.get(a.offset), f"slot {a.offset} freed twice or never granted"
            self.granted[a.offset] = False
        elif isinstance(a, HelloAgain):
            p = a.conn[1]
            assert any(k[2] == p for k in self.refused_unknown), f"hello again without P's word: {a}"
            if self.conns.get(p) == "ready":  # the link's next registration says hello (a new epoch)
                self.conns[p] = "pending"
                self.epoch[p] += 1
        elif isinstance(a, Report):
            self._on_report(a)
        elif isinstance(a, Overdue):
            w = a.incoming.writers[a.p_rank]
            assert w.quarantined and self.now >= w.q_until, f"overdue before its time: {w}"
            assert a.blocks == a.incoming.quarantined_blocks() and a.conn == w.conn
            key = (id(a.incoming), a.p_rank)
            assert key not in self.overdue, "overdue reported twice"
            self.overdue.add(key)
        else:
            assert isinstance(a, Stale | Cancel | Acknowledged), a
        return []

    def _send_register(self, a: SendRegister) -> list:
        inc = a.incoming
        if inc not in self.incomings:
            self.incomings.append(inc)
        if a.p_rank not in self.conns:
            self.epoch[a.p_rank] = self.epoch.get(a.p_rank, 0) + 1
        state = self.conns.setdefault(a.p_rank, "pending")
        if state == "dead":  # the shell says hello again (a fencing hello: a new epoch)
            state = self.conns[a.p_rank] = "pending"
            self.epoch[a.p_rank] += 1
        conn = ("p", a.p_rank)
        assert (a.conn, a.asked, a.attempt) == (conn, inc.asked, inc.attempt), a
        if state == "refused":
            return self.fencing.refused(inc, conn, "P refused the handshake", self.now)
        if state != "ready":
            return []
        staged, split = self.shape[id(inc)]
        grant = protocol.StagingGrant(next(self.slots), 64) if staged else None
        if grant is not None:
            self.granted[grant.offset] = True
        parts = [(0, 1), (1, NREGIONS)] if split else [(0, NREGIONS)]
        s = Session(inc.transfer_id, inc.attempt, a.p_rank, staged, grant, parts)
        self.sessions.append(s)
        if a.p_rank in self.forgot:  # P knows no hello of this D rank: the registration goes nowhere
            s.writing, s.answered = False, True
            key = (inc.transfer_id, inc.attempt, a.p_rank)
            self.refused_unknown[key] = self.refused_unknown.get(key, 0) + 1
            why = "registration before a successful hello from this D rank"
            self.net.msgs.append(protocol.Failure(s.tid, "p", s.p, Stage.HANDSHAKE, Cause.REFUSED, why, s.attempt))
        return self.fencing.register_sent(inc, a.p_rank, grant, "pieces", 16, True, self.now)

    def _sessions_of(self, inc: Incoming, p: int) -> list[Session]:
        return [s for s in self.sessions if (s.tid, s.attempt, s.p) == (inc.transfer_id, inc.attempt, p)]

    def _on_report(self, a: Report) -> None:
        inc = a.incoming
        assert id(inc) not in self.reported, f"{inc.transfer_id} attempt {inc.attempt} reported twice"
        assert a.blocks == inc.quarantined_blocks(), "the report carries the blocks it withholds"
        if a.result.cause is Cause.EXPIRED and a.result.reason.startswith(("no KV", "P kept")):
            waited = TIMEOUT_S if id(inc) not in self.vouched else HARD_CAP_S
            assert self.now >= inc.times.registered + waited, f"gave up after {self.now} on {a.result}"
        assert all(m.reached for m in self.unpacks.get(id(inc), [])), "reported while an unpack still runs"
        if not a.result.fenced:
            assert not a.result.ok and id(inc) not in self.failed_early, "failed early twice"
            assert all(w.final or w.quarantined for w in inc.writers.values())
            assert any(w.quarantined for w in inc.writers.values())
            self.failed_early.add(id(inc))
            return
        self.reported[id(inc)] = a
        for p in inc.writers:
            for s in self._sessions_of(inc, p):
                assert not s.writing, f"blocks given back while P rank {p} may still write {s}"
        if a.result.ok:
            for w in inc.writers.values():
                assert w.covered is not None and w.covered.count(1) == NREGIONS, w

    def _step(self) -> None:
        self._do(self.fencing.poll_unpacks())

    # -- D's caller ---------------------------------------------------------------------
    @rule(
        tid=st.sampled_from(TIDS),
        ranks=st.sampled_from([(0,), (1,), (0, 1)]),
        staged=st.booleans(),
        split=st.booleans(),
    )
    def register(self, tid: str, ranks: tuple[int, ...], staged: bool, split: bool) -> None:
        """D allocates blocks for a request (again while it is pending: a re-issue, the next attempt); P will
        write it ``staged`` (D unpacks) or not, in one part or two."""
        if tid not in self.fencing.current and any(i.transfer_id == tid for i in self.incomings):
            return  # that request is over; the router never reuses its transfer id
        writers = {p: ("p", p) for p in ranks}
        actions = self.fencing.register(Asked(tid, f"r-{tid}", ((1, 2),), 32), writers, self.now)
        self.shape[id(self.fencing.current[tid])] = (staged, split)
        self._do(actions)

    @rule(tid=st.sampled_from(TIDS))
    def abort(self, tid: str) -> None:
        self._do(self.fencing.abort(tid, Failed(Stage.TRANSFER, Cause.ABORTED, "client went away"), self.now))

    @rule(tid=st.sampled_from(TIDS))
    def cancel(self, tid: str) -> None:
        """D gives up on a request that may not have its blocks yet (the connector's cancel)."""
        why = Failed(Stage.TRANSFER, Cause.ABORTED, "request aborted on D before it got blocks")
        self._do(self.fencing.cancel(tid, f"r-{tid}", {0: ("p", 0)}, why, self.now))

    @rule(dt=st.sampled_from([0.5, PEER_DEAD_S, TIMEOUT_S, QUARANTINE_S, HARD_CAP_S]))
    def time_passes(self, dt: float) -> None:
        """Time passes; a frozen P may stay frozen through any of it (nothing here ends a session)."""
        self.now += dt
        self._do(self.fencing.expire(self.now))

    @precondition(lambda self: any(v == "dead" and k not in self.dead for k, v in self.conns.items()))
    @rule(data=st.data())
    def p_killed(self, data) -> None:
        """A P rank D declared dead is killed for good: it never writes nor answers again (D cannot tell it
        from a frozen one)."""
        p = data.draw(st.sampled_from(sorted(k for k, v in self.conns.items() if v == "dead" and k not in self.dead)))
        self._kill(p)

    def _kill(self, p: int) -> None:
        self.dead.add(p)
        for s in self.sessions:
            if s.p == p:
                s.writing, s.answered = False, True  # the process is gone: no WRITE, no answer

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def operator_fences(self, data) -> None:
        """The orchestrator kills a P rank for good (if it is not dead already) and an operator fences it
        (``kvpush fence``): its writers end now, quarantined or still waited on, and D's link to it is dropped
        (the next registration says hello afresh). Only a killed P rank is fenced: that is the operator's word."""
        p = data.draw(st.sampled_from(sorted(self.conns)))
        self._kill(p)
        conn = ("p", p)
        self._do(self.fencing.fenced_for_good({conn}, f"P rank {p} fenced for good", self.now))
        for inc in [*self.fencing.current.values(), *self.fencing.superseded]:
            for w in inc.writers.values():
                assert w.conn != conn or w.final, f"a writer of a fenced P rank still counts: {w}"
        assert not self.fencing.quarantined_on(conn) and not self.fencing.writes_on(conn)
        self.conns[p] = "dead"  # the link is gone: the next registration dials afresh (a new epoch)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def p_restarts(self, data) -> None:
        """A killed P rank starts again at its address: it knows no registration, so it answers hellos ok."""
        self.dead.discard(data.draw(st.sampled_from(sorted(self.dead))))

    # -- connections --------------------------------------------------------------------
    def _answering(self) -> list[int]:
        return sorted(k for k, v in self.conns.items() if v == "pending" and k not in self.dead)

    @precondition(lambda self: self._answering())
    @rule(data=st.data(), ok=st.booleans())
    def hello_answered(self, data, ok: bool) -> None:
        p = data.draw(st.sampled_from(self._answering()))
        ok = ok or data.draw(st.booleans())
        if any(s.writing for s in self.sessions if s.p == p):
            ok = False  # P's rule: no hello from a D rank is answered ok while an older session's WRITE flies
        self.conns[p] = "ready" if ok else "refused"
        conn = ("p", p)
        if self.conns[p] == "ready":
            self.forgot.discard(p)
            self.answered_ok.setdefault(p, []).append(self.epoch[p])
            for s in self.sessions:
                if s.p == p:
                    s.answered = True  # P dropped the older session's registrations: never written now
            self._do(self.fencing.on_link(Ready(conn, self.epoch[p]), self.now))
        else:
            self._do(self.fencing.on_link(Refused(conn, "P refused the handshake", busy=False), self.now))

    def _late_replies(self) -> list[int]:
        return sorted(k for k, v in self.conns.items() if v in ("dead", "pending") and k in self.answered_ok)

    @precondition(lambda self: self._late_replies())
    @rule(data=st.data())
    def stale_hello_reply(self, data) -> None:
        """The ok reply to an earlier hello (the session in which P was declared dead, or one before it) arrives
        again, late (the shell drops those; fencing must not take it as a fencing answer either: P may still write the
        registrations of that session). Only a reply P did send: P answers a hello once, and ok only while none
        of its earlier WRITEs fly."""
        p = data.draw(st.sampled_from(self._late_replies()))
        older = data.draw(st.sampled_from(self.answered_ok[p]))
        self._do(self.fencing.fenced(("p", p), older, self.now))

    @precondition(lambda self: any(v in ("ready", "pending") for v in self.conns.values()))
    @rule(data=st.data())
    def p_declared_dead(self, data) -> None:
        """P falls silent for ``peer_dead_s`` (frozen: it may resume and go on writing); D declares it dead
        while it waits on it."""
        p = data.draw(st.sampled_from(sorted(k for k, v in self.conns.items() if v in ("ready", "pending"))))
        if self.conns[p] == "ready" and not self.fencing.writes_on(("p", p)):
            return  # D declares a silent P dead only while a writer waits on it
        self.conns[p] = "dead"
        self._do(self.fencing.on_link(Dead(("p", p), f"P rank {p} declared dead", self.epoch[p], ""), self.now))

    @precondition(lambda self: any(v == "ready" and k not in self.dead for k, v in self.conns.items()))
    @rule(data=st.data())
    def p_forgets_d(self, data) -> None:
        """P gives this D rank up (D silent past P's ``peer_dead_s``, its link still live to D): P drops the
        registrations it had not started writing, without a word, and refuses D's next ones for want of a
        hello (the first refusal of a writer has D say hello again and register once more)."""
        p = data.draw(st.sampled_from(sorted(k for k, v in self.conns.items() if v == "ready" and k not in self.dead)))
        self.forgot.add(p)
        for s in self.sessions:
            full = [(0, 1), (1, NREGIONS)] if self.shape.get(self._inc_id(s), (False, False))[1] else [(0, NREGIONS)]
            if s.p == p and s.writing and not s.answered and s.left == full:
                s.writing, s.answered = False, True

    def _inc_id(self, s: Session) -> int:
        return next(id(i) for i in self.incomings if (i.transfer_id, i.attempt) == (s.tid, s.attempt))

    @precondition(lambda self: any(v in ("dead", "refused") for v in self.conns.values()))
    @rule(data=st.data())
    def fencing_hello(self, data) -> None:
        """D says hello again to a P rank it declared dead (or that refused), to fence its quarantined writers."""
        p = data.draw(st.sampled_from(sorted(k for k, v in self.conns.items() if v in ("dead", "refused"))))
        self.conns[p] = "pending"
        self.epoch[p] += 1

    @precondition(lambda self: any(self._live()))
    @rule(data=st.data(), state=st.sampled_from([PrefillState.QUEUED, PrefillState.RUNNING]))
    def p_acknowledges(self, data, state: PrefillState) -> None:
        """P says the prefill is queued or running (it vouches that the KV will come)."""
        s = data.draw(st.sampled_from(self._live()))
        inc = next(i for i in self.incomings if (i.transfer_id, i.attempt) == (s.tid, s.attempt))
        if self.fencing.acknowledged(protocol.Ack(s.tid, s.p, state, s.attempt, 100)) and not inc.reported:
            self.vouched.setdefault(id(inc), inc.times.registered)

    # -- an honest P ---------------------------------------------------------------------
    def _live(self) -> list[Session]:
        return [s for s in self.sessions if s.writing and s.p not in self.dead]

    def _may_write(self, s: Session) -> bool:
        """P writes an attempt only after every older attempt of that (transfer, rank) ended on P."""
        older = [o for o in self.sessions if (o.tid, o.p) == (s.tid, s.p) and o.attempt < s.attempt]
        return bool(s.left) and not s.aborted and all(not o.writing for o in older)

    @precondition(lambda self: any(self._may_write(s) for s in self._live()))
    @rule(data=st.data())
    def p_writes_a_part(self, data) -> None:
        s = data.draw(st.sampled_from([s for s in self._live() if self._may_write(s)]))
        r0, r1 = s.left.pop(data.draw(st.integers(0, len(s.left) - 1)))
        plan = PlanKind.STAGED if s.staged else PlanKind.DIRECT
        msg = protocol.Completion(s.tid, "p", s.p, plan, 16 * (r1 - r0), 1, s.grant, s.attempt, r0, r1)
        self.net.msgs.append(msg)
        if not s.left:
            s.writing = False  # its last WRITE landed with this notification

    @precondition(lambda self: any(not s.answered for s in self._live()))
    @rule(data=st.data(), why=st.sampled_from(list(Cause)))
    def p_gives_up(self, data, why: Cause) -> None:
        """P answers a registration with a failure (an abort's answer, superseded, lease expired, a WRITE error):
        it sends it once nothing of that registration is in flight."""
        s = data.draw(st.sampled_from([s for s in self._live() if not s.answered]))
        s.writing, s.answered = False, True
        self.net.msgs.append(protocol.Failure(s.tid, "p", s.p, Stage.RENDEZVOUS, why, "no", s.attempt))

    @precondition(lambda self: self.net.msgs)
    @rule(data=st.data())
    def deliver(self, data) -> None:
        msg = self.net.msgs.pop(data.draw(st.integers(0, len(self.net.msgs) - 1)))
        if isinstance(msg, protocol.Completion):
            self._do(self.fencing.completion(msg, self.now, sender=("p", msg.rank)))
        else:
            self._do(self.fencing.failure(msg, self.now, sender=("p", msg.rank)))
        self._step()

    def _writers_state(self) -> list[tuple]:
        return [
            (id(inc), p, w.final, w.quarantined, bytes(w.covered or b""), len(w.unpacking), inc.reported)
            for inc in [*self.fencing.current.values(), *self.fencing.superseded]
            for p, w in inc.writers.items()
        ]

    @precondition(lambda self: self.net.msgs or self.fencing.current)
    @rule(data=st.data(), kind=st.sampled_from(["completion", "failure"]), other_rank=st.booleans())
    def forged(self, data, kind: str, other_rank: bool) -> None:
        """Another holder of the P key (a P D never registered this transfer with, or the other P rank of
        the same instance) sends D a copy of a message on its way, or one of its own making: D ignores it,
        whatever state the transfer is in."""
        if self.net.msgs and data.draw(st.booleans()):
            msg = self.net.msgs[data.draw(st.integers(0, len(self.net.msgs) - 1))]
        else:
            inc = data.draw(st.sampled_from([*self.fencing.current.values(), *self.fencing.superseded] or [None]))
            if inc is None:
                return
            p = data.draw(st.sampled_from(sorted(inc.writers)))
            if kind == "completion":
                msg = protocol.Completion(inc.transfer_id, "r", p, attempt=inc.attempt)
            else:
                msg = protocol.Failure(inc.transfer_id, "r", p, Stage.TRANSFER, Cause.OTHER, "forged", inc.attempt)
        sender = ("p", 1 - msg.rank) if other_rank and msg.rank in (0, 1) else ("evil", msg.rank)
        before = self._writers_state()
        if isinstance(msg, protocol.Completion):
            out = self.fencing.completion(msg, self.now, sender=sender)
        else:
            out = self.fencing.failure(msg, self.now, sender=sender)
        assert all(isinstance(a, (Foreign, Stale)) for a in out), out
        assert self._writers_state() == before, "a forged message changed a writer"

    @precondition(lambda self: any(not m.reached for ms in self.unpacks.values() for m in ms))
    @rule(data=st.data())
    def unpack_lands(self, data) -> None:
        pending = [m for ms in self.unpacks.values() for m in ms if not m.reached]
        pending[data.draw(st.integers(0, len(pending) - 1))].reached = True
        self._step()

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def books_agree(self) -> None:
        for tid, inc in self.fencing.current.items():
            assert inc.transfer_id == tid and id(inc) not in self.reported
        for inc in self.fencing.superseded:
            assert id(inc) not in self.reported and inc.aborting is not None

    def teardown(self) -> None:
        """Everything settles: P answers or finishes, messages arrive, connections answer (a fencing hello to
        each P rank D declared dead that lives), time runs out. Then every attempt was reported (fenced) once
        and every slot given back; before that, a killed P rank's quarantined writers stay quarantined however
        long it takes (they are overdue, once), and the restarted P rank fences them."""
        for _ in range(3):  # deadlines pass, aborts go unanswered, quarantines become overdue
            self.time_passes(QUARANTINE_S * 10)
        for inc in self.incomings:
            for w in inc.writers.values():
                if w.quarantined:
                    assert (id(inc), w.p_rank) in self.overdue, f"quarantined past quarantine_s, not overdue: {w}"
        if self.conns.get(0) == "dead":
            self._kill(0)  # P rank 0, declared dead, was killed; P rank 1, if declared dead, was frozen
        held = [(inc, w) for inc in self.incomings for w in inc.writers.values() if w.quarantined]
        self.time_passes(QUARANTINE_S * 10)
        assert all(w.quarantined for _, w in held), "a quarantine ended on a timer"
        assert self.fencing.quarantined_blocks() == sum(inc.quarantined_blocks() for inc in {i for i, _ in held})
        self.dead.clear()  # every killed P rank restarts
        for _ in range(50):
            for s in self._live():
                if not s.answered:
                    s.writing, s.answered = False, True
                    answer = protocol.Failure(s.tid, "p", s.p, Stage.RENDEZVOUS, Cause.ABORTED, "x", s.attempt)
                    self.net.msgs.append(answer)
            while self.net.msgs:
                msg = self.net.msgs.pop(0)
                if isinstance(msg, protocol.Completion):
                    self._do(self.fencing.completion(msg, self.now, sender=("p", msg.rank)))
                else:
                    self._do(self.fencing.failure(msg, self.now, sender=("p", msg.rank)))
            for p, v in list(self.conns.items()):
                if p in self.dead:
                    if v == "pending":
                        self.conns[p] = "dead"
                        dead = Dead(("p", p), "never answered the hello", self.epoch[p], "")
                        self._do(self.fencing.on_link(dead, self.now))
                    continue
                if v in ("dead", "refused"):
                    self.fencing_hello(_Draws(p))
                if v == "ready" and p in self.forgot:  # P answers no heartbeat: the next registration says hello
                    self.conns[p] = "pending"
                    self.epoch[p] += 1
                if self.conns[p] == "pending":
                    self.hello_answered(_Draws(p), True)
            for ms in self.unpacks.values():
                for m in ms:
                    m.reached = True
            self._step()
            if not self.fencing.current and not self.fencing.superseded:
                break
            self.time_passes(TIMEOUT_S + PEER_DEAD_S)
        assert not self.fencing.current and not self.fencing.superseded, (self.fencing.current, self.fencing.superseded)
        assert all(id(i) in self.reported for i in self.incomings), "an attempt was never reported"
        assert not any(self.granted.values()), "a staging slot was never given back"


FencingMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_fencing_state_machine = FencingMachine.TestCase


# -- examples the machine finds only rarely ------------------------------------------------------


class _Draws:
    """Fixed answers for a rule's ``data.draw`` calls, in order."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


def _machine_with_one_writer(staged: bool, split: bool) -> FencingMachine:
    m = FencingMachine()
    m.register("t0", (0,), staged, split)
    m.hello_answered(_Draws(0), True)
    return m


def test_a_writer_that_fails_mid_unpack_waits_for_the_unpack() -> None:
    """P gives up after one part of a staged push: D reports only once that part's unpack ended."""
    m = _machine_with_one_writer(staged=True, split=True)
    m.p_writes_a_part(_Draws(m.sessions[0], 0))
    m.deliver(_Draws(0))
    [marker] = next(iter(m.unpacks.values()))
    assert not marker.reached and not m.reported
    m.p_gives_up(_Draws(m.sessions[0]), Cause.ABORTED)
    m.deliver(_Draws(0))  # _on_report checks the unpack ended first
    assert len(m.reported) == 1 and marker.reached


def test_an_ack_that_crosses_ds_abort_does_not_extend_the_wait() -> None:
    """D gave up at ``transfer_timeout_s`` (abort sent); P's Ack written before it read the abort arrives: the
    wait stays over, and the report says so once P answers the abort."""
    m = _machine_with_one_writer(staged=False, split=False)
    m.time_passes(TIMEOUT_S)
    [inc] = m.fencing.current.values()
    assert inc.aborting is not None and inc.deadline == TIMEOUT_S
    s = m.sessions[0]
    assert not m.fencing.acknowledged(protocol.Ack(s.tid, s.p, PrefillState.QUEUED, s.attempt, 10))
    assert inc.deadline == TIMEOUT_S and not inc.vouched
    m.p_gives_up(_Draws(s), Cause.ABORTED)
    m.deliver(_Draws(0))
    [rep] = m.reported.values()
    assert rep.result.reason.startswith("no KV from P within"), rep.result


def test_only_a_completion_of_a_newer_attempt_fences_the_older() -> None:
    """D re-registers while P still writes the first attempt: P refusing the new attempt proves nothing about
    the old one (it is still written); P completing the new attempt proves the old one's WRITE ended."""
    m = _machine_with_one_writer(staged=False, split=False)
    m.register("t0", (0,), False, False)  # attempt 1; attempt 0 is superseded, its writer still registered
    old, new = m.sessions
    assert (old.attempt, new.attempt) == (0, 1) and len(m.fencing.superseded) == 1
    m.p_gives_up(_Draws(new), Cause.SUPERSEDED)
    m.deliver(_Draws(0))
    assert len(m.reported) == 1, "only the new attempt ends"  # _on_report checks no live writer
    assert m.fencing.superseded, "a failure of the newer attempt fenced the older one"

    m = _machine_with_one_writer(staged=False, split=False)
    m.register("t0", (0,), False, False)
    old, new = m.sessions
    m.p_writes_a_part(_Draws(old, 0))  # the old attempt's WRITE lands; its notification is still on the way
    m.p_writes_a_part(_Draws(new, 0))  # only then does P write the new attempt
    m.deliver(_Draws(1))  # the new attempt's completion first
    assert not m.fencing.superseded and len(m.reported) == 2, "the new attempt's completion fences the old one"
    m.deliver(_Draws(0))  # the old notification: stale
    assert not m.fencing.current and len(m.reported) == 2


def test_a_busy_refusal_fails_nothing_and_a_refusal_fails_the_waiting_writers() -> None:
    """What D's links say reaches the fencing through ``on_link``: P answering *busy* (an earlier session of
    this D still writes) fails no writer, the link asks again; a refusal fails the writers waiting on it."""
    fencing = Fencing(NREGIONS, TIMEOUT_S, PEER_DEAD_S, HARD_CAP_S, QUARANTINE_S)
    conn = ("p", 0)
    fencing.register(Asked("t0", "r-t0", ((1, 2),), 32), {0: conn}, 0.0)
    assert fencing.on_link(Refused(conn, "an earlier session still writes", busy=True), 1.0) == []
    assert len(fencing) == 1
    [report] = [a for a in fencing.on_link(Refused(conn, "bad layout", busy=False), 2.0) if isinstance(a, Report)]
    assert not report.result.ok and report.result.reason == "bad layout" and len(fencing) == 0


def test_unpacks_are_taken_oldest_first() -> None:
    """The receiver reports a writer's unpacks as its ``AwaitUnpacks`` lists them; an answer naming any other
    unpack than the oldest one running (a stale action's) changes nothing."""
    fencing = Fencing(NREGIONS, TIMEOUT_S, PEER_DEAD_S, HARD_CAP_S, QUARANTINE_S)
    [send] = fencing.register(Asked("t0", "r-t0", ((1, 2),), 32), {0: ("p", 0)}, 0.0)
    grant = protocol.StagingGrant(4096, 64)
    assert fencing.register_sent(send.incoming, 0, grant, "pieces", 16, True, 0.0) == []
    markers = [Marker(), Marker()]
    for (r0, r1), marker in zip([(0, 1), (1, NREGIONS)], markers, strict=True):
        part = protocol.Completion("t0", "p", 0, PlanKind.STAGED, 16, 1, grant, 0, r0, r1)
        [start] = fencing.completion(part, 1.0, sender=("p", 0))
        [wait] = fencing.unpack_started(start, marker, 0.0, 1.0)
        assert isinstance(wait, AwaitUnpacks) and wait.markers[-1] is marker
    assert wait.markers == tuple(markers) and wait.block
    w = send.incoming.writers[0]
    assert fencing.unpacked(send.incoming, 0, markers[1], 2.0) == [] and len(w.unpacking) == 2
    assert fencing.unpacked(send.incoming, 0, markers[0], 2.0) == [] and len(w.unpacking) == 1
    [free, report] = fencing.unpacked(send.incoming, 0, markers[1], 2.0)
    assert free == FreeSlot(4096) and isinstance(report, Report) and report.result.ok


def test_a_registration_p_refuses_for_want_of_a_hello_goes_again_once_after_a_new_hello() -> None:
    """P forgot this D rank (D silent past P's ``peer_dead_s``) while D's link still looked live: P refuses the
    registration as a handshake failure. The first time, D says hello again (``HelloAgain``) and registers
    anew (its staging slot back first); the writer fails only if it is refused so again."""
    fencing = Fencing(NREGIONS, TIMEOUT_S, PEER_DEAD_S, HARD_CAP_S, QUARANTINE_S)
    conn = ("p", 0)
    assert fencing.on_link(Ready(conn, 1), 0.0) == []
    [send] = fencing.register(Asked("t0", "r-t0", ((1, 2),), 32), {0: conn}, 0.0)
    inc = send.incoming
    grant = protocol.StagingGrant(4096, 64)
    assert fencing.register_sent(inc, 0, grant, "pieces", 16, True, 0.0) == []
    why = "registration before a successful hello from this D rank"
    refusal = protocol.Failure("t0", "r-t0", 0, Stage.HANDSHAKE, Cause.REFUSED, why, 0)
    again = fencing.failure(refusal, 1.0, sender=conn)
    assert again == [HelloAgain(conn), FreeSlot(4096), SendRegister(inc, 0, conn, inc.asked, 0)], again
    assert fencing.on_link(Ready(conn, 2), 1.5) == [SendRegister(inc, 0, conn, inc.asked, 0)]  # sent after the hello
    assert fencing.register_sent(inc, 0, None, None, 0, True, 1.5) == []
    [report] = fencing.failure(refusal, 2.0, sender=conn)
    assert isinstance(report, Report) and not report.result.ok and report.result.stage is Stage.HANDSHAKE
    assert len(fencing) == 0


def test_a_hello_answered_ok_fails_the_registrations_of_earlier_sessions() -> None:
    """P answers a hello ok only once it dropped this D rank's earlier registrations (or had forgotten them):
    a writer still waiting on one of those fails at once instead of waiting out its timeout; one registered
    in the new session waits on."""
    fencing = Fencing(NREGIONS, TIMEOUT_S, PEER_DEAD_S, HARD_CAP_S, QUARANTINE_S)
    conn = ("p", 0)
    fencing.on_link(Ready(conn, 1), 0.0)
    [old] = fencing.register(Asked("t0", "r-t0", ((1, 2),), 32), {0: conn}, 0.0)
    fencing.register_sent(old.incoming, 0, None, None, 0, True, 0.0)
    out = fencing.on_link(Ready(conn, 2), 1.0)
    [report] = [a for a in out if isinstance(a, Report)]
    assert report.result.transfer_id == "t0" and not report.result.ok and report.result.fenced
    [new] = fencing.register(Asked("t1", "r-t1", ((3, 4),), 32), {0: conn}, 1.0)
    fencing.register_sent(new.incoming, 0, None, None, 0, True, 1.0)
    assert fencing.on_link(Ready(conn, 2), 1.5) == [] and len(fencing) == 1
