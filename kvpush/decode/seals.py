"""Which NIXL notifications D acts on: those sealed by the P rank of the link they name (sans-I/O).

NIXL tells D which agent a notification comes from by the name the sender
gave itself, and any holder of D's NIXL metadata can make an agent under a
P rank's name. So on a link whose P speaks seals (its ``Features`` said
``SEALS_VERSION`` or later), D acts on a notification only if it is
``Sealed`` with the key that P rank gave for the session it names
(``LinkKey``, over the CURVE-authenticated connection D dialed), with a
sequence number not taken before (``kvpush.core.seal.Window``). Anything else
is ``Unverified`` (counted and logged by the shell, never acted on): not even
the P rank's liveness is read from it, so a forged heartbeat cannot keep a
frozen P rank alive, nor a forged Completion or Failure end a transfer.

One ``LinkSeals`` per link (keyed by the P rank's side channel, by
``kvpush.decode.link.Links``), kept across the link's hellos:

* a key is *offered* for the hello that is waiting for its answer, and
  becomes the link's *current* session only with P's ok answer to that very
  hello; the session before stays as *previous*, for its notifications still
  on their way (a P rank answers a later hello only once nothing of the
  earlier session flies, so there are few); any older session's key is gone;
* whether seals are *required* changes only with an ok answer, to what that
  answer's session said it speaks, so nobody who is not on the link can
  downgrade it: while a fencing hello waits (a P rank declared dead, perhaps
  frozen) the link still requires its earlier session's seals;
* a link that does not require them (its P is on an older protocol) takes
  notifications as before, unprotected: an older peer still pairs;
* P's greeting (a ``Heartbeat`` of sequence 0 it sends as it loads this
  rank's NIXL metadata, before it can know whether this D rank checks
  seals) is unsealed on every link: D never acts on it (``Greeting``), nor
  counts it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvpush.core import protocol, seal
from kvpush.core.errors import ProtocolError

NOTIFICATIONS = (protocol.Completion, protocol.Failure, protocol.Heartbeat)
"""What a notification, sealed or not, may carry."""


class Why(enum.StrEnum):
    """Why a notification was not acted on."""

    UNSEALED = "it is not sealed, and this link's notifications must be"
    NO_SESSION = "it is sealed for a session this link has no key for (an earlier one, or none P gave)"
    BAD_SEAL = "its seal does not verify with the key of the session it names"
    REPLAYED = "its sequence number was taken before (a replay)"
    TOO_OLD = "its sequence number is too far behind the newest taken to tell (a replay window's length)"
    NO_LINK = "it is sealed, and no link's hello reply named the agent it comes from"


@dataclass(frozen=True)
class Accepted:
    """Act on ``msg``: it verified (``sealed``), or its link does not require seals."""

    msg: Any
    sealed: bool


@dataclass(frozen=True)
class Greeting:
    """P's greeting as it loaded this rank's metadata: never acted on, not counted."""


@dataclass(frozen=True)
class Unverified:
    """Not acted on: count it and log it (``why``; ``epoch`` and ``seq`` of a sealed one, else 0)."""

    why: Why
    epoch: int = 0
    seq: int = 0

    def describe(self) -> str:
        at = f" (session {self.epoch}, seal {self.seq})" if self.seq else ""
        return f"{self.why.value}{at}"


@dataclass(frozen=True)
class Malformed:
    """It verified, but what it seals does not decode (a bug of the P rank that sealed it): reject it."""

    error: str


Verdict = Accepted | Greeting | Unverified | Malformed


@dataclass
class Session:
    """The seals of one session of a link: the hello's ``epoch``, P's ``key`` for it, the sequence numbers taken."""

    epoch: int
    key: seal.Key = field(repr=False)
    window: seal.Window = field(default_factory=seal.Window, repr=False)


@dataclass
class LinkSeals:
    """The seal rule of one link, across its hellos (see the module's docstring)."""

    required: bool = False
    current: Session | None = None
    previous: Session | None = None
    offered: Session | None = None
    window: int = seal.WINDOW
    """How many sequence numbers behind a session's newest its replay window holds (``seal.Window``)."""

    def offer(self, epoch: int, key: bytes) -> None:
        """P gave the key of the session the hello of ``epoch`` opens, before its answer (the link checks that
        this hello waits for it)."""
        self.offered = Session(epoch, seal.Key(key), seal.Window(self.window))

    def answered(self, epoch: int, version: int) -> bool:
        """P answered the hello of ``epoch`` ok, speaking ``version``: that session begins. True when D now checks
        its seals (tell P: ``SealsChecked``)."""
        self.required = version >= protocol.SEALS_VERSION
        offered = self.offered if self.offered is not None and self.offered.epoch == epoch else None
        self.previous, self.current, self.offered = self.current, offered, None
        return self.required and self.current is not None

    def refused(self) -> None:
        """P refused the hello waiting for its answer: the key offered for it is dropped; nothing else changes."""
        self.offered = None

    def check(self, msg: Any) -> Verdict:
        """Whether D acts on notification ``msg`` (one of ``NOTIFICATIONS``, or ``Sealed``) of this link."""
        if not isinstance(msg, protocol.Sealed):
            if not self.required:
                return Accepted(msg, sealed=False)
            if isinstance(msg, protocol.Heartbeat) and msg.seq == 0:
                return Greeting()
            return Unverified(Why.UNSEALED)
        session = self.current
        if session is None or session.epoch != msg.epoch:
            session = self.previous
            if session is None or session.epoch != msg.epoch:
                return Unverified(Why.NO_SESSION, msg.epoch, msg.seq)
        if not session.key.verifies(msg):
            return Unverified(Why.BAD_SEAL, msg.epoch, msg.seq)
        fresh = session.window.take(msg.seq)
        if fresh is not seal.Fresh.NEW:
            why = Why.REPLAYED if fresh is seal.Fresh.REPLAYED else Why.TOO_OLD
            return Unverified(why, msg.epoch, msg.seq)
        try:
            return Accepted(protocol.decode(msg.body, expected=NOTIFICATIONS), sealed=True)
        except ProtocolError as exc:
            return Malformed(str(exc))


def unlinked(msg: Any) -> Verdict:
    """A notification from an agent no link's hello reply named: there is no seal rule to apply. A sealed one
    cannot be verified; any other goes on to D's fencing, which hears a transfer's end only from the link it
    was registered on (``Fencing``: a foreign message) and reads no liveness from it."""
    if isinstance(msg, protocol.Sealed):
        return Unverified(Why.NO_LINK, msg.epoch, msg.seq)
    return Accepted(msg, sealed=False)
