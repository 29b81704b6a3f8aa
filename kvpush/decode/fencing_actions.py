"""The actions D's fencing asks the receiver thread to carry out (sans-I/O: data only).

``Fencing`` and each ``Incoming`` answer events with these; the receiver
thread does what they say (send, unpack, wait, free, report) and feeds the
answer back. Kept apart so the per-attempt machine and the fencing of all
attempts share one vocabulary.

An action carries the data the receiver needs to carry it out (the link, the
messages' fields, the staging grant, the unpack list, the markers), so the
receiver never reads a machine's insides. An action about one attempt also
carries that attempt (the ``Incoming`` that made it) as an opaque handle: the
receiver only hands it back with the answer (``Fencing.register_sent``,
``Fencing.unpacked``, ...). Its type is a parameter (``A``): this vocabulary
names no machine, the machines import it (``kvpush.decode.incoming.Action``
is ``Action[Incoming]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvpush.core import protocol
from kvpush.core.outcome import PrefillState, Result
from kvpush.core.staging import FreeSlot
from kvpush.core.topology import ConnKey

A = TypeVar("A")
"""The attempt an action is about: ``kvpush.decode.incoming.Incoming``."""

UNKNOWN_SENDER: ConnKey = ("", 0)
"""The sender of a notification from a NIXL agent no P rank's hello reply named."""


@dataclass(frozen=True)
class Asked:
    """What D asks its writers for: tokens ``[start_token, num_tokens)`` of a request, into these blocks."""

    transfer_id: str
    request_id: str
    block_ids: tuple[Any, ...]
    """Per group, D's block ids: uint32 arrays from ``Receiver.register`` (sequences of ints work too)."""
    num_tokens: int
    start_token: int = 0
    skip_blocks: tuple[int, ...] = ()  # per group: leading blocks D does not hold (a sliding window's)
    capability: str = field(default="", repr=False)
    """The transfer's capability (``kvpush.core.capability``), sent with the registration and any abort; never
    shown."""


@dataclass(frozen=True)
class SendRegister(Generic[A]):
    """Register with this writer (P rank ``p_rank`` at ``conn``) once its link is ready: answer
    ``Fencing.register_sent`` (or ``writer_failed`` for a registration P's layout cannot take); a refused link
    answers ``Fencing.refused``."""

    incoming: A
    p_rank: int
    conn: ConnKey
    asked: Asked
    attempt: int


@dataclass(frozen=True)
class SendAbort(Generic[A]):
    """Tell this writer D gave up (``protocol.Abort`` of these fields, on its link if ready or dead); answer
    ``Fencing.unreachable`` if its link is not ready."""

    incoming: A
    p_rank: int
    reason: str
    conn: ConnKey
    transfer_id: str
    request_id: str
    attempt: int
    capability: str = field(default="", repr=False)


@dataclass(frozen=True)
class Cancel:
    """Tell a P rank D gave up on a transfer it never registered (P may hold the finished prefill)."""

    transfer_id: str
    request_id: str
    conn: ConnKey
    reason: str
    capability: str = field(default="", repr=False)


@dataclass(frozen=True)
class HelloAgain:
    """P rank ``conn`` no longer knows this D rank (it refused a registration for want of a hello: it forgot
    D, silent past its ``peer_dead_s``): the link's next registration says hello first
    (``kvpush.decode.link.Links.forgotten``)."""

    conn: ConnKey

    def describe(self) -> str:
        return f"P {self.conn[0]}:{self.conn[1]} no longer knows this D rank: saying hello again"


@dataclass(frozen=True)
class StartUnpack(Generic[A]):
    """Scatter regions ``[r0, r1)`` of this part from D's staging region at ``at`` (the part's bytes, each
    region's share back to back) with ``unpack``, the pieces of each region it holds: answer
    ``Fencing.unpack_started``, or ``writer_failed`` at stage UNPACK. ``units``: what the part covers of the
    writer's count (its regions; a part's own index in a push in rounds)."""

    incoming: A
    p_rank: int
    part: protocol.Completion
    r0: int
    r1: int
    at: int
    units: tuple[int, int]
    unpack: Any = field(repr=False)


@dataclass(frozen=True)
class SendCredit:
    """Tell the writing P rank at ``conn`` that parts ``[0, parts)`` of this push in rounds are unpacked
    (``protocol.Credit``): their ring slots may be written again."""

    conn: ConnKey
    transfer_id: str
    attempt: int
    parts: int


@dataclass(frozen=True)
class AwaitUnpacks(Generic[A]):
    """Report this writer's finished unpacks (``markers``, oldest first), each with ``Fencing.unpacked``, until
    one is not done (a failed one: ``writer_failed`` at stage UNPACK); ``block``: its parts are all here, so its
    unpacks are the critical path: wait for them rather than poll."""

    incoming: A
    p_rank: int
    block: bool
    markers: tuple[Any, ...] = ()


@dataclass(frozen=True)
class WaitUnpacks:
    """A writer ended while unpacks still write into its blocks: wait for them before the blocks go back."""

    markers: tuple[Any, ...]


@dataclass(frozen=True)
class Stale:
    """A message for no current writer (late, duplicated, or of a finished attempt): count and log it."""

    transfer_id: str
    p_rank: int

    def describe(self) -> str:
        return f"stale or unknown message for {self.transfer_id} from P rank {self.p_rank}"


@dataclass(frozen=True)
class Foreign:
    """A completion or failure from a P rank this transfer was not registered with (another P instance, or
    one holding the P key): ignored; count and log it."""

    transfer_id: str
    p_rank: int
    sender: ConnKey | None

    def describe(self) -> str:
        host, port = self.sender or UNKNOWN_SENDER
        who = f"P {host}:{port}" if (host, port) != UNKNOWN_SENDER else "an agent this D has no link to"
        what = f"for {self.transfer_id} naming P rank {self.p_rank} from {who}"
        return f"ignored a message {what}: the transfer was not registered with it"


@dataclass(frozen=True)
class Overdue(Generic[A]):
    """A quarantined writer is still unfenced ``quarantine_s`` after it was given up on: warn and count it.
    Its blocks stay withheld (a frozen P may still write them) until fencing, P's answer or its last part.
    ``blocks``: how many of the attempt's blocks are withheld."""

    incoming: A
    p_rank: int
    held_s: float
    transfer_id: str
    conn: ConnKey
    blocks: int

    def describe(self) -> str:
        return (
            f"{self.transfer_id}: P {self.conn[0]}:{self.conn[1]} (rank {self.p_rank}) is still unfenced "
            f"{self.held_s:.0f}s after it was given up on; its {self.blocks} blocks stay withheld from vLLM until "
            "it answers a hello (it may be frozen and still write them)"
        )


@dataclass(frozen=True)
class Report(Generic[A]):
    """The transfer ended on D: no writer can still write into its blocks (``result.fenced``), or it failed
    while a quarantined writer still might (``fenced`` False: a second Report gives the blocks back;
    ``blocks``: how many stay withheld until then)."""

    incoming: A
    result: Result
    blocks: int

    def describe(self) -> str:
        """The early failure's line (``fenced`` False)."""
        r = self.result
        return (
            f"{r.transfer_id} failed; its {self.blocks} blocks stay quarantined until the writer is fenced ({r.reason})"
        )


@dataclass(frozen=True)
class Acknowledged:
    """P rank ``p_rank`` said where a current writer's prefill stands (``protocol.Ack``), and D took it: log it."""

    transfer_id: str
    p_rank: int
    state: PrefillState
    tokens_ahead: int

    def describe(self) -> str:
        return f"P rank {self.p_rank}: {self.transfer_id} is {self.state} ({self.tokens_ahead} tokens ahead)"


Action = (
    SendRegister[A]
    | SendAbort[A]
    | Cancel
    | HelloAgain
    | StartUnpack[A]
    | SendCredit
    | AwaitUnpacks[A]
    | WaitUnpacks
    | FreeSlot
    | Stale
    | Foreign
    | Overdue[A]
    | Report[A]
    | Acknowledged
)
"""What D's fencing asks for, about attempts of type ``A`` (a staging slot goes back with
``kvpush.core.staging.FreeSlot``, the same action as on P)."""
