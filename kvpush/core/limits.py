"""Per-peer budgets (sans-I/O): what one peer may make this side read, so a flood costs the peer, not us.

A token bucket per peer for bytes and one for messages: a frame over either
budget is dropped *before* it is decoded (decoding a frame of block ids is
the expensive part), and the drop is reported once per peer per interval.
Time is passed in, never read. The number of peers tracked is bounded: the
least recently seen one is forgotten first (it starts again with a full
bucket, which is what a new peer gets anyway).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


class Verdict(enum.Enum):
    ADMIT = "admit"
    OVER_BYTES = "over_bytes"
    OVER_MESSAGES = "over_messages"


@dataclass
class Bucket:
    """``rate`` tokens per second up to ``burst``; starts full."""

    rate: float
    burst: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)


@dataclass
class _Peer:
    nbytes: Bucket
    messages: Bucket
    dropped: int = 0
    reported: float = float("-inf")


class Budgets:
    """Bytes and messages per second per peer key (both buckets hold one second of their rate at most,
    bytes at least ``min_burst_bytes`` so the largest legal frame fits)."""

    def __init__(self, bytes_per_s: float, messages_per_s: float, min_burst_bytes: int, max_peers: int = 4096) -> None:
        self.bytes_per_s = bytes_per_s
        self.messages_per_s = messages_per_s
        self.burst_bytes = max(float(bytes_per_s), float(min_burst_bytes))
        self.max_peers = max_peers
        self._peers: OrderedDict[str | bytes, _Peer] = OrderedDict()

    def admit(self, peer: str | bytes, nbytes: int, now: float) -> Verdict:
        """May ``peer``'s frame of ``nbytes`` be read now? Both budgets are charged only when it may."""
        p = self._peer(peer, now)
        p.messages.refill(now)
        p.nbytes.refill(now)
        if p.messages.level < 1:
            verdict = Verdict.OVER_MESSAGES
        elif nbytes > p.nbytes.level:
            verdict = Verdict.OVER_BYTES
        else:
            p.messages.level -= 1
            p.nbytes.level -= nbytes
            return Verdict.ADMIT
        p.dropped += 1
        return verdict

    def report(self, peer: str | bytes, now: float, every_s: float) -> int:
        """Frames of ``peer`` dropped since the last report, if one is due (else 0; the count keeps)."""
        p = self._peers.get(peer)
        if p is None or not p.dropped or now - p.reported < every_s:
            return 0
        n, p.dropped, p.reported = p.dropped, 0, now
        return n

    def __len__(self) -> int:
        return len(self._peers)

    def _peer(self, peer: str | bytes, now: float) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            p = _Peer(
                Bucket(self.bytes_per_s, self.burst_bytes, self.burst_bytes, now),
                Bucket(self.messages_per_s, self.messages_per_s, self.messages_per_s, now),
            )
            self._peers[peer] = p
            while len(self._peers) > self.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return p


@dataclass(frozen=True)
class PeerLimits:
    """What one D rank may hold on P at once, and how fast it may register (``Config`` has the values)."""

    max_registrations: int = 16_384
    max_block_ids: int = 1 << 21
    registrations_per_s: float = 2_000.0
    max_tombstones: int = 65_536
    max_peer_tombstones: int = 4_096


def peer_limits(cfg: Any) -> PeerLimits:
    """The per-D-rank limits of a ``Config``."""
    return PeerLimits(
        cfg.limits.peer_max_registrations,
        cfg.limits.peer_max_block_ids,
        cfg.limits.peer_registrations_per_s,
        cfg.limits.max_tombstones,
        cfg.limits.peer_max_tombstones,
    )


class Holdings:
    """Open registrations and their block ids per D rank (sans-I/O, updated by the rendezvous).

    ``admit`` says why a new registration would put its D rank over a limit
    ("" when it may be taken); ``add``/``remove`` follow every registration
    the rendezvous stores or lets go of, so the counts are what the entries
    hold (a hypothesis test recomputes them after every event).
    """

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self._held: dict[object, list[int]] = {}  # peer -> [registrations, block ids]
        self._rate: dict[object, Bucket] = {}

    def admit(
        self, peer: object, nblocks: int, now: float, cap: int | None = None, replacing: int | None = None
    ) -> str:
        """Why ``peer`` may not register ``nblocks`` more block ids now ("" if it may; the rate is then charged).

        ``replacing``: the block ids of this rank's registration the new one replaces (None: it adds a
        registration); ``cap``: a tighter block-id limit for this peer (what its own cache can hold).
        """
        lim = self.limits
        regs, ids = self.held(peer)
        rate = self._rate.get(peer)
        if rate is None:
            rate = Bucket(lim.registrations_per_s, lim.registrations_per_s, lim.registrations_per_s, now)
            self._rate[peer] = rate
        rate.refill(now)
        if rate.level < 1:
            return f"over {lim.registrations_per_s:g} registrations per second from this D rank"
        if replacing is None and regs + 1 > lim.max_registrations:
            return f"this D rank holds {regs} open registrations already (limit {lim.max_registrations})"
        most = lim.max_block_ids if cap is None else min(cap, lim.max_block_ids)
        total = ids - (replacing or 0) + nblocks
        if total > most:
            return f"this D rank would hold {total} block ids in open registrations (limit {most})"
        rate.level -= 1
        return ""

    def change(self, peer: object, registrations: int, block_ids: int) -> None:
        """``peer`` holds that many more (or fewer) registrations and block ids."""
        h = self._held.setdefault(peer, [0, 0])
        h[0] += registrations
        h[1] += block_ids
        if h[0] <= 0 and h[1] <= 0:
            del self._held[peer]

    def held(self, peer: object) -> tuple[int, int]:
        """(open registrations, block ids) of ``peer``."""
        regs, ids = self._held.get(peer, (0, 0))
        return regs, ids

    def forget(self, peer: object) -> None:
        """Drop the rate state of a peer that is gone (its holdings go with its registrations)."""
        self._rate.pop(peer, None)


class Throttle:
    """At most ``burst`` lines per ``every_s`` per key, then one with the count of those held back.

    ``note`` returns that count (0 or more) when a line may be written, None when it is held back.
    Bounded: beyond ``max_keys`` the oldest keys are forgotten (their next line is simply due).
    """

    def __init__(self, every_s: float, burst: int = 1, max_keys: int = 1024) -> None:
        self.every_s = every_s
        self.burst = burst
        self.max_keys = max_keys
        self._state: OrderedDict[object, list[float]] = OrderedDict()  # key -> [window start, used, held]

    def note(self, key: object, now: float) -> int | None:
        st = self._state.get(key)
        if st is None or now - st[0] >= self.every_s:
            held = int(st[2]) if st is not None else 0
            self._state[key] = [now, 1, 0]
            self._state.move_to_end(key)
            while len(self._state) > self.max_keys:
                self._state.popitem(last=False)
            return held
        if st[1] < self.burst:
            st[1] += 1
            return 0
        st[2] += 1
        return None
