"""Plain data the engine hands to and returns from its callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerAddress:
    """Where D finds a P instance's side channel: rank r listens on ``port + r``."""

    host: str
    port: int
    tp_size: int = 1


@dataclass(frozen=True)
class Result:
    """A transfer that ended on this side.

    On P: the request's blocks may be freed. On D: the KV arrived (``ok``) or
    will never arrive (``ok=False``, ``reason`` says why), and D's blocks are
    no longer written by anyone (fenced).

    ``stats`` on P: ``plan_s``, ``pack_s``, ``post_s``, ``complete_s`` (post
    to WRITE done), ``bytes``, ``pieces`` (descriptors before coalescing),
    ``descriptors`` (posted) and ``plan_<kind>``, summed over this rank's
    pushes of the transfer; on D: ``bytes``, ``descriptors``, ``unpack_s``,
    ``latency_s`` (registration to result).

    ``times`` holds when each stage happened, as ``time.monotonic()`` values
    (P: ``registered``, ``prefill_done``, ``push_start``, ``ready``,
    ``planned``, ``packed``, ``posted``, ``completed``, ``released``; D:
    ``registered``, ``sent``, ``completed``, ``result``). They stay monotonic
    here because they are subtracted from each other; ``kvpush.timeline``
    turns them into wall-clock time when it logs them, so P's and D's lines
    from two processes can be joined.
    """

    transfer_id: str
    request_id: str
    ok: bool
    reason: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
