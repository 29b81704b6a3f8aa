"""One transfer's pairing state on P, and what its registrations hold (sans-I/O).

The rendezvous (``kvpush.prefill.rendezvous``) keeps one ``Entry`` per
transfer id: the finished prefill if any, each D rank's registration, which
of them are being written or done, the new attempts held behind a WRITE in
flight, the deadlines, the owner key, and the transfer's whole record. An
entry is data only; the rules that change it are the rendezvous's.

``holding`` is what the entry holds per D rank (registrations and their
block ids): the rendezvous settles its per-rank ``Holdings`` by the change
in it across every event, so the limits always count what the entries hold,
never a separate tally that could drift from them. The entry also answers
read-only questions about itself (where it stands, what is left to start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.core.limits import Holdings
from kvpush.core.outcome import PrefillState
from kvpush.core.protocol import Register
from kvpush.prefill.decisions import Prefill, Push, TransferState
from kvpush.prefill.push_job import DKey
from kvpush.prefill.transfer import Transfer


@dataclass
class Entry:
    """One transfer id's prefill, registrations and record on P."""

    prefill: Prefill | None = None
    regs: dict[DKey, Register] = field(default_factory=dict)
    in_flight: set[DKey] = field(default_factory=set)
    done: set[DKey] = field(default_factory=set)
    held: dict[DKey, Register] = field(default_factory=dict)  # new attempts waiting for a WRITE in flight
    expected: int = 1
    aborted: bool = False
    reg_deadline: float = float("inf")
    lease_deadline: float = float("inf")
    record: Transfer = field(default_factory=Transfer)
    owner: str | None = None  # the D key whose registration came first: only it may register again or abort
    bound: bool = False  # the owner's registration carried the transfer's capability
    acked: dict[DKey, PrefillState] = field(default_factory=dict)  # the state each registration was last told

    def stage(self) -> TransferState:
        """Where the transfer stands on P."""
        if self.in_flight:
            return TransferState.TRANSFERRING
        return TransferState.WAITING_FOR_PREFILL if self.prefill is None else TransferState.WAITING_FOR_REGISTRATION

    def unstarted(self) -> list[Push]:
        """Pushes decided and not started yet (no job in the record)."""
        if self.prefill is None:
            return []
        return [Push(self.prefill, self.regs[k]) for k in sorted(self.in_flight) if k not in self.record.jobs]

    def registrations(self) -> list[tuple[Register, bool]]:
        """The registrations not done yet, and whether each is being written now."""
        return [(r, k in self.in_flight) for k, r in self.regs.items() if k not in self.done]


def rank_key(reg: Register) -> DKey:
    """The D rank a registration comes from."""
    return (reg.engine_id, reg.rank)


def block_count(reg: Register) -> int:
    """Block ids a registration holds (all groups)."""
    return sum(len(g) for g in reg.block_ids)


def holding(e: Entry) -> dict[DKey, tuple[int, int]]:
    """(registrations, block ids) each D rank holds in this entry."""
    out: dict[DKey, tuple[int, int]] = {}
    for regs in (e.regs, e.held):
        for k, r in regs.items():
            n, ids = out.get(k, (0, 0))
            out[k] = (n + 1, ids + block_count(r))
    return out


def settle(holdings: Holdings, before: dict[DKey, tuple[int, int]], after: dict[DKey, tuple[int, int]]) -> None:
    """Bring ``holdings`` from what an entry held ``before`` an event to what it holds ``after`` it."""
    for k in before.keys() | after.keys():
        (n0, b0), (n1, b1) = before.get(k, (0, 0)), after.get(k, (0, 0))
        if (n0, b0) != (n1, b1):
            holdings.change(k, n1 - n0, b1 - b0)
