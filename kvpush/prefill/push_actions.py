"""The actions of P's push job (``kvpush.prefill.push_job.PushJob``): what it asks its shell to do.

Each event of the job returns a list of them; ``QUESTIONS`` are answered by
the shell (the event each names) before the job says more, so each ends its
list. They carry what the shell needs to carry them out (the registration,
the D rank, the staging offset, the slot to free):

* ``Notify``: tell D that this push starts (the ``Posting`` heads-up, once);
* ``StartPack``: gather regions ``[r0, r1)`` into staging (staged plans);
* ``CheckPack``: is the oldest pack done (wait for it when ``block``)?
* ``Post``: post the WRITE of regions ``[r0, r1)`` (a bare completion for an
  empty plan);
* ``ReleaseMade``: give back WRITEs built ahead that will not be posted;
* ``SendFailure``: tell D that some regions will never be written;
* ``Done``: the job is over; nothing of it is in flight or being packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.core.outcome import Failed
from kvpush.core.protocol import Register


@dataclass(frozen=True)
class Notify:
    """Send D the ``Posting`` heads-up: D polls busily only for transfers it was told are being written."""

    reg: Register


@dataclass(frozen=True)
class StartPack:
    """Start packing regions ``[r0, r1)`` into the job's staging slot; answer ``pack_started`` or ``failed``.

    ``after``: the KV marker a backend that chains packs queues this one behind (None: the KV is ready);
    ``offset``: where in P's staging region the part goes (the job's slot plus the regions before ``r0``).
    """

    r0: int
    r1: int
    after: Any
    offset: int = 0
    part: int = -1
    """A push in rounds: the part (``kvpush.core.rounds``) whose stream range of those regions is packed."""


@dataclass(frozen=True)
class CheckPack:
    """Is the oldest pack done? Answer ``packed``, ``pack_pending`` or ``failed``.

    ``block``: wait for it instead of polling, but only once ``after`` (the KV
    it is queued behind) is reached: then it is a short kernel of ours, never
    a layer still computing.
    """

    marker: Any
    after: Any
    block: bool


@dataclass(frozen=True)
class Post:
    """Post the WRITE of regions ``[r0, r1)`` (``made``: its handle built ahead, or None to build it now).

    Answer ``posted`` or ``failed``. For an empty plan the post is the bare completion notification.
    ``nbytes``: the part's payload bytes. ``after``: a peer copy of a backend that chains queues behind
    this KV marker on the device (the KV may not be written yet); None: the KV is written.
    """

    r0: int
    r1: int
    made: tuple[Any, int] | None
    nbytes: int = 0
    after: Any = None
    part: int = -1
    """A push in rounds: the part posted, with ``at``, where it is in P's staging region and where it goes in
    D's (``kvpush.core.rounds``)."""
    at: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class ReleaseMade:
    """Give back these unposted WRITE handles (built ahead, no longer needed)."""

    handles: tuple[Any, ...]


@dataclass(frozen=True)
class SendFailure:
    """Tell D this push will not write every region (sent only once nothing is in flight); ``reg``: D's
    registration the failure answers."""

    failed: Failed
    reg: Register


@dataclass(frozen=True)
class Done:
    """The job is over: free its staging slot (``slot``, None: it has none), account its stats, end the push
    of D rank ``key`` in the rendezvous."""

    failed: Failed | None
    key: tuple[str, int]
    slot: int | None


Action = Notify | StartPack | CheckPack | Post | ReleaseMade | SendFailure | Done

QUESTIONS = (StartPack, CheckPack, Post)
"""Actions the shell answers (the event each names) before the job says more: each ends its list."""
