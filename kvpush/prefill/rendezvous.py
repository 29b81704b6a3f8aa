"""Pairing D's registrations with P's finished prefills (sans-I/O).

P learns two things about a transfer, in either order: D's registration(s)
(one per D rank this P rank writes to) and its own finished prefill. This
object pairs them by the router-assigned transfer id and returns explicit
decisions; the caller does all I/O. Time is passed in, never read, so tests
drive expiry exactly.

Re-issued requests: a prefill re-announced under the same transfer id (P
preempted and re-ran it) replaces the parked one, whose blocks are released;
a registration re-sent by the same D rank (D preempted and re-allocated)
replaces the earlier one, and if the earlier one was already pushed the new
blocks are pushed again while P still holds its blocks. A new *attempt*
that arrives while the previous attempt's blocks are being written waits
(``Hold``) until that WRITE ends, then is pushed: the WRITE cannot be
recalled, so D learns the old blocks are fenced from its own completion.

P's scheduler tells it where each prefill stands (``on_prefill_state``:
queued behind N tokens, running); every registration waiting for its
prefill is acknowledged with that state (``Acknowledge``) when it arrives
and when the state changes, and a registration whose prefill P's scheduler
holds queued or running does not expire: D bounds its wait by what P
reports, and P keeps the registration while the prefill is on its way.

Each entry (``kvpush.prefill.entry``) owns the transfer's whole record on P (``Transfer``:
readiness, its push jobs, stats, stage times), so everything P knows of a
transfer is created with its entry and goes with it. The decision types
live in ``kvpush.prefill.decisions``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from kvpush.core.capability import Binding
from kvpush.core.limits import Holdings, PeerLimits
from kvpush.core.outcome import Cause, Failed, PrefillState
from kvpush.core.protocol import Register
from kvpush.prefill.decisions import Decision, Hold, Prefill, Push, Refuse, Release, TransferState
from kvpush.prefill.entry import Entry, block_count, holding, rank_key, settle
from kvpush.prefill.prefill_states import PrefillStates
from kvpush.prefill.push_job import DKey
from kvpush.prefill.released import Released
from kvpush.prefill.tombstones import Tombstones
from kvpush.prefill.transfer import Transfer


class Rendezvous:
    """Pairs registrations with finished prefills; one instance per P rank.

    Invariants: a prefill is released exactly once; a registration is either
    pushed, refused, or dropped because D aborted it; nothing waits past its
    deadline once ``expire`` is called; a push once decided ends only through
    ``on_pushed``.
    """

    def __init__(
        self, prefill_lease_s: float = 60.0, limits: PeerLimits | None = None, binding: Binding | None = None
    ) -> None:
        self.prefill_lease_s = prefill_lease_s
        self.limits = limits or PeerLimits()
        self.binding = binding
        """The capability rule (``kvpush.core.capability``); None: none checked (``"auth": "none"``, where every
        peer is the same nobody anyway)."""
        self.holdings = Holdings(self.limits)
        """What each D rank holds in the entries (registrations and their block ids), kept equal to
        the entries by every event (``_settle_holdings``)."""
        self._entries: dict[str, Entry] = {}
        self._pushing: dict[str, Entry] = {}  # entries with a push in flight (iterated every engine step)
        self._buried = Tombstones(self.limits.max_tombstones)
        """Transfers aborted before P's prefill finished (``kvpush.prefill.tombstones``): a prefill finishing
        later is released at once instead of holding its blocks for a whole lease."""
        self._states = PrefillStates()
        """What P's scheduler said of prefills not finished yet (``kvpush.prefill.prefill_states``)."""
        self._released = Released()
        """Transfers lately pushed and released (``kvpush.prefill.released``): a registration for one is late."""
        """What P's scheduler said of prefills not finished yet (``kvpush.prefill.prefill_states``)."""

    # -- events ---------------------------------------------------------
    def on_prefill(self, prefill: Prefill, now: float) -> list[Decision]:
        """P finished a prefill whose KV D will want."""
        out: list[Decision] = []
        self._states.forget(prefill.transfer_id)
        self._released.forget(prefill.transfer_id)  # finished again: a new transfer under the same id
        if prefill.transfer_id in self._buried and prefill.transfer_id not in self._entries:
            cause = self._buried.cause(prefill.transfer_id)
            if cause is Cause.NOT_NEEDED:
                return [Release(prefill, "no D rank takes this rank's copy of the KV", cause)]
            return [Release(prefill, "transfer was aborted before the prefill finished", cause)]
        if self.binding is not None:
            self.binding.expect(prefill.transfer_id)  # its registration's check, when it comes, only compares
        e = self._entries.setdefault(prefill.transfer_id, Entry())
        if e.prefill is not None and e.prefill.request_id != prefill.request_id:
            if e.in_flight:
                # The old blocks are being read; keep the new prefill waiting is
                # not possible without two sets, so refuse the new one instead.
                return [Release(prefill, "superseded prefill still transferring", Cause.SUPERSEDED)]
            out.append(Release(e.prefill, "re-issued under a new request id", Cause.SUPERSEDED, e.record))
            e.done.clear()
        e.prefill = prefill
        e.lease_deadline = now + self.prefill_lease_s
        for k, reg in e.regs.items():
            if k not in e.done and k not in e.in_flight:
                out.append(self._push(prefill.transfer_id, e, k, reg))
        return out

    def on_register(
        self, reg: Register, now: float, expected: int = 1, owner: str = "", cap: int | None = None
    ) -> list[Decision]:
        """D rank registered its blocks; ``expected`` is how many D ranks this P rank writes to.

        ``owner`` is the key the D proved (kvpush.transport.auth; "" without auth): a transfer belongs to
        the key whose registration came first, and a registration from another key is refused, so no
        peer can take a transfer (and its KV) from the D it was meant for. ``cap`` bounds the block ids
        this D rank may hold in all its open registrations (what its own cache can hold); the
        ``PeerLimits`` bound them too, with the registrations and their rate.
        """
        e = self._entries.get(reg.transfer_id)
        why = self.binding.check(reg.transfer_id, reg.capability, "registration") if self.binding else ""
        if why:
            return [Refuse(reg, why, Cause.REFUSED)]
        out: list[Decision] = []
        if e is not None and e.owner is not None and e.owner != owner:
            if not reg.capability or e.bound or e.in_flight:
                return [Refuse(reg, "the transfer is registered by another D (a different key)", Cause.REFUSED)]
            # Capabilities optional: a key that registered without one loses the transfer to the one with it.
            out = self._evict(reg.transfer_id, e, now)
            e = self._entries.get(reg.transfer_id)
        if e is not None and e.aborted:
            # Aborted while a write was in flight; the entry lives on only until it lands.
            return [Refuse(reg, "transfer was aborted", Cause.ABORTED)]
        if e is None and reg.transfer_id in self._released:
            why = "P pushed this transfer to an earlier attempt and released its KV before this registration came"
            return [Refuse(reg, why, Cause.SUPERSEDED)]
        k = rank_key(reg)
        replaced = None if e is None else (e.held.get(k) if k in e.in_flight else e.regs.get(k))
        why = self.holdings.admit(
            k, block_count(reg), now, cap, block_count(replaced) if replaced is not None else None
        )
        if why:
            return [Refuse(reg, why, Cause.OVER_LIMIT)]
        before = self.holding(reg.transfer_id)
        out += self._on_register(reg, now, expected, owner)
        self._settle_holdings(reg.transfer_id, before)
        return out

    def _evict(self, tid: str, e: Entry, now: float) -> list[Decision]:
        """The owner's registrations (made without the capability, none in flight) are refused and the
        transfer is the next registration's; a finished prefill stays parked for it."""
        before = holding(e)
        why = "another D registered this transfer with its capability"
        out: list[Decision] = [Refuse(r, why, Cause.REFUSED) for r in [*e.regs.values(), *e.held.values()]]
        e.regs, e.held, e.acked, e.owner = {}, {}, {}, None
        e.done.clear()
        if e.prefill is None:
            self._drop(tid)
        self._settle_holdings(tid, before, dropped=e.prefill is None)
        return out

    def _on_register(self, reg: Register, now: float, expected: int, owner: str) -> list[Decision]:
        e = self._entries.setdefault(reg.transfer_id, Entry())
        if e.owner is None:
            e.owner = owner
        if reg.capability:
            e.bound = True
        e.expected = expected
        k = rank_key(reg)
        old = e.regs.get(k)
        out: list[Decision] = []
        if old is not None and k in e.in_flight:
            if old.attempt == reg.attempt:
                return [Refuse(reg, "previous registration from this rank is still being written", Cause.SUPERSEDED)]
            # D re-allocated while P writes the previous attempt's blocks: this attempt waits for that WRITE.
            older = e.held.pop(k, None)
            if older is not None:
                out.append(Refuse(older, f"replaced by attempt {reg.attempt}", Cause.SUPERSEDED))
            e.held[k] = reg
            return [*out, Hold(reg)]
        if old is not None and k not in e.done and old.attempt != reg.attempt:
            # The earlier attempt will never be written: tell D so it can reuse those blocks now.
            out.append(Refuse(old, f"replaced by attempt {reg.attempt}", Cause.SUPERSEDED))
        e.regs[k] = reg
        e.done.discard(k)
        e.reg_deadline = (
            min(e.reg_deadline, now + reg.lease_ms / 1000.0) if old is None else now + reg.lease_ms / 1000.0
        )
        if e.prefill is not None:
            out.append(self._push(reg.transfer_id, e, k, reg))
        else:
            out += self._states.registered(reg.transfer_id, e, k, reg)
        return out

    def on_prefill_state(self, transfer_id: str, state: PrefillState, tokens_ahead: int) -> list[Decision]:
        """P's scheduler holds this prefill queued (behind ``tokens_ahead`` prompt tokens) or running
        (``UNKNOWN``: it no longer does, without finishing it: the abort that follows says why).

        Registrations waiting for it are told when the state changes; while it
        is queued or running they do not expire.
        """
        self._states.note(transfer_id, state, tokens_ahead)
        e = self._entries.get(transfer_id)
        if e is None or e.prefill is not None:
            return []
        return list(self._states.changed(transfer_id, e))

    def on_pushed(self, transfer_id: str, engine_id: str, rank: int) -> list[Decision]:
        """A WRITE (plus notification) to that D rank finished, successfully or not."""
        before = self.holding(transfer_id)
        out = self._on_pushed(transfer_id, engine_id, rank)
        self._settle_holdings(transfer_id, before)
        return out

    def _on_pushed(self, transfer_id: str, engine_id: str, rank: int) -> list[Decision]:
        e = self._entries.get(transfer_id)
        if e is None:
            return []
        k = (engine_id, rank)
        self._settle(transfer_id, e, k)
        held = e.held.pop(k, None)
        if held is not None and e.prefill is not None and not e.aborted:
            # Only the new attempt's outcome counts now.
            e.record.failed = None
            e.regs[k] = held
            return [self._push(transfer_id, e, k, held)]
        if held is not None:
            return [Refuse(held, "transfer was aborted", Cause.ABORTED), *self._maybe_release(transfer_id, e)]
        return self._maybe_release(transfer_id, e)

    def push_ended(self, transfer_id: str, key: DKey, failed: Failed | None) -> list[Decision]:
        """A push job is over (or never started): note why it failed, then ``on_pushed``."""
        e = self._entries.get(transfer_id)
        if e is not None and failed is not None:
            e.record.failed = failed
        return self.on_pushed(transfer_id, *key)

    def may_abort(self, transfer_id: str, key: str, by: DKey, capability: str = "") -> str:
        """Why D rank ``by``, of D key ``key``, may not abort this transfer ("" if it may).

        An abort must carry the transfer's capability (``binding``), so no D that merely knows the id
        can kill it. A transfer a D registered belongs to that D's key: no other key may abort it. One
        that no D registered yet (a prefill parked, or nothing here: D gave up before it had blocks) may
        be cancelled by a D with its capability, which leaves a tombstone when P's prefill has not
        finished; a D rank holds at most ``max_peer_tombstones`` of those, so a flood of aborts costs a
        bounded amount of memory.
        """
        why = self.binding.check(transfer_id, capability, "abort") if self.binding else ""
        if why:
            return why
        e = self._entries.get(transfer_id)
        if e is not None and e.owner is not None and e.owner != key:
            return "the transfer is registered by another D (a different key)"
        buries = (e is None or e.prefill is None) and transfer_id not in self._buried
        held = self.tombstones(by)
        if buries and held >= self.limits.max_peer_tombstones:
            return (
                f"this D rank left {held} aborts of unknown transfers already (limit {self.limits.max_peer_tombstones})"
            )
        return ""

    def _on_abort(
        self, transfer_id: str, now: float, reason: str, cause: Cause, by: DKey | None = None
    ) -> list[Decision]:
        """What is left of an abort once its registrations are answered: in-flight writes finish first (fencing
        is D's job); ``by``: the D rank whose abort this is (None: P's own), a tombstone it leaves counts
        against it."""
        e = self._entries.get(transfer_id)
        self._states.forget(transfer_id)
        if e is None or e.prefill is None:
            self._buried.bury(transfer_id, now + self.prefill_lease_s, by, cause)
        if e is None:
            return []
        e.regs = {k: r for k, r in e.regs.items() if k in e.in_flight}
        if e.in_flight:
            e.expected = len(e.done) + len(e.in_flight)
            e.aborted = True
            return []
        self._drop(transfer_id)
        return [Release(e.prefill, reason, cause, e.record)] if e.prefill is not None else []

    def cancel(self, transfer_id: str, now: float, why: Failed, by: DKey | None = None) -> list[Decision]:
        """P's whole rule for an abort: answer every registration that will not be written
        (waiting, held, or paired but not started), stop the pushes running; the writes in flight finish
        first, and the prefill is released once they have (at once when none is)."""
        before = self.holding(transfer_id)
        out = self._cancel(transfer_id, now, why, by)
        self._settle_holdings(transfer_id, before)
        return out

    def _cancel(self, transfer_id: str, now: float, why: Failed, by: DKey | None) -> list[Decision]:
        e = self._entries.get(transfer_id)
        if e is None:
            return self._on_abort(transfer_id, now, why.reason, why.cause, by)
        out: list[Decision] = [Refuse(r, why.reason, why.cause) for r in e.held.values()]
        e.held.clear()
        for k in list(e.in_flight):
            job = e.record.jobs.get(k)
            if job is None:  # paired in this step, not started: it never will be
                out.append(Refuse(e.regs[k], why.reason, why.cause))
                self._settle(transfer_id, e, k)
            else:
                job.cancel(why.cause, why.reason, discard=by is not None)  # D's abort: it counts nothing more
        out += [Refuse(r, why.reason, why.cause) for k, r in e.regs.items() if k not in e.in_flight | e.done]
        return out + self._on_abort(transfer_id, now, why.reason, why.cause, by)

    def drop_peer(self, key: DKey, now: float, reason: str) -> list[Decision]:
        """D rank ``key`` is forgotten (dead or restarted): abort what it registered and cancel its pushes.

        Nothing reaches the forgotten rank; the other D ranks of its transfers
        hear that their waiting registrations will not be written, while their
        pushes already running finish.
        """
        out: list[Decision] = []
        for tid, e in list(self._entries.items()):
            before = holding(e)
            e.held.pop(key, None)
            job = e.record.jobs.get(key)
            if job is not None:
                job.peer_gone(reason)
            if key in e.regs and key not in e.done:
                waiting = [r for k, r in e.regs.items() if k != key and k not in e.in_flight | e.done]
                out += [Refuse(r, reason, Cause.DEAD_PEER) for r in waiting]
                out += self._on_abort(tid, now, reason, Cause.DEAD_PEER)
            self._settle_holdings(tid, before)
        self.holdings.forget(key)
        return out

    def expire(self, now: float) -> list[Decision]:
        """Drop what waited past its deadline; never touches in-flight writes, nor registrations whose
        prefill P's scheduler holds queued or running (their lease lives as long as the prefill does)."""
        out: list[Decision] = []
        self._buried.expire(now)
        for tid in list(self._entries):
            e = self._entries[tid]
            if e.in_flight:
                continue
            if e.prefill is not None and now >= e.lease_deadline:
                out.append(Release(e.prefill, "lease expired: no registration arrived", Cause.EXPIRED, e.record))
                out.extend(
                    Refuse(r, "prefill lease expired", Cause.EXPIRED) for k, r in e.regs.items() if k not in e.done
                )
                self._settle_holdings(tid, holding(e), dropped=True)
                self._drop(tid)
            elif e.prefill is None and e.regs and now >= e.reg_deadline and tid not in self._states:
                out.extend(
                    Refuse(r, "registration expired: prefill never finished here", Cause.EXPIRED)
                    for r in e.regs.values()
                )
                self._settle_holdings(tid, holding(e), dropped=True)
                self._drop(tid)
        return out

    # -- queries --------------------------------------------------------
    def stage(self, transfer_id: str) -> TransferState | None:
        """Where the transfer stands on P (None: P does not know it); ``pending`` counts transfers by it."""
        e = self._entries.get(transfer_id)
        return e.stage() if e is not None else None

    def record(self, transfer_id: str) -> Transfer | None:
        """The transfer's record, if P knows the transfer."""
        e = self._entries.get(transfer_id)
        return e.record if e is not None else None

    def wake_at(self, transfer_id: str) -> int:
        """The fewest ready regions that can start one of its parts (0: any report may).

        Safe from another thread (the forward's): one dict lookup and one attribute read.
        """
        e = self._entries.get(transfer_id)
        return e.record.wake_at if e is not None else 0

    def pushing(self) -> Iterator[tuple[str, Transfer]]:
        """Transfers with a push in flight, and their records."""
        for tid, e in list(self._pushing.items()):
            yield tid, e.record

    def unstarted(self, transfer_id: str) -> list[Push]:
        """Pushes decided and not started yet: the engine starts them at its step's end, after every message
        read in the step, so an abort that came with the registration cancels them."""
        e = self._entries.get(transfer_id)
        return e.unstarted() if e is not None else []

    def registrations(self, transfer_id: str) -> list[tuple[Register, bool]]:
        """The transfer's registrations and whether each is being written now."""
        e = self._entries.get(transfer_id)
        return e.registrations() if e is not None else []

    def pending(self) -> dict[str, int]:
        """Counts for metrics: parked prefills, waiting registrations, transfers in flight."""
        stages = Counter(e.stage() for e in self._entries.values())
        parked = stages[TransferState.WAITING_FOR_REGISTRATION]
        waiting = stages[TransferState.WAITING_FOR_PREFILL]
        flying = sum(len(e.in_flight) for e in self._pushing.values())
        return {"parked_prefills": parked, "waiting_registrations": waiting, "in_flight": flying}

    def tombstones(self, by: DKey | None = None) -> int:
        """Transfers remembered as aborted before their prefill finished; ``by``: those the aborts of that D
        rank left (what its ``max_peer_tombstones`` counts)."""
        return len(self._buried) if by is None else self._buried.left_by(by)

    def queued(self) -> int:
        """Prefills P's scheduler holds queued (not running yet)."""
        return self._states.queued()

    def __len__(self) -> int:
        return len(self._entries)

    def holding(self, tid: str) -> dict[DKey, tuple[int, int]]:
        """(registrations, block ids) each D rank holds in transfer ``tid``'s entry: what every event settles
        ``holdings`` by."""
        e = self._entries.get(tid)
        return holding(e) if e is not None else {}

    # -- internals ------------------------------------------------------

    def _settle_holdings(self, tid: str, before: dict[DKey, tuple[int, int]], dropped: bool = False) -> None:
        """Bring ``holdings`` to what entry ``tid`` holds now, given what it held ``before`` the event."""
        settle(self.holdings, before, {} if dropped else self.holding(tid))

    def _push(self, tid: str, e: Entry, k: DKey, reg: Register) -> Push:
        assert e.prefill is not None
        e.done.discard(k)
        e.in_flight.add(k)
        self._pushing[tid] = e
        return Push(e.prefill, reg)

    def _settle(self, tid: str, e: Entry, k: DKey) -> None:
        """A decided push to ``k`` is over (written, failed, or never started)."""
        e.in_flight.discard(k)
        e.done.add(k)
        if not e.in_flight:
            self._pushing.pop(tid, None)

    def _drop(self, tid: str) -> None:
        del self._entries[tid]
        self._pushing.pop(tid, None)

    def _maybe_release(self, tid: str, e: Entry) -> list[Decision]:
        if e.in_flight or len(e.done) < e.expected or e.prefill is None:
            return []
        self._drop(tid)
        self._released.add(tid)
        return [Release(e.prefill, "pushed", None, e.record)]
