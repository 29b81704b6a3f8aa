"""D's fencing: every transfer D registered and not yet reported, and when it may report each (sans-I/O).

``Fencing`` keeps every attempt D made (``kvpush.decode.incoming.Incoming``),
current and superseded, routes each event to the attempts it concerns (a
completion, P's failure, an Ack, a link ready, refused or declared dead, a
fencing hello answered, time passing, the answer to one of its actions) and
settles their actions (``kvpush.decode.fencing_actions``), which carry what the
receiver needs: the receiver's one entry, it never reads an ``Incoming``. A
transfer is forgotten once a fenced Report gives its blocks back. A re-issued
registration gets a new *attempt*; the older attempt stays (superseded) until
P answers it or a completion of a newer attempt proves P no longer writes it
(P pushes a new attempt only after the previous WRITE ended). Time is passed in.
"""

from __future__ import annotations

from typing import Any

from kvpush.core import protocol
from kvpush.core.counts import Count
from kvpush.core.outcome import Cause, Failed, PrefillState, Stage
from kvpush.core.protocol import StagingGrant
from kvpush.core.topology import ConnKey
from kvpush.decode.allow import Allowed
from kvpush.decode.fencing_actions import (
    Acknowledged,
    Cancel,
    Foreign,
    HelloAgain,
    Overdue,
    Report,
    Stale,
    StartUnpack,
)
from kvpush.decode.incoming import Action, Asked, Incoming, Writer
from kvpush.decode.link import LinkNews, Ready, Refused


class Fencing:
    """Every transfer D registered and not yet reported, current attempts and superseded ones."""

    def __init__(
        self,
        nregions: int,
        transfer_timeout_s: float,
        peer_dead_s: float,
        hard_cap_s: float = float("inf"),
        quarantine_s: float = float("inf"),
        allowed: Allowed | None = None,
        credit_every: float = float("inf"),
    ) -> None:
        self.nregions = nregions
        self.credit_every = credit_every
        """How often a writer in rounds that still owes parts hears D's latest credit again."""
        self.allowed = allowed or Allowed()
        """The P side channels D may dial (``allowed_prefills``): a registration or cancel naming another
        fails before any connection."""
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
        refused = self._not_allowed([*writers.values(), *(bystanders or {}).values()])
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
        if refused:
            # No writer got the registration: the transfer fails now, its blocks free at once.
            return out + self._settle(
                [a for conn in set(writers.values()) for a in inc.conn_refused(conn, refused, now)]
            )
        why = f"D takes this KV from P ranks {sorted(writers)}"
        spare = [
            Cancel(transfer_id, asked.request_id, conn, why, asked.capability) for conn in (bystanders or {}).values()
        ]
        return out + [inc.send_register(p) for p in inc.writers] + spare

    # -- answers to the actions (the attempt is the action's ``incoming``) ---------
    def register_sent(
        self, inc: Incoming, p: int, grant: StagingGrant | None, unpack: Any, region_bytes: int, ok: bool, t: float
    ) -> list[Action]:
        """``SendRegister`` done: the registration left (``ok``), with this staging grant and unpack list, in the
        session of the link's latest hello."""
        inc.writers[p].epoch = self.epochs.get(inc.writers[p].conn, 0)
        return self._settle(inc.register_sent(p, grant, unpack, region_bytes, ok, t))

    def refused(self, inc: Incoming, conn: ConnKey, reason: str, now: float) -> list[Action]:
        """``SendRegister`` found the link to ``conn`` refused: the attempt's writers there fail."""
        return self._settle(inc.conn_refused(conn, reason, now))

    def writer_failed(self, inc: Incoming, p: int, why: Failed, now: float) -> list[Action]:
        """Writer ``p`` will not complete: a registration P cannot take, or an unpack that failed."""
        return self._settle(inc.writer_failed(p, why, now))

    def unreachable(self, inc: Incoming, p: int, reason: str, now: float) -> list[Action]:
        """``SendAbort`` found writer ``p``'s link not ready: it ends with the abort (if not quarantined)."""
        why = inc.aborting or Failed(Stage.TRANSFER, Cause.ABORTED, reason)
        return self._settle(inc.writer_failed(p, why, now))

    def unpacked(self, inc: Incoming, p: int, marker: Any, now: float) -> list[Action]:
        """Writer ``p``'s unpack of ``marker`` is done ([] unless it is the writer's oldest one running)."""
        w = inc.writers.get(p)
        if w is None or w.final or not w.unpacking or w.unpacking[0][2] is not marker:
            return []
        return self._settle(inc.unpacked(p, now))

    def on_link(self, news: LinkNews, now: float) -> list[Action]:
        """What D's links say: ready (writers quarantined before its epoch are fenced, then waiting ones register),
        refused (a busy refusal fails nothing: an earlier session still writes; it asks again), or dead."""
        if isinstance(news, Ready):
            return self.fenced(news.key, news.epoch, now) + self.conn_ready(news.key, now, news.epoch)
        if isinstance(news, Refused):
            return [] if news.busy else self.conn_refused(news.key, news.reason, now)
        return self.conn_dead(news.key, news.reason, now, news.epoch)

    def conn_ready(self, conn: ConnKey, now: float, epoch: int = 0) -> list[Action]:
        self.epochs[conn] = max(epoch, self.epochs.get(conn, 0))
        return self._settle([a for inc in list(self.current.values()) for a in inc.conn_ready(conn, now)])

    def fenced(self, conn: ConnKey, epoch: int, now: float) -> list[Action]:
        """P rank ``conn`` answered the hello of ``epoch`` (P answers only once nothing of D's earlier
        session is in flight and its registrations are dropped): writers quarantined before it are released,
        and writers still waiting on a registration of an earlier session fail (P dropped it: it will never
        be written nor answered)."""
        self.epochs[conn] = max(epoch, self.epochs.get(conn, 0))
        out: list[Action] = []
        dropped = Failed(
            Stage.REGISTER,
            Cause.DEAD_PEER,
            f"P {conn[0]}:{conn[1]} dropped the registration: it "
            "had forgotten this D rank, or this D rank said hello again",
        )
        for inc in [*self.current.values(), *self.superseded]:
            for w in inc.writers.values():
                if w.conn != conn or w.final:
                    continue
                if w.quarantined and w.q_epoch < epoch:
                    self._bump(Count.QUARANTINES_FENCED)
                    out += inc.release(w.p_rank, now)
                elif not w.quarantined and w.sent and w.epoch < epoch:
                    out += inc.writer_failed(w.p_rank, dropped, now)
        return self._settle(out)

    def fenced_for_good(self, conns: set[ConnKey], reason: str, now: float) -> list[Action]:
        """The operator declared the P ranks at ``conns`` gone for good (``kvpush fence``: the process was
        killed, its pod deleted): none of them can write again, so every writer on them ends now, fenced.

        A quarantined writer is released (its blocks go back); a writer still waited on (D had not declared
        its P rank dead yet) fails now instead of after ``peer_dead_s``. Writers on other P ranks are left
        alone. The declaration is the operator's word, as a STONITH fence is a cluster's: kvpush cannot tell a
        killed P from a frozen one, which is why nothing else releases a quarantine early. ``reason`` says who
        fenced, for the transfers that fail."""
        out: list[Action] = []
        gone = Failed(Stage.TRANSFER, Cause.DEAD_PEER, reason)
        for inc in [*self.current.values(), *self.superseded]:
            for w in inc.writers.values():
                if w.conn not in conns or w.final:
                    continue
                if w.quarantined:
                    self._bump(Count.QUARANTINES_FENCED)
                    out += inc.release(w.p_rank, now)
                else:
                    out += inc.writer_failed(w.p_rank, gone, now)
        return self._settle(out)

    def acknowledged(self, msg: protocol.Ack) -> list[Action]:
        """P says where a registration's prefill stands ([]: not a current writer, or D already gave up on
        it: an Ack that crossed D's abort does not extend a wait that ended)."""
        inc = self.current.get(msg.transfer_id)
        if inc is None or inc.attempt != msg.attempt or msg.rank not in inc.writers or inc.aborting is not None:
            return []
        self._bump(Count.ACKS)
        inc.acknowledged(msg.rank, msg.state, msg.tokens_ahead)
        return [Acknowledged(msg.transfer_id, msg.rank, msg.state, msg.tokens_ahead)]

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
                    abort = [inc.send_abort(w.p_rank, reason)] if w.sent else []
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

    def posting(self, transfer_id: str, p_rank: int, attempt: int) -> list[Action]:
        """P rank says it starts writing: poll this transfer busily (``drains``). Each counts as received; one for a
        transfer not current (reported: its completion overtook it) or not this writer's changes nothing else."""
        self._bump(Count.POSTINGS)
        inc = self.current.get(transfer_id)
        if inc is None or inc.attempt != attempt or p_rank not in inc.writers:
            return []
        self.hot.add(transfer_id)
        inc.acknowledged(p_rank, PrefillState.PUSHING, 0)
        return []

    def completion(self, msg: protocol.Completion, now: float, sender: ConnKey | None = None) -> list[Action]:
        """A part of ``msg.rank``'s push arrived. ``sender``: the P rank the notification came from (None:
        not checked, for callers that know it); only the P rank the transfer's registration went to is
        heard, so no other holder of the P key can complete (or fail, ``failure``) a transfer."""
        foreign = self._foreign(msg.transfer_id, msg.rank, msg.attempt, sender)
        if foreign:
            return foreign
        inc, w, out = self._lookup(msg.transfer_id, msg.rank, msg.attempt, fences_older=True, now=now)
        if inc is None or w is None:
            return out
        if w.quarantined:
            # A part of a writer given up on: it failed already and the part is not used; once every region
            # of the attempt has landed, nothing more of it can (P writes each region once per attempt).
            self._bump(Count.STALE_NOTIFICATIONS)
            landed = inc.late_part(w, msg, now)
            if landed:
                self._bump(Count.QUARANTINES_FENCED)
            return self._settle([*out, Stale(msg.transfer_id, msg.rank), *landed])
        parts = inc.stats.parts
        actions = inc.completion(w, msg, now)
        self._bump(Count.PARTS, inc.stats.parts - parts)
        return self._settle(out + actions)

    def failure(self, msg: protocol.Failure, now: float, sender: ConnKey | None = None) -> list[Action]:
        foreign = self._foreign(msg.transfer_id, msg.rank, msg.attempt, sender)
        if foreign:
            return foreign
        inc, w, out = self._lookup(msg.transfer_id, msg.rank, msg.attempt, fences_older=False, now=now)
        if inc is None or w is None:
            return out
        if w.quarantined:
            # P answers a registration only once nothing of it is in flight: that writer is fenced.
            self._bump(Count.QUARANTINES_FENCED)
            return self._settle(out + inc.release(w.p_rank, now))
        if msg.stage is Stage.HANDSHAKE:
            # P has no hello of this D rank's session (it forgot D, silent past its peer_dead_s, while D's link
            # still looked live to D): say hello again and register once more.
            again = inc.forgotten(w.p_rank)
            if again is not None:
                return self._settle([*out, HelloAgain(w.conn), *again])
        why = Failed(msg.stage, msg.cause, f"P rank {msg.rank} failed at {msg.stage}: {msg.reason}")
        return self._settle(out + inc.writer_failed(w.p_rank, why, now))

    def unpack_started(self, a: StartUnpack, marker: Any, seconds: float, now: float) -> list[Action]:
        """``StartUnpack`` done: its unpack runs (``marker``), it took ``seconds`` to start."""
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
        self,
        transfer_id: str,
        request_id: str,
        writers: dict[int, ConnKey],
        why: Failed,
        now: float,
        capability: str = "",
    ) -> list[Action]:
        """D gives up on a transfer it may never have registered: abort it if it did; else tell its writers,
        so that a P holding the finished prefill frees it now instead of at its lease."""
        if transfer_id in self.current:
            return self.abort(transfer_id, why, now)
        if self._not_allowed(list(writers.values())):
            return []  # D never dials a P outside its allow-list; that P's lease frees the prefill
        self._bump(Count.CANCELS)
        return [Cancel(transfer_id, request_id, conn, why.reason, capability) for conn in writers.values()]

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
                acts = inc.expire(now, self.quarantine_s, self.epochs, self.credit_every)
                self._bump(Count.QUARANTINES_OVERDUE, sum(isinstance(a, Overdue) for a in acts))
                out += self._settle(acts)
        return out

    def poll_unpacks(self) -> list[Action]:
        """Time to look at the unpacks still running: one ``AwaitUnpacks`` per writer with some (the list of
        such writers is pruned as they end)."""
        self.unpacking = [(i, p) for i, p in self.unpacking if i.writers[p].unpacking and not i.writers[p].final]
        return [i.await_unpacks(p, block=False) for i, p in self.unpacking]

    # -- queries (the receiver's loop and gauges) -------------------------------------
    def listening(self) -> bool:
        """Some attempt, current or superseded, may still hear from P: its notifications are polled."""
        return bool(self.current or self.superseded)

    def drains(self) -> bool:
        """A P rank said it is writing some transfer: notifications are drained, not sampled."""
        return bool(self.hot)

    def busy(self) -> bool:
        """Work that the loop must come back to at once: transfers being written, fencing, unpacks."""
        return bool(self.hot or self.superseded or self.unpacking)

    def superseded_count(self) -> int:
        """Attempts replaced by a re-issued registration whose writers are not fenced yet."""
        return len(self.superseded)

    # -- internals -----------------------------------------------------------
    def _not_allowed(self, conns: list[ConnKey]) -> str:
        """Why one of these P side channels may not be dialed ("" if all may)."""
        return next((why for why in (self.allowed.why_not(*c) for c in conns) if why), "")

    def _foreign(self, transfer_id: str, p_rank: int, attempt: int, sender: ConnKey | None) -> list[Action]:
        """[Foreign] when ``sender`` is not the P rank whose writer the message names (in the attempt it
        names, current or superseded); [] when it is, or when no such writer exists (``_lookup`` then
        calls the message stale)."""
        if sender is None:
            return []
        for inc in [self.current.get(transfer_id), *self.superseded]:
            if inc is None or inc.transfer_id != transfer_id or inc.attempt != attempt:
                continue
            w = inc.writers.get(p_rank)
            if w is not None and w.conn != sender:
                self._bump(Count.FOREIGN_MESSAGES)
                return [Foreign(transfer_id, p_rank, sender)]
        return []

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
