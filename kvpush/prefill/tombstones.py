"""Transfers P remembers as aborted before its prefill finished (sans-I/O).

A D may abort a transfer before P's prefill has finished (or before P has
heard of it at all); the prefill finishing later must then be released at
once, not park its blocks for a whole lease waiting for a registration that
will never come. So an abort that finds no finished prefill leaves a
tombstone: the transfer id, until when it is remembered, why (an abort, or
no D rank needing this rank's copy) and the D rank whose abort left it.

Memory is bounded twice, because the ids come from peers: at most ``limit``
tombstones in all (the oldest is forgotten first: forgetting one costs at
most a prefill parked for its lease) and, checked by the rendezvous before
it buries, at most ``max_peer_tombstones`` left by one D rank (``left_by``),
so one peer's flood of aborts cannot push out the others'.
"""

from __future__ import annotations

from kvpush.core.outcome import Cause
from kvpush.prefill.push_job import DKey


class Tombstones:
    """Aborted transfer ids until their deadline, counted per D rank that left them; ``limit`` in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._until: dict[str, tuple[float, DKey | None]] = {}  # insertion order: the oldest first
        self._by: dict[DKey, int] = {}
        self._cause: dict[str, Cause] = {}

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._until

    def __len__(self) -> int:
        return len(self._until)

    def cause(self, transfer_id: str) -> Cause:
        """Why the tombstone was left (``ABORTED`` for one not known)."""
        return self._cause.get(transfer_id, Cause.ABORTED)

    def left_by(self, by: DKey) -> int:
        """Tombstones the aborts of D rank ``by`` left (what its ``max_peer_tombstones`` counts)."""
        return self._by.get(by, 0)

    def bury(self, transfer_id: str, until: float, by: DKey | None, cause: Cause = Cause.ABORTED) -> None:
        """A tombstone until ``until``; one already there keeps the D rank it counts against (a second
        abort of the same id refreshes it, and cannot move it onto a rank that is at its limit)."""
        if transfer_id in self._until:
            by = self._until[transfer_id][1]
        self.unbury(transfer_id)
        self._until[transfer_id] = (until, by)
        self._cause[transfer_id] = cause
        if by is not None:
            self._by[by] = self._by.get(by, 0) + 1
        while len(self._until) > self.limit:
            # The oldest goes: forgetting one costs at most a prefill parked for its lease.
            self.unbury(next(iter(self._until)))

    def unbury(self, transfer_id: str) -> None:
        """Forget the tombstone of ``transfer_id`` (if any), and its count against the D rank that left it."""
        _, by = self._until.pop(transfer_id, (0.0, None))
        self._cause.pop(transfer_id, None)
        if by is not None:
            left = self._by[by] - 1
            if left:
                self._by[by] = left
            else:
                del self._by[by]

    def expire(self, now: float) -> None:
        """Forget the tombstones whose deadline has come."""
        for t in [t for t, (until, _) in self._until.items() if until <= now]:
            self.unbury(t)
