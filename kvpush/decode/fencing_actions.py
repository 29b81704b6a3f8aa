"""The actions D's fencing asks the receiver thread to carry out (sans-I/O: data only).

``Fencing`` and each ``Incoming`` answer events with these; the receiver
thread does what they say (send, unpack, wait, free, report) and feeds the
answer back. Kept apart so the per-attempt machine and the book of all
attempts share one vocabulary.

An action about one attempt carries that attempt (the ``Incoming`` that made
it), so the receiver can feed the answer back to it. Its type is a parameter
(``A``): this vocabulary names no machine, the machines import it
(``kvpush.decode.incoming.Action`` is ``Action[Incoming]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvpush.core import protocol
from kvpush.core.outcome import Result
from kvpush.core.staging import FreeSlot
from kvpush.core.topology import ConnKey

A = TypeVar("A")
"""The attempt an action is about: ``kvpush.decode.incoming.Incoming``."""

UNKNOWN_SENDER: ConnKey = ("", 0)
"""The sender of a notification from a NIXL agent no P rank's hello reply named."""


@dataclass(frozen=True)
class SendRegister(Generic[A]):
    """Register with this writer once its connection is ready (answer ``register_sent``/``register_failed``;
    a refused connection answers ``conn_refused``)."""

    incoming: A
    p_rank: int


@dataclass(frozen=True)
class SendAbort(Generic[A]):
    """Tell this writer D gave up (answer ``unreachable`` if its connection is not ready)."""

    incoming: A
    p_rank: int
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Tell a P rank D gave up on a transfer it never registered (P may hold the finished prefill)."""

    transfer_id: str
    request_id: str
    conn: ConnKey
    reason: str
    capability: str = field(default="", repr=False)


@dataclass(frozen=True)
class StartUnpack(Generic[A]):
    """Scatter this part from the writer's staging slot (answer ``unpack_started`` or ``unpack_failed``)."""

    incoming: A
    p_rank: int
    part: protocol.Completion
    r0: int
    r1: int


@dataclass(frozen=True)
class AwaitUnpacks(Generic[A]):
    """Report this writer's finished unpacks, oldest first (``unpacked``/``unpack_failed``); ``block``: its
    parts are all here, so its unpacks are the critical path: wait for them rather than poll."""

    incoming: A
    p_rank: int
    block: bool


@dataclass(frozen=True)
class WaitUnpacks:
    """A writer ended while unpacks still write into its blocks: wait for them before the blocks go back."""

    markers: tuple[Any, ...]


@dataclass(frozen=True)
class Stale:
    """A message for no current writer (late, duplicated, or of a finished attempt): count and log it."""

    transfer_id: str
    p_rank: int


@dataclass(frozen=True)
class Foreign:
    """A completion or failure from a P rank this transfer was not registered with (another P instance, or
    one holding the P key): ignored; count and log it."""

    transfer_id: str
    p_rank: int
    sender: ConnKey | None


@dataclass(frozen=True)
class Overdue(Generic[A]):
    """A quarantined writer is still unfenced ``quarantine_s`` after it was given up on: warn and count it.
    Its blocks stay withheld (a frozen P may still write them) until fencing, P's answer or its last part."""

    incoming: A
    p_rank: int
    held_s: float


@dataclass(frozen=True)
class Report(Generic[A]):
    """The transfer ended on D: no writer can still write into its blocks (``result.fenced``), or it failed
    while a quarantined writer still might (``fenced`` False: a second Report gives the blocks back)."""

    incoming: A
    result: Result


Action = (
    SendRegister[A]
    | SendAbort[A]
    | Cancel
    | StartUnpack[A]
    | AwaitUnpacks[A]
    | WaitUnpacks
    | FreeSlot
    | Stale
    | Foreign
    | Overdue[A]
    | Report[A]
)
"""What D's fencing asks for, about attempts of type ``A`` (a staging slot goes back with
``kvpush.core.staging.FreeSlot``, the same action as on P)."""
