"""Transfer ids P pushed and let go of lately (sans-I/O).

A D rank may re-register a transfer (a new attempt, new blocks) while P
still writes the old attempt. When the new registration reaches P before
that WRITE ends, P holds it and pushes again (``Hold``); when it reaches P
after the push ended and P released the prefill's blocks to vLLM, there is
nothing left to push. Without a memory of the transfer, P would park that
registration as one waiting for its prefill, and D would wait out the whole
lease for a prefill that will never finish again. So P remembers the
transfer ids it pushed and released, the ``limit`` newest, and refuses a
registration for one at once: D fails the attempt and vLLM recomputes.

A prefill finishing again under a remembered id (P re-ran it) is a new
transfer: it forgets the id. Memory is bounded by count, not time, as the
events that release a transfer carry no clock; the oldest is forgotten first.
"""

from __future__ import annotations

LIMIT = 4096
"""How many released transfer ids P remembers: a re-registration arrives within a few engine steps of the
push's end, far fewer transfers than this on any P rank."""


class Released:
    """The ``limit`` transfer ids most lately pushed and released."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}  # insertion order: the oldest first

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, transfer_id: str) -> None:
        self._ids.pop(transfer_id, None)
        self._ids[transfer_id] = None
        while len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def forget(self, transfer_id: str) -> None:
        self._ids.pop(transfer_id, None)
