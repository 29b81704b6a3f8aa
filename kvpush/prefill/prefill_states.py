"""Where P's scheduler holds the prefills not finished yet, and what registrations waiting for them are told.

P's scheduler reports each prefill it holds: queued behind N prompt tokens,
or running (``Rendezvous.on_prefill_state``). A registration that arrives
before its prefill finished is acknowledged with that state, and again each
time it changes (``Acknowledge``), so D bounds its wait by what P reports
instead of by a fixed lease; while the scheduler holds the prefill queued
or running, the rendezvous lets no registration of it expire. Only a known
state is ever sent: silence says "unknown" as well as an ack would, and
what follows a prefill the scheduler dropped (an abort) says why.
"""

from __future__ import annotations

from kvpush.core.outcome import PrefillState
from kvpush.core.protocol import Register
from kvpush.prefill.decisions import Acknowledge
from kvpush.prefill.entry import Entry
from kvpush.prefill.push_job import DKey


class PrefillStates:
    """Transfer id -> (state, prompt tokens ahead of it) for the prefills P's scheduler holds."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[PrefillState, int]] = {}

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._of

    def note(self, transfer_id: str, state: PrefillState, tokens_ahead: int) -> None:
        """The scheduler's report (``UNKNOWN``, ``PUSHING``: it holds the prefill no longer)."""
        if state is PrefillState.UNKNOWN or state is PrefillState.PUSHING:
            self._of.pop(transfer_id, None)
        else:
            self._of[transfer_id] = (state, tokens_ahead)

    def forget(self, transfer_id: str) -> None:
        """The prefill finished, or its transfer was aborted."""
        self._of.pop(transfer_id, None)

    def changed(self, transfer_id: str, e: Entry) -> list[Acknowledge]:
        """Acks for the waiting registrations of ``e`` (prefill not finished) not told the state known now."""
        if transfer_id not in self._of:
            return []
        state, ahead = self._of[transfer_id]
        out: list[Acknowledge] = []
        for k, reg in e.regs.items():
            if k not in e.done and k not in e.in_flight and e.acked.get(k) is not state:
                e.acked[k] = state
                out.append(Acknowledge(reg, state, ahead))
        return out

    def registered(self, transfer_id: str, e: Entry, k: DKey, reg: Register) -> list[Acknowledge]:
        """The ack for a registration just made while its prefill has not finished (none: state unknown)."""
        if transfer_id not in self._of:
            return []
        state, ahead = self._of[transfer_id]
        e.acked[k] = state
        return [Acknowledge(reg, state, ahead)]

    def queued(self) -> int:
        """Prefills the scheduler holds queued (not running yet)."""
        return sum(1 for state, _ in self._of.values() if state is PrefillState.QUEUED)
