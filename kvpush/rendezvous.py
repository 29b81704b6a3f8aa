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
blocks are pushed again while P still holds its blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.protocol import Register


class Stage(enum.StrEnum):
    """Per-transfer state on P, visible in logs and metrics."""

    WAITING_FOR_PREFILL = "waiting_for_prefill"
    WAITING_FOR_REGISTRATION = "waiting_for_registration"
    TRANSFERRING = "transferring"
    DONE = "done"
    EXPIRED = "expired"
    ABORTED = "aborted"


@dataclass(frozen=True)
class Prefill:
    """P's finished prefill: its blocks (per group) and how many tokens they hold."""

    transfer_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


@dataclass(frozen=True)
class Push:
    """Write ``prefill``'s KV into the blocks of ``reg`` now."""

    prefill: Prefill
    reg: Register


@dataclass(frozen=True)
class Release:
    """P may free the prefill's blocks: every expected push finished, or none will come."""

    prefill: Prefill
    reason: str


@dataclass(frozen=True)
class Refuse:
    """Tell D's rank that this registration will not be written."""

    reg: Register
    reason: str


Decision = Push | Release | Refuse


@dataclass
class _Entry:
    prefill: Prefill | None = None
    regs: dict[tuple[str, int], Register] = field(default_factory=dict)
    in_flight: set[tuple[str, int]] = field(default_factory=set)
    done: set[tuple[str, int]] = field(default_factory=set)
    expected: int = 1
    aborted: bool = False
    reg_deadline: float = float("inf")
    lease_deadline: float = float("inf")


def _key(reg: Register) -> tuple[str, int]:
    return (reg.engine_id, reg.rank)


class Rendezvous:
    """Pairs registrations with finished prefills; one instance per P rank.

    Invariants: a prefill is released exactly once; a registration is either
    pushed, refused, or dropped because D aborted it; nothing waits past its
    deadline once ``expire`` is called.
    """

    def __init__(self, prefill_lease_s: float = 60.0) -> None:
        self.prefill_lease_s = prefill_lease_s
        self._entries: dict[str, _Entry] = {}
        # Transfers aborted before P's prefill finished, until when to remember
        # them: a prefill finishing later is released at once instead of
        # holding its blocks for a whole lease.
        self._tombstones: dict[str, float] = {}

    # -- events ---------------------------------------------------------
    def on_prefill(self, prefill: Prefill, now: float) -> list[Decision]:
        """P finished a prefill whose KV D will want."""
        out: list[Decision] = []
        if prefill.transfer_id in self._tombstones and prefill.transfer_id not in self._entries:
            return [Release(prefill, "transfer was aborted before the prefill finished")]
        e = self._entries.setdefault(prefill.transfer_id, _Entry())
        if e.prefill is not None and e.prefill.request_id != prefill.request_id:
            if e.in_flight:
                # The old blocks are being read; keep the new prefill waiting is
                # not possible without two sets, so refuse the new one instead.
                return [Release(prefill, "superseded prefill still transferring")]
            out.append(Release(e.prefill, "re-issued under a new request id"))
            e.done.clear()
        e.prefill = prefill
        e.lease_deadline = now + self.prefill_lease_s
        for k, reg in e.regs.items():
            if k not in e.done and k not in e.in_flight:
                e.in_flight.add(k)
                out.append(Push(prefill, reg))
        return out

    def on_register(self, reg: Register, now: float, expected: int = 1) -> list[Decision]:
        """D rank registered its blocks; ``expected`` is how many D ranks this P rank writes to."""
        e = self._entries.setdefault(reg.transfer_id, _Entry())
        if e.aborted:
            # Aborted while a write was in flight; the entry lives on only until it lands.
            return [Refuse(reg, "transfer was aborted")]
        e.expected = expected
        k = _key(reg)
        old = e.regs.get(k)
        if old is not None and k in e.in_flight:
            return [Refuse(reg, "previous registration from this rank is still being written")]
        e.regs[k] = reg
        e.done.discard(k)
        e.reg_deadline = (
            min(e.reg_deadline, now + reg.lease_ms / 1000.0) if old is None else now + reg.lease_ms / 1000.0
        )
        if e.prefill is not None:
            e.in_flight.add(k)
            return [Push(e.prefill, reg)]
        return []

    def on_pushed(self, transfer_id: str, engine_id: str, rank: int) -> list[Decision]:
        """A WRITE (plus notification) to that D rank finished, successfully or not."""
        e = self._entries.get(transfer_id)
        if e is None:
            return []
        k = (engine_id, rank)
        e.in_flight.discard(k)
        e.done.add(k)
        return self._maybe_release(transfer_id, e)

    def on_abort(self, transfer_id: str, now: float, reason: str = "aborted") -> list[Decision]:
        """Either side gave up. In-flight writes finish first (fencing is D's job)."""
        e = self._entries.get(transfer_id)
        if e is None or e.prefill is None:
            self._tombstones[transfer_id] = now + self.prefill_lease_s
        if e is None:
            return []
        e.regs = {k: r for k, r in e.regs.items() if k in e.in_flight}
        if e.in_flight:
            e.expected = len(e.done) + len(e.in_flight)
            e.aborted = True
            return []
        del self._entries[transfer_id]
        return [Release(e.prefill, reason)] if e.prefill is not None else []

    def expire(self, now: float) -> list[Decision]:
        """Drop what waited past its deadline; never touches in-flight writes."""
        out: list[Decision] = []
        self._tombstones = {t: until for t, until in self._tombstones.items() if until > now}
        for tid in list(self._entries):
            e = self._entries[tid]
            if e.in_flight:
                continue
            if e.prefill is not None and now >= e.lease_deadline:
                out.append(Release(e.prefill, "lease expired: no registration arrived"))
                out.extend(Refuse(r, "prefill lease expired") for k, r in e.regs.items() if k not in e.done)
                del self._entries[tid]
            elif e.prefill is None and e.regs and now >= e.reg_deadline:
                out.extend(Refuse(r, "registration expired: prefill never finished here") for r in e.regs.values())
                del self._entries[tid]
        return out

    # -- queries --------------------------------------------------------
    def stage(self, transfer_id: str) -> Stage | None:
        e = self._entries.get(transfer_id)
        if e is None:
            return None
        if e.in_flight:
            return Stage.TRANSFERRING
        if e.prefill is None:
            return Stage.WAITING_FOR_PREFILL
        return Stage.WAITING_FOR_REGISTRATION

    def registrations(self, transfer_id: str) -> list[tuple[Register, bool]]:
        """The transfer's registrations and whether each is being written now."""
        e = self._entries.get(transfer_id)
        if e is None:
            return []
        return [(r, k in e.in_flight) for k, r in e.regs.items() if k not in e.done]

    def transfers_of(self, engine_id: str) -> list[str]:
        """Transfers with a registration from D engine ``engine_id`` (for dead-peer handling)."""
        return [tid for tid, e in self._entries.items() if any(k[0] == engine_id for k in e.regs)]

    def pending(self) -> dict[str, int]:
        """Counts for metrics: parked prefills, waiting registrations, transfers in flight."""
        parked = sum(1 for e in self._entries.values() if e.prefill is not None and not e.in_flight)
        waiting = sum(1 for e in self._entries.values() if e.prefill is None)
        flying = sum(len(e.in_flight) for e in self._entries.values())
        return {"parked_prefills": parked, "waiting_registrations": waiting, "in_flight": flying}

    def __len__(self) -> int:
        return len(self._entries)

    def _maybe_release(self, tid: str, e: _Entry) -> list[Decision]:
        if e.in_flight or len(e.done) < e.expected or e.prefill is None:
            return []
        del self._entries[tid]
        return [Release(e.prefill, "pushed")]
