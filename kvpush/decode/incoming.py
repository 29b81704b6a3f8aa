"""One attempt of one transfer on D (sans-I/O): what D asked its writers for, and what arrived from each.

D registers its blocks with every P rank that writes them (a *writer*), then
counts the regions each writer's parts cover. ``Incoming`` turns what
happens to one attempt (a completion, a failure, an abort, an unpack done, a
writer declared dead, time passing) into actions (``kvpush.decode.fencing_actions``).

The one rule everything here serves: **D gives a transfer's blocks back
only when no writer can still write into them** — every writer completed,
failed, answered an abort, or never got the registration; an unpack still
running is waited for first. A writer declared dead (or that did not answer
an abort) may only be frozen and write later, so it is *quarantined*: the
transfer is reported failed at once (``Result.fenced`` False: the request
may fail now) and its blocks stay withheld until that P rank is *fenced*
(it answered a hello D sent after the declaration, which P does only once
nothing of the old session is in flight and its registrations are dropped),
P answers for that registration, or every region of its attempt has landed
(``late_part``); then a second Report (``fenced``) gives them back. Never
on a timer alone: a freeze (a debugger, a VM migration) can outlast any
timeout, and a WRITE that lands in reused blocks corrupts another request.
A quarantine still unfenced after ``quarantine_s`` is reported once
(``Overdue``: a warning and a count) and the blocks stay withheld.

A push in rounds (``kvpush.core.rounds``) counts its *parts* instead of
regions: D unpacks part ``j`` from ring slot ``j % slots`` as it lands and,
once the parts before it are unpacked too, *credits* them to the writer
(``SendCredit``), which may then write those slots again. A credit lost on
the way only delays P: D repeats its latest every ``credit_every`` while the
writer still owes parts. Which unit a writer counts is set by its first
part (P may write a ring grant's transfer directly: its cost model, or no
ring of its own); a writer mixing the two fails.

D's wait is bounded by what P says (``acknowledged``): until P vouches for
the prefill (queued, running, pushing) D waits ``transfer_timeout_s`` from
registration; once it does, up to ``transfer_hard_cap_s``, while P lives.
Time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from kvpush.core import protocol
from kvpush.core.outcome import Cause, Failed, PlanKind, PrefillState, ReceiveStats, ReceiveTimes, Result, Stage
from kvpush.core.rounds import Ring, make_ring, slice_pieces
from kvpush.core.staging import FreeSlot
from kvpush.core.topology import ConnKey
from kvpush.decode import fencing_actions
from kvpush.decode.fencing_actions import (
    Asked,
    AwaitUnpacks,
    Overdue,
    Report,
    SendAbort,
    SendCredit,
    SendRegister,
    StartUnpack,
    WaitUnpacks,
)


@dataclass
class Writer:
    """One P rank's part of one attempt."""

    p_rank: int
    conn: ConnKey
    sent: bool = False
    final: bool = False
    failed: Failed | None = None
    grant: protocol.StagingGrant | None = None
    unpack: Any = None  # D's unpack pieces (staged only)
    region_bytes: int = 0  # bytes one region contributes to the staged payload
    covered: bytearray | None = None  # per unit (region, or part in rounds): 0 not announced, 2 unpacking, 1 here
    rounds: bool | None = None  # its parts are a ring's (counted per part), set by its first part
    ring: Ring | None = None  # the ring its grant made, when it is one (``kvpush.core.rounds``)
    slices: dict[tuple[int, int], Any] = field(default_factory=dict)  # the unpack list cut per stream range
    credited: int = 0  # parts [0, credited) credited to P
    credit_at: float = 0.0  # when the latest credit went
    unpacking: deque[tuple[int, int, Any, int, int]] = field(default_factory=deque)
    """Unpacks running, oldest first: (first unit, end unit, marker, first region, end region)."""
    state: PrefillState = PrefillState.UNKNOWN  # what P last acknowledged
    quarantined: bool = False  # declared dead (or silent on an abort) while it may still write
    q_until: float = float("inf")  # still quarantined by then: overdue (reported once, the blocks stay out)
    overdue: bool = False  # reported overdue (once)
    q_epoch: int = 0  # a hello of a later epoch answered by its P rank fences it
    epoch: int = 0  # the session (its link's hello) its registration went out in
    again: bool = False  # registered a second time, after P said it no longer knew this D rank (``forgotten``)


class Incoming:
    """One attempt of one transfer on D: its writers and what arrived from each."""

    def __init__(
        self,
        asked: Asked,
        writers: dict[int, ConnKey],
        nregions: int,
        now: float,
        deadline: float,
        attempt: int = 0,
        hard_deadline: float = float("inf"),
    ) -> None:
        self.asked = asked
        self.transfer_id = asked.transfer_id
        self.request_id = asked.request_id
        self.writers = {p: Writer(p, conn) for p, conn in writers.items()}
        self.nregions = nregions
        self.deadline = deadline
        self.hard_deadline = hard_deadline
        self.vouched = False  # some writer said the prefill is queued, running or pushing
        self.tokens_ahead = 0
        self.attempt = attempt
        self.failure: Result | None = None  # reported failed while a writer is quarantined
        self.aborting: Failed | None = None
        self.abort_deadline = float("inf")
        self.stats = ReceiveStats()
        self.times = ReceiveTimes(registered=now)
        self.reported = False

    # -- events --------------------------------------------------------------
    def register_sent(
        self, p: int, grant: protocol.StagingGrant | None, unpack: Any, region_bytes: int, ok: bool, t: float
    ) -> list[Action]:
        w = self.writers[p]
        w.grant, w.unpack, w.region_bytes, w.sent = grant, unpack, region_bytes, ok
        if grant is not None and grant.ring and region_bytes > 0:
            w.ring = make_ring(self.nregions, region_bytes, grant.part_bytes, grant.slots, 1)
        if not ok:
            return self._final(w, Failed(Stage.REGISTER, Cause.SIDE_CHANNEL, "side channel send failed"), t)
        self.times.sent = t  # the last writer's: D waits for every P rank
        return []

    def acknowledged(self, p: int, state: PrefillState, tokens_ahead: int) -> None:
        """P rank ``p`` says where the prefill stands: once it vouches for it, D waits up to the hard cap."""
        w = self.writers[p]
        w.state = state
        self.tokens_ahead = tokens_ahead
        if state.alive and not self.vouched:
            self.vouched = True
            self.deadline = max(self.deadline, self.hard_deadline)

    def quarantine(self, p: int, failed: Failed, until: float, epoch: int, now: float) -> list[Action]:
        """Writer ``p`` will not complete but may still write (declared dead, or silent on an abort):
        the transfer fails now, its blocks (and staging slot) stay withheld until ``release``."""
        w = self.writers[p]
        if w.final or w.quarantined:
            return []
        if not w.sent:
            return self._final(w, failed, now)  # it never got the registration: it cannot write
        out: list[Action] = []
        if w.unpacking:
            out.append(WaitUnpacks(tuple(u[2] for u in w.unpacking)))
            w.unpacking.clear()
        w.quarantined, w.failed, w.q_until, w.q_epoch = True, failed, until, epoch
        return out + self._maybe_report(now)

    def release(self, p: int, now: float) -> list[Action]:
        """A quarantined writer can no longer write (fenced, it answered, or its quarantine ran out)."""
        w = self.writers[p]
        return self._final(w, w.failed, now) if w.quarantined else []

    def late_part(self, w: Writer, msg: protocol.Completion, now: float) -> list[Action]:
        """A part of a quarantined writer landed (unused: the transfer failed). Once every region of its attempt
        has landed, it can write nothing more into these blocks (each region is written once per attempt, and
        a part's notification arrives after its bytes): released."""
        if not w.quarantined:
            return []
        units = self._units(w, msg)
        if units is None:
            return []
        u0, u1 = units
        w.covered[u0:u1] = b"\x01" * (u1 - u0)
        return self.release(w.p_rank, now) if not w.covered.count(0) else []

    def conn_ready(self, conn: ConnKey, now: float) -> list[Action]:
        out: list[Action] = []
        for w in self._unsent(conn):
            out += self._final(w, self.aborting, now) if self.aborting else [self.send_register(w.p_rank)]
        return out

    def conn_refused(self, conn: ConnKey, reason: str, now: float) -> list[Action]:
        out: list[Action] = []
        for w in self._unsent(conn):
            out += self._final(w, Failed(Stage.HANDSHAKE, Cause.REFUSED, reason), now)
        return out

    def completion(self, w: Writer, msg: protocol.Completion, now: float) -> list[Action]:
        """A part arrived: count what it covers (a staged part, or a part in rounds, once unpacked)."""
        n = self.nregions
        r0, r1 = (msg.region_start, msg.region_end) if msg.region_end else (0, n)
        units = self._units(w, msg)
        if units is None or any(w.covered[units[0] : units[1]]):  # type: ignore[index]
            return self._final(w, Failed(Stage.TRANSFER, Cause.OTHER, self._misfit(w, msg, r0, r1, units)), now)
        assert w.covered is not None
        u0, u1 = units
        self.times.part(r0, r1, w.p_rank).stamp("notified", now)
        if msg.plan is PlanKind.STAGED:
            if w.grant is None or w.grant.ring or msg.staging != w.grant or w.unpack is None:
                why = "staged completion does not match the granted slot"
                return self._final(w, Failed(Stage.TRANSFER, Cause.OTHER, why), now)
            at = w.grant.offset + r0 * w.region_bytes
            return [StartUnpack(self, w.p_rank, msg, r0, r1, at, units, w.unpack)]
        if msg.plan is PlanKind.ROUNDS:
            assert w.ring is not None and w.grant is not None
            tile = w.ring.tiles[u0]
            unpack = w.slices.get((tile.q0, tile.q1))
            if unpack is None:
                unpack = w.slices[(tile.q0, tile.q1)] = slice_pieces(w.unpack, tile.q0, tile.q1)
            return [StartUnpack(self, w.p_rank, msg, r0, r1, w.grant.offset + w.ring.d_offset(u0), units, unpack)]
        w.covered[u0:u1] = b"\x01" * (u1 - u0)
        self._account(msg, now)
        return self._check_covered(w, now)

    def _units(self, w: Writer, msg: protocol.Completion) -> tuple[int, int] | None:
        """What ``msg`` covers of the writer's count: its regions, or its part's index in rounds (the writer's
        first part says which); None when it does not fit (outside the count, a part not of the ring's cut,
        the other unit than the writer's, or a part in rounds without a ring grant and its unpack list)."""
        rounds = msg.plan is PlanKind.ROUNDS
        if w.rounds is None:
            w.rounds = rounds
        if w.rounds != rounds:
            return None
        if not rounds:
            n = self.nregions
            r0, r1 = (msg.region_start, msg.region_end) if msg.region_end else (0, n)
            if r1 > n:
                return None
            if w.covered is None:
                w.covered = bytearray(n)
            return r0, r1
        ring = w.ring
        if ring is None or msg.staging != w.grant or w.unpack is None or msg.part >= ring.parts:
            return None
        tile = ring.tiles[msg.part]
        if (msg.region_start, msg.region_end) != (tile.r0, tile.r1):
            return None
        if w.covered is None:
            w.covered = bytearray(ring.parts)
        return msg.part, msg.part + 1

    def _misfit(self, w: Writer, msg: protocol.Completion, r0: int, r1: int, units: tuple[int, int] | None) -> str:
        """Why a part is refused (it fails its writer): what it claimed against what D counts."""
        if units is not None:
            what = f"part {msg.part}" if w.rounds else f"regions [{r0}, {r1})"
            return f"completion for {what} announced twice"
        if msg.plan is PlanKind.ROUNDS:
            parts = w.ring.parts if w.ring is not None else 0
            return (
                f"completion of part {msg.part} (regions [{r0}, {r1})) in rounds does not fit this writer's ring "
                f"grant ({parts} parts; a writer's parts are all in rounds or none is)"
            )
        return f"completion for regions [{r0}, {r1}) outside D's regions ({self.nregions} regions) or mixing units"

    def unpack_started(self, a: StartUnpack, marker: Any, seconds: float, now: float) -> list[Action]:
        """Claimed now (a repeated announcement is refused), counted once unpacked."""
        w = self.writers[a.p_rank]
        assert w.covered is not None
        self.stats.unpack_s = (self.stats.unpack_s or 0.0) + seconds
        u0, u1 = a.units
        w.covered[u0:u1] = b"\x02" * (u1 - u0)
        w.unpacking.append((u0, u1, marker, a.r0, a.r1))
        self.times.part(a.r0, a.r1, a.p_rank).stamp("unpack", now - seconds)
        self._account(a.part, now)
        return [self.await_unpacks(w.p_rank, block=not w.covered.count(0))]

    def unpacked(self, p: int, now: float) -> list[Action]:
        """The writer's oldest unpack is done; in rounds, the parts unpacked without a gap before them are
        credited (``SendCredit``) unless every part is here."""
        w = self.writers[p]
        u0, u1, _, r0, r1 = w.unpacking.popleft()
        self.times.part(r0, r1, p).stamp("unpacked", now)
        assert w.covered is not None
        w.covered[u0:u1] = b"\x01" * (u1 - u0)
        out: list[Action] = []
        if w.rounds and w.covered.count(1) < len(w.covered):
            done = w.credited
            while done < len(w.covered) and w.covered[done] == 1:
                done += 1
            if done > w.credited:
                w.credited, w.credit_at = done, now
                out.append(SendCredit(w.conn, self.transfer_id, self.attempt, done))
        return out if w.unpacking else out + self._check_covered(w, now)

    def forgotten(self, p: int) -> list[Action] | None:
        """P rank ``p`` refused the registration because it no longer knows this D rank (no hello of its
        session: P forgot it). Nothing of the registration reached P's rendezvous, so nothing of it can be
        written: the writer registers again, once, after a new hello (its staging slot goes back first; the
        next registration is granted anew). None: not this time (final, quarantined, aborting, or already
        registered again), and the refusal fails the writer."""
        w = self.writers[p]
        if w.final or w.quarantined or w.again or self.aborting is not None:
            return None
        out: list[Action] = []
        if w.grant is not None:
            out.append(FreeSlot(w.grant.offset))
        w.again, w.sent, w.grant, w.unpack, w.region_bytes, w.ring = True, False, None, None, 0, None
        return [*out, self.send_register(p)]

    def writer_failed(self, p: int, failed: Failed, now: float) -> list[Action]:
        """A writer will not complete (P's Failure, an unpack or a send that failed, a dead connection).

        Its unpacks still running are waited for before its slot and blocks go back (``_final``), also when
        the failure is one of its unpacks: with overlapping parts, the parts before it may still be
        writing the blocks and reading the slot (waiting for a marker that failed ends at once)."""
        w = self.writers[p]
        return [] if w.final or w.quarantined else self._final(w, failed, now)

    def abort(self, why: Failed, now: float, answer_s: float) -> list[Action]:
        """D gives up: writers not registered end now, the others are asked to stop (answer within ``answer_s``)."""
        if self.aborting is not None:
            return []
        self.aborting = why
        self.abort_deadline = now + answer_s
        out: list[Action] = []
        for w in self.writers.values():
            if w.final or w.quarantined:
                continue
            out += [self.send_abort(w.p_rank, why.reason)] if w.sent else self._final(w, why, now)
        return out

    def supersede(self, now: float, answer_s: float) -> list[Action]:
        """A new attempt replaces this one; writers that never got the registration end now."""
        self.aborting = Failed(Stage.TRANSFER, Cause.SUPERSEDED, "superseded by a re-issued registration")
        self.abort_deadline = now + answer_s
        out: list[Action] = []
        for w in self.writers.values():
            if not w.sent and not w.final:
                out += self._final(w, self.aborting, now)
        return out

    def expire(
        self, now: float, quarantine_s: float, epochs: dict[ConnKey, int], credit_every: float = float("inf")
    ) -> list[Action]:
        """Past the abort deadline: writers that did not answer are quarantined (they may still write);
        quarantines past ``quarantine_s`` are reported overdue, once, and stay: only fencing ends them. A writer
        in rounds that still owes parts hears its latest credit again every ``credit_every`` (one lost on the
        way would hold P back for good)."""
        out: list[Action] = []
        for w in self.writers.values():
            if w.credited and not w.final and not w.quarantined and now - w.credit_at >= credit_every:
                w.credit_at = now
                out.append(SendCredit(w.conn, self.transfer_id, self.attempt, w.credited))
        if self.aborting is not None and now >= self.abort_deadline:
            why = self.aborting
            late = Failed(why.stage, Cause.DEAD_PEER, why.reason + " (P did not answer the abort)")
            for w in self.writers.values():
                if not w.final:
                    out += self.quarantine(w.p_rank, late, now + quarantine_s, epochs.get(w.conn, 0), now)
        for w in self.writers.values():
            if w.quarantined and not w.overdue and now >= w.q_until:
                w.overdue = True
                held = now - w.q_until + quarantine_s
                out.append(Overdue(self, w.p_rank, held, self.transfer_id, w.conn, self.quarantined_blocks()))
        return out

    # -- actions -------------------------------------------------------------
    def send_register(self, p: int) -> SendRegister[Incoming]:
        """Register with writer ``p`` (what the receiver needs to send it)."""
        return SendRegister(self, p, self.writers[p].conn, self.asked, self.attempt)

    def send_abort(self, p: int, reason: str) -> SendAbort[Incoming]:
        """Tell writer ``p`` D gave up on this attempt."""
        ask = self.asked
        return SendAbort(
            self, p, reason, self.writers[p].conn, ask.transfer_id, ask.request_id, self.attempt, ask.capability
        )

    def await_unpacks(self, p: int, block: bool) -> AwaitUnpacks[Incoming]:
        """Report writer ``p``'s unpacks running now, oldest first, as they end."""
        return AwaitUnpacks(self, p, block, tuple(u[2] for u in self.writers[p].unpacking))

    # -- internals -----------------------------------------------------------
    def _unsent(self, conn: ConnKey) -> list[Writer]:
        return [w for w in self.writers.values() if w.conn == conn and not w.sent and not w.final]

    def _account(self, msg: protocol.Completion, now: float) -> None:
        st = self.stats
        st.bytes += msg.nbytes
        st.descriptors += msg.descriptors
        st.parts += 1
        st.plan = msg.plan
        if self.times.first_part is None:
            self.times.first_part = now
        self.times.last_part = now  # the last one's: what the tail after it is made of

    def _check_covered(self, w: Writer, now: float) -> list[Action]:
        assert w.covered is not None
        if w.covered.count(1) < len(w.covered):
            return []
        self.times.completed = now
        return self._final(w, None, now)

    def _final(self, w: Writer, failed: Failed | None, now: float) -> list[Action]:
        out: list[Action] = []
        if w.unpacking:
            out.append(WaitUnpacks(tuple(u[2] for u in w.unpacking)))
            w.unpacking.clear()
        w.final, w.failed, w.quarantined = True, failed, False
        if w.grant is not None:
            out.append(FreeSlot(w.grant.offset))
            w.grant = None
        return out + self._maybe_report(now)

    def _maybe_report(self, now: float) -> list[Action]:
        """Report once every writer is final; report the failure early once every writer is final or
        quarantined (the blocks stay withheld until the quarantined ones are released)."""
        writers = self.writers.values()
        if all(x.final for x in writers):
            self.reported = True
            result = replace(self.failure, fenced=True) if self.failure is not None else self._result(now)
            return [Report(self, result, self.quarantined_blocks())]
        if self.failure is None and all(x.final or x.quarantined for x in writers):
            self.failure = replace(self._result(now), fenced=False)
            return [Report(self, self.failure, self.quarantined_blocks())]
        return []

    def quarantined_blocks(self) -> int:
        """Blocks withheld from vLLM while a writer is quarantined (0 when none is)."""
        if not any(w.quarantined for w in self.writers.values()):
            return 0
        return sum(len(g) for g in self.asked.block_ids)

    def _result(self, now: float) -> Result:
        self.times.result = now
        self.stats.latency_s = now - (self.times.registered or now)
        why = self.aborting or next((x.failed for x in self.writers.values() if x.failed is not None), None)
        if why is None:
            return Result(self.transfer_id, self.request_id, True, stats=self.stats, times=self.times)
        r = Result(self.transfer_id, self.request_id, False, why.reason, why.cause, why.stage, self.stats, self.times)
        return r


Action = fencing_actions.Action[Incoming]
"""What an attempt's events answer with (``kvpush.decode.fencing_actions``, about ``Incoming``s)."""
