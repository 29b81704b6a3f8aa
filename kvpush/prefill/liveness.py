"""How long a D rank has been silent, counted only while P was looking (sans-I/O, P's rule).

P forgets a D rank after ``peer_dead_s`` without a word from it
(``kvpush.engine.peers``). That silence is measured by P's looks, and a look
only means something if P was running before it: a process stopped
(SIGSTOP, a VM paused), a thread blocked in a call, a host starved of cores
all leave D's words queued, unread, in P's sockets. D keeps talking
meanwhile (its heartbeats, an abort, a hello), and the first look after
such a *stall* runs before those words are read (the socket library's own
thread must move them first), so it would blame D for P's own absence: a P
resumed after a freeze forgot a live D rank, unloaded its NIXL agent under a
WRITE in flight and, on LIBFABRIC before NIXL 1.5, could not write to it
again.

The rule: a gap between two looks longer than ``stall_s`` is P's stall, and
a D rank's silence is counted from the later of its last word and the end of
the last stall. A D rank that is really gone is forgotten ``peer_dead_s``
after P resumed; no look forgets a D rank for time P did not watch.

D does not follow it. P's words to D are answers to D's heartbeats (and the
messages of transfers), so a D that stalls silences both directions: the
silence D counts across its own stall is P's real silence towards it, and P,
which heard nothing from D either, forgets it by the same clock. D then does
best to say hello again at once (its next registration) or declare P dead;
forgiving its stall would only send registrations to a P that no longer
knows it.
"""

from __future__ import annotations


def stall_bar(peer_dead_s: float) -> float:
    """The longest gap between two looks that is not a stall: half of ``peer_dead_s``. P's engine looks many
    times a second (its timers); a gap of half the dead time is no scheduling hiccup, and a shorter stall
    cannot by itself make a live D rank look silent for all of ``peer_dead_s``."""
    return peer_dead_s / 2


class Lookout:
    """P's looks at its D ranks' silence (``look`` at each, then ``silence`` per D rank).

    ``stall_s``: the longest gap between two looks that is not a stall (``stall_bar``).
    """

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.last_look: float | None = None
        self.resumed = float("-inf")
        """When this side's last stall ended (the first look after it); -inf: it never stalled."""

    def look(self, now: float) -> float:
        """A look at ``now``: the length of the stall it ends (the silence before it is forgiven), 0.0 if none."""
        gap = 0.0 if self.last_look is None else now - self.last_look
        self.last_look = now
        if gap <= self.stall_s:
            return 0.0
        self.resumed = now
        return gap

    def silence(self, last_word: float, now: float) -> float:
        """How long a D rank whose last word came at ``last_word`` has been silent at ``now``, as P watched."""
        return now - max(last_word, self.resumed)
