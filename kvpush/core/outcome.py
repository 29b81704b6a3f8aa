"""Typed outcomes: where a transfer failed, why, how it moved, and what each side measured.

Every failure is born with its ``Stage`` and ``Cause`` where it happens (a
sender or receiver rule, a NIXL state, a backend call) and keeps them on the
wire (``protocol.Failure``), in ``Result`` and in the metrics' labels, so
nothing downstream reads them back out of the human-readable reason.

Stats and stage times are plain dataclasses with one field per quantity, on
one clock: ``time.monotonic()`` (durations are differences of it; the
timeline converts to wall-clock time when it logs them).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Stage(enum.StrEnum):
    """Where a transfer failed."""

    HANDSHAKE = "handshake"  # D: P refused the hello, or never answered it
    REGISTER = "register"  # P: the registration itself is unacceptable
    RENDEZVOUS = "rendezvous"  # P: pairing, leases, aborts before any WRITE
    PLAN = "plan"  # P: mapping pieces and choosing the plan
    PACK = "pack"  # P: gathering into staging
    POST = "post"  # P: handing WRITEs to NIXL
    WRITE = "write"  # P: NIXL reported the WRITE failed
    TRANSFER = "transfer"  # D: waiting for the parts, or a part that does not fit
    UNPACK = "unpack"  # D: scattering from staging


class Cause(enum.StrEnum):
    """Why a transfer failed: a small fixed set, so a metric label never explodes into one series per message."""

    EXPIRED = "expired"  # a lease or deadline ran out
    DEAD_PEER = "dead_peer"  # the other side went silent, restarted, or never answered an abort
    REFUSED = "refused"  # the handshake was refused (incompatible peer, no hello)
    SUPERSEDED = "superseded"  # a re-issued request or registration replaced this one
    ABORTED = "aborted"  # either side gave up on the request
    NOT_NEEDED = "not_needed"  # no D rank takes this P rank's copy (replicated KV: another P rank writes it)
    WRITE_ERROR = "write_error"  # NIXL failed a WRITE
    POST_ERROR = "post_error"  # planning, packing or posting failed on P
    BAD_REGISTRATION = "bad_registration"  # block ids, groups, staging or token counts that cannot be right
    SIDE_CHANNEL = "side_channel"  # a control message could not be sent
    OVER_LIMIT = "over_limit"  # a per-peer limit on P (open registrations, block ids, registration rate)
    OTHER = "other"  # anything else (a malformed part, an unpack error, a bug)


class PrefillState(enum.StrEnum):
    """Where P's prefill of a transfer stands, as P acknowledges a registration (``protocol.Ack``).

    D's wait is bounded by this, not by a clock started at registration: a
    prefill P says is queued or running is waited for (up to a hard cap), one
    P knows nothing of is not.
    """

    UNKNOWN = "unknown"  # P has not seen the request (yet): D keeps its own timeout
    QUEUED = "queued"  # in P's waiting queue, behind ``tokens_ahead`` prompt tokens
    RUNNING = "running"  # P's forward is computing it
    PUSHING = "pushing"  # finished and paired: its WRITEs are being posted

    @property
    def alive(self) -> bool:
        """P vouches that the KV will come (D waits up to its hard cap, not its timeout)."""
        return self is not PrefillState.UNKNOWN


class PlanKind(enum.StrEnum):
    """How a push moves its bytes (``kvpush.core.plan``)."""

    DIRECT = "direct"
    STAGED = "staged"
    EMPTY = "empty"
    PEER = "peer"
    """P's device writes D's blocks itself (same host, ``kvpush.backends.peer``); D takes it as direct."""
    ROUNDS = "rounds"
    """Staged through a ring of slots D granted, part by part, each slot written again once D credits the
    part before it there (``kvpush.core.rounds``)."""


class XferState(enum.Enum):
    """A NIXL WRITE's state: still in flight, done, or failed (an error or a vanished peer)."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"

    @classmethod
    def of(cls, raw: object) -> XferState:
        """NIXL's string (``"DONE"``, ``"PROC"``; anything else is an error)."""
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return cls.__members__.get(text, cls.ERR)


@dataclass(frozen=True)
class Failed:
    """A failure as the rule that found it states it."""

    stage: Stage
    cause: Cause
    reason: str


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


@dataclass
class _Record:
    """Fields that are ``None`` did not happen; ``as_dict`` leaves them out (JSON, benchmarks, logs), and the
    per-part times too (``parts``: read them from the field)."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("parts", None)
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in out.items() if v is not None}


@dataclass
class PartTimes:
    """When each stage of one part (regions ``[r0, r1)``, written by P rank or to D rank ``rank``) happened on
    one side (``time.monotonic()``): P's ``pack``, ``packed``, ``post`` (built and posted from here), ``posted``,
    ``written`` (its WRITE over); D's
    ``notified`` (the part's notification read), ``unpack`` (launched), ``unpacked``. Where a push's time goes
    part by part is what decides how many parts pay (``kvpush.core.parts``)."""

    r0: int
    r1: int
    rank: int = 0
    t: dict[str, float] = field(default_factory=dict)

    def stamp(self, stage: str, now: float) -> None:
        """Stamp ``stage`` unless it happened already."""
        self.t.setdefault(stage, now)


def part_of(parts: list[PartTimes], r0: int, r1: int, rank: int = 0) -> PartTimes:
    """The times of part ``[r0, r1)`` of ``rank`` in ``parts``, added when new."""
    for pt in parts:
        if pt.r0 == r0 and pt.r1 == r1 and pt.rank == rank:
            return pt
    parts.append(PartTimes(r0, r1, rank))
    return parts[-1]


@dataclass
class PushStats(_Record):
    """What P measured of one transfer, summed over this rank's pushes of it (seconds, bytes, counts).

    ``wait_ready_s``: from the plan to the KV being ready (layer-wise: the
    rest of the forward); ``complete_s``: the last post to its WRITE done;
    ``pieces``: descriptors before coalescing, ``descriptors``: posted.
    """

    plan: PlanKind | None = None
    plan_s: float | None = None
    wait_ready_s: float | None = None
    pack_s: float | None = None
    post_s: float | None = None
    complete_s: float | None = None
    bytes: int = 0
    pieces: int = 0
    descriptors: int = 0
    parts: int = 0

    def merge(self, other: PushStats) -> None:
        """Add another push of the same transfer (to another D rank) into this one."""
        self.plan = self.plan or other.plan
        for f in ("plan_s", "wait_ready_s", "pack_s", "post_s", "complete_s"):
            setattr(self, f, _add(getattr(self, f), getattr(other, f)))
        for f in ("bytes", "pieces", "descriptors", "parts"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


@dataclass
class ReceiveStats(_Record):
    """What D measured of one transfer: bytes and descriptors its parts announced, unpack time, latency."""

    plan: PlanKind | None = None
    bytes: int = 0
    descriptors: int = 0
    parts: int = 0
    unpack_s: float | None = None
    latency_s: float | None = None


@dataclass
class PushTimes(_Record):
    """When each stage of a transfer happened on P (``time.monotonic()``)."""

    registered: float | None = None
    prefill_start: float | None = None
    prefill_done: float | None = None
    push_start: float | None = None
    planned: float | None = None
    ready: float | None = None
    packed: float | None = None
    posted: float | None = None
    completed: float | None = None
    released: float | None = None
    parts: list[PartTimes] = field(default_factory=list)

    def part(self, r0: int, r1: int, rank: int = 0) -> PartTimes:
        """The times of part ``[r0, r1)`` pushed to D rank ``rank``."""
        return part_of(self.parts, r0, r1, rank)

    def first(self, name: str, t: float) -> None:
        """Stamp ``name`` unless it happened already."""
        if getattr(self, name) is None:
            setattr(self, name, t)

    def latest(self, name: str, t: float) -> None:
        """Stamp ``name`` with the later of its value and ``t`` (the last push of several)."""
        old = getattr(self, name)
        setattr(self, name, t if old is None else max(old, t))


@dataclass
class ReceiveTimes(_Record):
    """When each stage of a transfer happened on D (``time.monotonic()``)."""

    registered: float | None = None
    sent: float | None = None
    first_part: float | None = None
    last_part: float | None = None
    completed: float | None = None
    result: float | None = None
    parts: list[PartTimes] = field(default_factory=list)

    def part(self, r0: int, r1: int, rank: int = 0) -> PartTimes:
        """The times of part ``[r0, r1)`` written by P rank ``rank``."""
        return part_of(self.parts, r0, r1, rank)


@dataclass(frozen=True)
class Result:
    """A transfer that ended on this side.

    On P: the request's blocks may be freed. On D: the KV arrived (``ok``) or
    will never arrive (``ok=False``), and D's blocks are no longer written by
    anyone (``fenced``; otherwise quarantined until a second Result says
    so). A failure says where (``stage``), why (``cause``, the metrics'
    label) and, for people, ``reason``.

    ``stats`` and ``times`` are the side's typed records (``PushStats`` and
    ``PushTimes`` on P, summed over this rank's pushes of the transfer;
    ``ReceiveStats`` and ``ReceiveTimes`` on D). Times are
    ``time.monotonic()`` values, subtracted from each other here;
    ``kvpush.observability.timeline`` turns them into wall-clock time when it logs them, so
    P's and D's lines from two processes can be joined.
    """

    transfer_id: str
    request_id: str
    ok: bool
    reason: str = ""
    cause: Cause | None = None
    stage: Stage | None = None
    stats: PushStats | ReceiveStats = field(default_factory=ReceiveStats)
    times: PushTimes | ReceiveTimes = field(default_factory=ReceiveTimes)
    fenced: bool = True
    """D: no writer can write into the blocks any more, they may be reused. ``False``: the transfer failed
    (the request may fail now) but a writer declared dead may still write, so the blocks stay quarantined;
    a second Result with ``fenced=True`` follows when they may be reused."""
