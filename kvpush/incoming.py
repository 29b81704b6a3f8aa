"""D's fencing: what D waits for on each transfer, and when it may report it (sans-I/O).

D registers its blocks with every P rank that writes them (a *writer*), then
counts the regions each writer's parts cover. ``Fencing`` keeps every
registration D made and turns what happens (a completion, a failure, an
abort, an unpack done, a P rank declared dead, time passing) into actions
for the receiver thread: register with a writer, send an abort, start or
wait for an unpack, free a staging slot, report the transfer.

The one rule everything here serves: **D gives a transfer's blocks back
only when no writer can still write into them** — every writer completed,
failed, answered an abort, or never got the registration; an unpack still
running is waited for first. A writer declared dead (or that did not answer
an abort) may only be frozen and write later, so it is *quarantined*: the
transfer is reported failed at once (``Result.fenced`` False: the request
may fail now) and its blocks stay withheld until that P rank is *fenced*
(it answered a hello D sent after the declaration, which P does only once
nothing of the old session is in flight and its registrations are dropped),
P answers for that registration, or ``quarantine_s`` passes; then a second
Report (``fenced``) gives them back.

D's wait is bounded by what P says (``acknowledged``): until P vouches for
the prefill (queued, running, pushing) D waits ``transfer_timeout_s`` from
registration; once it does, up to ``transfer_hard_cap_s``, while P lives. A re-issued registration gets a
new *attempt*; the older attempt stays (superseded) until P answers it or a
completion of a newer attempt proves P no longer writes it (P pushes a new
attempt only after the previous WRITE ended). Time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from kvpush import protocol
from kvpush.metrics import Count
from kvpush.outcome import Cause, Failed, PlanKind, PrefillState, ReceiveStats, ReceiveTimes, Result, Stage

ConnKey = tuple[str, int]
"""A P rank's side channel: (host, port)."""


# -- actions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendRegister:
    """Register with this writer once its connection is ready (answer ``register_sent``/``register_failed``;
    a refused connection answers ``conn_refused``)."""

    incoming: Incoming
    p_rank: int


@dataclass(frozen=True)
class SendAbort:
    """Tell this writer D gave up (answer ``unreachable`` if its connection is not ready)."""

    incoming: Incoming
    p_rank: int
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Tell a P rank D gave up on a transfer it never registered (P may hold the finished prefill)."""

    transfer_id: str
    request_id: str
    conn: ConnKey
    reason: str


@dataclass(frozen=True)
class StartUnpack:
    """Scatter this part from the writer's staging slot (answer ``unpack_started`` or ``unpack_failed``)."""

    incoming: Incoming
    p_rank: int
    part: protocol.Completion
    r0: int
    r1: int


@dataclass(frozen=True)
class AwaitUnpacks:
    """Report this writer's finished unpacks, oldest first (``unpacked``/``unpack_failed``); ``block``: its
    parts are all here, so its unpacks are the critical path: wait for them rather than poll."""

    incoming: Incoming
    p_rank: int
    block: bool


@dataclass(frozen=True)
class WaitUnpacks:
    """A writer ended while unpacks still write into its blocks: wait for them before the blocks go back."""

    markers: tuple[Any, ...]


@dataclass(frozen=True)
class FreeSlot:
    """Give back a staging slot of D's region."""

    offset: int


@dataclass(frozen=True)
class Stale:
    """A message for no current writer (late, duplicated, or of a finished attempt): count and log it."""

    transfer_id: str
    p_rank: int


@dataclass(frozen=True)
class Report:
    """The transfer ended on D: no writer can still write into its blocks (``result.fenced``), or it failed
    while a quarantined writer still might (``fenced`` False: a second Report gives the blocks back)."""

    incoming: Incoming
    result: Result


Action = SendRegister | SendAbort | Cancel | StartUnpack | AwaitUnpacks | WaitUnpacks | FreeSlot | Stale | Report


# -- one attempt ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Asked:
    """What D asks its writers for: tokens ``[start_token, num_tokens)`` of a request, into these blocks."""

    transfer_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    start_token: int = 0
    skip_blocks: tuple[int, ...] = ()  # per group: leading blocks D does not hold (a sliding window's)


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
    covered: bytearray | None = None  # per region: 0 not announced, 2 being unpacked, 1 arrived
    unpacking: deque[tuple[int, int, Any]] = field(default_factory=deque)  # (r0, r1, marker), oldest first
    state: PrefillState = PrefillState.UNKNOWN  # what P last acknowledged
    quarantined: bool = False  # declared dead (or silent on an abort) while it may still write
    q_until: float = float("inf")  # the quarantine ends by then at the latest
    q_epoch: int = 0  # a hello of a later epoch answered by its P rank fences it


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
            out.append(WaitUnpacks(tuple(m for _, _, m in w.unpacking)))
            w.unpacking.clear()
        w.quarantined, w.failed, w.q_until, w.q_epoch = True, failed, until, epoch
        return out + self._maybe_report(now)

    def release(self, p: int, now: float) -> list[Action]:
        """A quarantined writer can no longer write (fenced, it answered, or its quarantine ran out)."""
        w = self.writers[p]
        return self._final(w, w.failed, now) if w.quarantined else []

    def conn_ready(self, conn: ConnKey, now: float) -> list[Action]:
        out: list[Action] = []
        for w in self._unsent(conn):
            out += self._final(w, self.aborting, now) if self.aborting else [SendRegister(self, w.p_rank)]
        return out

    def conn_refused(self, conn: ConnKey, reason: str, now: float) -> list[Action]:
        out: list[Action] = []
        for w in self._unsent(conn):
            out += self._final(w, Failed(Stage.HANDSHAKE, Cause.REFUSED, reason), now)
        return out

    def completion(self, w: Writer, msg: protocol.Completion, now: float) -> list[Action]:
        """A part arrived: count its regions (a staged part once unpacked)."""
        n = self.nregions
        r0, r1 = (msg.region_start, msg.region_end) if msg.region_end else (0, n)
        if w.covered is None:
            w.covered = bytearray(n)
        if r1 > n or any(w.covered[r0:r1]):
            why = "outside D's regions" if r1 > n else "announced twice"
            msg_ = f"completion for regions [{r0}, {r1}) {why} ({n} regions)"
            return self._final(w, Failed(Stage.TRANSFER, Cause.OTHER, msg_), now)
        if msg.plan is PlanKind.STAGED:
            if w.grant is None or msg.staging != w.grant or w.unpack is None:
                why = "staged completion does not match the granted slot"
                return self._final(w, Failed(Stage.TRANSFER, Cause.OTHER, why), now)
            return [StartUnpack(self, w.p_rank, msg, r0, r1)]
        w.covered[r0:r1] = b"\x01" * (r1 - r0)
        self._account(msg, now)
        return self._check_covered(w, now)

    def unpack_started(self, a: StartUnpack, marker: Any, seconds: float, now: float) -> list[Action]:
        """Claimed now (a repeated announcement is refused), counted once unpacked."""
        w = self.writers[a.p_rank]
        assert w.covered is not None
        self.stats.unpack_s = (self.stats.unpack_s or 0.0) + seconds
        w.covered[a.r0 : a.r1] = b"\x02" * (a.r1 - a.r0)
        w.unpacking.append((a.r0, a.r1, marker))
        self._account(a.part, now)
        return [AwaitUnpacks(self, w.p_rank, block=not w.covered.count(0))]

    def unpacked(self, p: int, now: float) -> list[Action]:
        """The writer's oldest unpack is done."""
        w = self.writers[p]
        r0, r1, _ = w.unpacking.popleft()
        assert w.covered is not None
        w.covered[r0:r1] = b"\x01" * (r1 - r0)
        return [] if w.unpacking else self._check_covered(w, now)

    def writer_failed(self, p: int, failed: Failed, now: float) -> list[Action]:
        """A writer will not complete (P's Failure, an unpack or a send that failed, a dead connection)."""
        w = self.writers[p]
        if failed.stage is Stage.UNPACK:
            w.unpacking.clear()  # a failed unpack cannot be waited for
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
            out += [SendAbort(self, w.p_rank, why.reason)] if w.sent else self._final(w, why, now)
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

    def expire(self, now: float, quarantine_s: float, epochs: dict[ConnKey, int]) -> list[Action]:
        """Past the abort deadline: writers that did not answer are quarantined (they may still write);
        quarantines past their time end."""
        out: list[Action] = []
        if self.aborting is not None and now >= self.abort_deadline:
            why = self.aborting
            late = Failed(why.stage, Cause.DEAD_PEER, why.reason + " (P did not answer the abort)")
            for w in self.writers.values():
                if not w.final:
                    out += self.quarantine(w.p_rank, late, now + quarantine_s, epochs.get(w.conn, 0), now)
        for w in self.writers.values():
            if w.quarantined and now >= w.q_until:
                out += self.release(w.p_rank, now)
        return out

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
            out.append(WaitUnpacks(tuple(m for _, _, m in w.unpacking)))
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
            return [Report(self, result)]
        if self.failure is None and all(x.final or x.quarantined for x in writers):
            self.failure = replace(self._result(now), fenced=False)
            return [Report(self, self.failure)]
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


# -- every attempt D made ------------------------------------------------------------------------


class Fencing:
    """Every transfer D registered and not yet reported, current attempts and superseded ones."""

    def __init__(
        self,
        nregions: int,
        transfer_timeout_s: float,
        peer_dead_s: float,
        hard_cap_s: float = float("inf"),
        quarantine_s: float = float("inf"),
    ) -> None:
        self.nregions = nregions
        self.transfer_timeout_s = transfer_timeout_s
        self.peer_dead_s = peer_dead_s
        self.hard_cap_s = hard_cap_s
        self.quarantine_s = quarantine_s
        self.epochs: dict[ConnKey, int] = {}  # the latest hello epoch each P rank's link answered or died in
        self.current: dict[str, Incoming] = {}
        self.superseded: list[Incoming] = []
        self.hot: set[str] = set()  # transfers a P rank said it is writing (``Posting``): polled busily
        self.unpacking: list[tuple[Incoming, int]] = []  # writers with an unpack in progress
        self.counters: dict[Count, float] = {}

    def __len__(self) -> int:
        return len(self.current)

    def register(
        self, asked: Asked, writers: dict[int, ConnKey], now: float, bystanders: dict[int, ConnKey] | None = None
    ) -> list[Action]:
        """D allocated blocks for a transfer (again: a re-issue is a new attempt).

        ``bystanders``: the peer's P ranks that write into no D rank of this
        instance (their KV is replicated on other P ranks that do: MLA's
        latent, or more TP ranks than KV heads). They are told at once that
        their copy is not needed (``Cancel``), so each frees its finished
        prefill now instead of holding it for a lease; D expects nothing
        from them.
        """
        self._bump(Count.REGISTRATIONS)
        transfer_id = asked.transfer_id
        old = self.current.pop(transfer_id, None)
        self.hot.discard(transfer_id)
        out: list[Action] = []
        attempt = 0
        if old is not None:
            # P replaces the old registration when it reads the new one and answers the old attempt
            # with a "superseded" failure, unless the old one is being written, in which case it
            # completes it and only then pushes the new one. So an old writer is fenced once P answers
            # the old attempt or completes the new one; until then it stays here.
            attempt = old.attempt + 1
            self.superseded.append(old)
            out += self._settle(old.supersede(now, self.peer_dead_s))
        deadline = now + self.transfer_timeout_s
        inc = Incoming(asked, writers, self.nregions, now, deadline, attempt, now + self.hard_cap_s)
        self.current[transfer_id] = inc
        why = f"D takes this KV from P ranks {sorted(writers)}"
        spare = [Cancel(transfer_id, asked.request_id, conn, why) for conn in (bystanders or {}).values()]
        return out + [SendRegister(inc, p) for p in inc.writers] + spare

    def on(self, inc: Incoming, actions: list[Action]) -> list[Action]:
        """The actions of an event the receiver fed ``inc`` directly (an action's answer), settled here."""
        return self._settle(actions)

    def conn_ready(self, conn: ConnKey, now: float, epoch: int = 0) -> list[Action]:
        self.epochs[conn] = max(epoch, self.epochs.get(conn, 0))
        return self._settle([a for inc in list(self.current.values()) for a in inc.conn_ready(conn, now)])

    def fenced(self, conn: ConnKey, epoch: int, now: float) -> list[Action]:
        """P rank ``conn`` answered the hello of ``epoch`` (P answers only once nothing of D's earlier
        session is in flight and its registrations are dropped): writers quarantined before it are released."""
        self.epochs[conn] = max(epoch, self.epochs.get(conn, 0))
        out: list[Action] = []
        for inc in [*self.current.values(), *self.superseded]:
            for w in inc.writers.values():
                if w.conn == conn and w.quarantined and w.q_epoch < epoch:
                    self._bump(Count.QUARANTINES_FENCED)
                    out += inc.release(w.p_rank, now)
        return self._settle(out)

    def acknowledged(self, msg: protocol.Ack) -> bool:
        """P says where a registration's prefill stands (False: not a current writer, or D already gave up
        on it: an Ack that crossed D's abort does not extend a wait that ended)."""
        inc = self.current.get(msg.transfer_id)
        if inc is None or inc.attempt != msg.attempt or msg.rank not in inc.writers or inc.aborting is not None:
            return False
        self._bump(Count.ACKS)
        inc.acknowledged(msg.rank, msg.state, msg.tokens_ahead)
        return True

    def conn_refused(self, conn: ConnKey, reason: str, now: float) -> list[Action]:
        return self._settle([a for inc in list(self.current.values()) for a in inc.conn_refused(conn, reason, now)])

    def conn_dead(self, conn: ConnKey, reason: str, now: float, epoch: int = 0) -> list[Action]:
        """P rank ``conn`` was declared dead in the session of hello ``epoch``: its writers fail now and
        are quarantined (a frozen P resumes and writes); an abort goes out, best effort: if P is only slow,
        it reaches P before it posts the WRITE."""
        self.epochs[conn] = max(epoch, self.epochs.get(conn, 0))
        out: list[Action] = []
        dead = Failed(Stage.TRANSFER, Cause.DEAD_PEER, reason)
        until = now + self.quarantine_s
        for inc in [*self.current.values(), *self.superseded]:
            for w in inc.writers.values():
                if w.conn == conn and not w.final and not w.quarantined:
                    abort = [SendAbort(inc, w.p_rank, reason)] if w.sent else []
                    out += [*abort, *inc.quarantine(w.p_rank, dead, until, epoch, now)]
        return self._settle(out)

    def writes_on(self, conn: ConnKey) -> bool:
        """Some writer on ``conn`` is waited for (quarantined ones are not: they failed already)."""
        return any(
            w.conn == conn and not w.final and not w.quarantined
            for inc in [*self.current.values(), *self.superseded]
            for w in inc.writers.values()
        )

    def quarantined_on(self, conn: ConnKey) -> bool:
        """Some writer on ``conn`` is quarantined: a fencing hello would release it."""
        return any(
            w.conn == conn and w.quarantined
            for inc in [*self.current.values(), *self.superseded]
            for w in inc.writers.values()
        )

    def quarantined_blocks(self) -> int:
        """Blocks withheld from vLLM by quarantines (the memory cost of fencing)."""
        return sum(inc.quarantined_blocks() for inc in [*self.current.values(), *self.superseded])

    def posting(self, transfer_id: str, p_rank: int, attempt: int) -> bool:
        """P rank says it starts writing: poll this transfer busily (False: not a current writer)."""
        inc = self.current.get(transfer_id)
        if inc is None or inc.attempt != attempt or p_rank not in inc.writers:
            return False
        self.hot.add(transfer_id)
        self._bump(Count.POSTINGS)
        inc.acknowledged(p_rank, PrefillState.PUSHING, 0)
        return True

    def completion(self, msg: protocol.Completion, now: float) -> list[Action]:
        inc, w, out = self._lookup(msg.transfer_id, msg.rank, msg.attempt, fences_older=True, now=now)
        if inc is None or w is None:
            return out
        if w.quarantined:
            # A part of a writer given up on: it failed already; only an answer or fencing releases it.
            self._bump(Count.STALE_NOTIFICATIONS)
            return [*out, Stale(msg.transfer_id, msg.rank)]
        parts = inc.stats.parts
        actions = inc.completion(w, msg, now)
        self._bump(Count.PARTS, inc.stats.parts - parts)
        return self._settle(out + actions)

    def failure(self, msg: protocol.Failure, now: float) -> list[Action]:
        inc, w, out = self._lookup(msg.transfer_id, msg.rank, msg.attempt, fences_older=False, now=now)
        if inc is None or w is None:
            return out
        if w.quarantined:
            # P answers a registration only once nothing of it is in flight: that writer is fenced.
            self._bump(Count.QUARANTINES_FENCED)
            return self._settle(out + inc.release(w.p_rank, now))
        why = Failed(msg.stage, msg.cause, f"P rank {msg.rank} failed at {msg.stage}: {msg.reason}")
        return self._settle(out + inc.writer_failed(w.p_rank, why, now))

    def unpack_started(self, a: StartUnpack, marker: Any, seconds: float, now: float) -> list[Action]:
        self._bump(Count.PARTS)
        w = a.incoming.writers[a.p_rank]
        if not w.unpacking:
            self.unpacking.append((a.incoming, a.p_rank))
        return self._settle(a.incoming.unpack_started(a, marker, seconds, now))

    def abort(self, transfer_id: str, why: Failed, now: float) -> list[Action]:
        """D gives up on the current attempt (the caller, or its deadline)."""
        inc = self.current.get(transfer_id)
        if inc is None or inc.aborting is not None or inc.failure is not None:
            return []
        self._bump(Count.EXPIRED if why.cause is Cause.EXPIRED else Count.ABORTS)
        return self._settle(inc.abort(why, now, self.peer_dead_s))

    def cancel(
        self, transfer_id: str, request_id: str, writers: dict[int, ConnKey], why: Failed, now: float
    ) -> list[Action]:
        """D gives up on a transfer it may never have registered: abort it if it did; else tell its writers,
        so that a P holding the finished prefill frees it now instead of at its lease."""
        if transfer_id in self.current:
            return self.abort(transfer_id, why, now)
        self._bump(Count.CANCELS)
        return [Cancel(transfer_id, request_id, conn, why.reason) for conn in writers.values()]

    def expire(self, now: float) -> list[Action]:
        out: list[Action] = []
        for inc in [*self.current.values(), *self.superseded]:
            if inc.reported:
                continue
            if inc.aborting is None and inc.failure is None and now >= inc.deadline:
                if inc.vouched:
                    late = f"P kept the prefill queued or running past transfer_hard_cap_s ({self.hard_cap_s:g}s)"
                else:
                    late = f"no KV from P within {self.transfer_timeout_s:g}s"
                out += self.abort(inc.transfer_id, Failed(Stage.TRANSFER, Cause.EXPIRED, late), now)
            else:
                q = sum(w.quarantined for w in inc.writers.values())
                acts = inc.expire(now, self.quarantine_s, self.epochs)
                self._bump(Count.QUARANTINES_EXPIRED, max(0, q - sum(w.quarantined for w in inc.writers.values())))
                out += self._settle(acts)
        return out

    def still_unpacking(self) -> list[tuple[Incoming, int]]:
        """Writers whose unpacks are still running (the list is pruned as they end)."""
        self.unpacking = [(i, p) for i, p in self.unpacking if i.writers[p].unpacking and not i.writers[p].final]
        return list(self.unpacking)

    # -- internals -----------------------------------------------------------
    def _lookup(
        self, transfer_id: str, p_rank: int, attempt: int, fences_older: bool, now: float
    ) -> tuple[Incoming | None, Writer | None, list[Action]]:
        """The writer a message answers; also fences superseded attempts it proves dead.

        Only a *completion* of a newer attempt proves that P no longer writes
        an older one (P pushes a re-registration only after the previous
        attempt's WRITE ended). A failure of a newer attempt proves nothing: P
        may have rejected it while the older one is parked or being written.
        """
        out: list[Action] = []
        for old in list(self.superseded):
            w = old.writers.get(p_rank) if old.transfer_id == transfer_id else None
            if w is not None and not w.final and old.attempt <= attempt:
                if old.attempt == attempt:
                    return old, w, out
                if fences_older:
                    assert old.aborting is not None
                    fence = old.release(p_rank, now) if w.quarantined else old.writer_failed(p_rank, old.aborting, now)
                    out += self._settle(fence)
        inc = self.current.get(transfer_id)
        w = inc.writers.get(p_rank) if inc is not None else None
        if inc is None or w is None or attempt != inc.attempt or w.final:
            self._bump(Count.STALE_NOTIFICATIONS)
            return None, None, [*out, Stale(transfer_id, p_rank)]
        return inc, w, out

    def _settle(self, actions: list[Action]) -> list[Action]:
        """Forget transfers whose blocks are given back (a failure reported early stays until then)."""
        for a in actions:
            if not isinstance(a, Report):
                continue
            inc, tid = a.incoming, a.result.transfer_id
            if not a.result.fenced:
                self._bump(Count.FAILED)
                self._bump(Count.QUARANTINES)
                self.hot.discard(tid)
                continue
            if inc in self.superseded:
                self.superseded.remove(inc)
            elif self.current.get(tid) is inc:
                del self.current[tid]
                self.hot.discard(tid)
            if inc.failure is None:
                self._bump(Count.COMPLETED if a.result.ok else Count.FAILED)
        return actions

    def _bump(self, what: Count, by: float = 1.0) -> None:
        if by:
            self.counters[what] = self.counters.get(what, 0.0) + by
