"""How long a peer has been silent, counted only while this side was looking (sans-I/O, both sides).

Each side declares a peer dead after ``peer_dead_s`` without a word from it
(P forgets a D rank, ``kvpush.engine.peers``; D declares a P rank dead,
``kvpush.decode.link``). That silence is measured by this side's looks, and
a look only means something if this side was running before it: a process
stopped (SIGSTOP, a VM paused), a thread blocked in a call, a host starved
of cores all leave the peer's words queued, unread, in this side's sockets.
The first look after such a *stall* runs before those words are read (the
socket library's own thread must move them first), so it would blame the
peer for this side's own absence: a P resumed after a freeze forgot a live
D rank, unloaded its NIXL agent under a WRITE in flight and, on LIBFABRIC
before NIXL 1.5, could not write to it again.

The rule: a gap between two looks longer than ``stall_s`` is this side's
stall, and a peer's silence is counted from the later of its last word and
the end of the last stall. A peer that is really gone is declared dead
``peer_dead_s`` after this side resumed; no look declares a peer dead for
time this side did not watch.
"""

from __future__ import annotations


def stall_bar(peer_dead_s: float) -> float:
    """The longest gap between two looks that is not a stall: half of ``peer_dead_s``. An engine looks many
    times a second (its timers); a gap of half the dead time is no scheduling hiccup, and a shorter stall
    cannot by itself make a live peer look silent for all of ``peer_dead_s``."""
    return peer_dead_s / 2


class Lookout:
    """One side's looks at its peers' silence (``look`` at each, then ``silence`` per peer).

    ``stall_s``: the longest gap between two looks that is not a stall (``stall_bar``).
    """

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.last_look: float | None = None
        self.resumed = float("-inf")
        """When this side's last stall ended (the first look after it); -inf: it never stalled."""
        self.stalls = 0

    def look(self, now: float) -> float:
        """A look at ``now``: the length of the stall it ends (the silence before it is forgiven), 0.0 if none."""
        gap = 0.0 if self.last_look is None else now - self.last_look
        self.last_look = now
        if gap <= self.stall_s:
            return 0.0
        self.resumed = now
        self.stalls += 1
        return gap

    def silence(self, last_word: float, now: float) -> float:
        """How long a peer whose last word came at ``last_word`` has been silent at ``now``, as watched."""
        return now - max(last_word, self.resumed)
