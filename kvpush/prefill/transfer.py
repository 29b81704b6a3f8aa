"""P's record of one transfer: what the forward reported written, its push jobs, and what its Result will say.

The record is owned by the transfer's rendezvous entry (``kvpush.prefill.rendezvous``)
and goes with it, so nothing P knows of a transfer outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.core.outcome import Failed, PushStats, PushTimes
from kvpush.prefill.push_job import DKey, PushJob


@dataclass
class Milestone:
    """Regions ``[0, regions)`` are written, ordered by ``marker`` (None: already written)."""

    regions: int
    marker: Any
    reached: bool = False


@dataclass(frozen=True)
class PackAhead:
    """P's pack list of a prefill, built when it was handed over, before any registration.

    The staged payload needs only P's own block ids (``kvpush.core.payload``), so
    a registration arriving later finds its pack list made and uploaded. It
    was built for the whole prompt and P's own heads: it fits a registration
    of exactly that prefill (the same object), tokens and shared heads.
    """

    prefill: Any
    heads: tuple[int, int]
    num_tokens: int
    start_token: int
    pack: np.ndarray
    blocks: np.ndarray | None = None  # P's block ids (group 0) as an array, made once for the plan too

    def fits(self, prefill: Any, heads: tuple[int, int], num_tokens: int, start_token: int) -> np.ndarray | None:
        """The list, if it is the one this registration needs."""
        same = (self.heads, self.num_tokens, self.start_token) == (heads, num_tokens, start_token)
        return self.pack if same and prefill is self.prefill else None


@dataclass
class Transfer:
    """Everything P keeps about one transfer, owned by its rendezvous entry and gone with it.

    ``milestones``: what the forward reported written, in order (the forward
    is issued ahead of the device, so several layers are reported before the
    first is done, and each is pushed once *its* marker is reached);
    ``jobs``: its pushes by D rank; ``failed``: why one of them did not write
    everything; ``stats``/``times``: what its Result will say. ``wake_at``:
    the fewest ready regions that can start a part of any of its jobs (read
    from the forward's thread, replaced, never mutated in place).
    ``pack_ahead``: the staged pack list built at the prefill's hand-over.
    """

    milestones: list[Milestone] = field(default_factory=list)
    jobs: dict[DKey, PushJob] = field(default_factory=dict)
    failed: Failed | None = None
    stats: PushStats = field(default_factory=PushStats)
    times: PushTimes = field(default_factory=PushTimes)
    wake_at: int = 0
    pack_ahead: PackAhead | None = None
    _confirmed: int = 0  # milestones[:_confirmed] are known reached

    def reset_readiness(self, regions: int, marker: Any) -> None:
        """A (re-issued) prefill: its readiness replaces the old one (its blocks are new)."""
        self.milestones = [Milestone(regions, marker)] if regions else []
        self._confirmed = 0

    def report(self, regions: int, marker: Any, total: int) -> bool:
        """The forward wrote regions ``[0, regions)``; False for a stale report (not beyond the last one)."""
        if self.milestones and self.milestones[-1].regions >= regions:
            return False
        self.milestones.append(Milestone(min(regions, total), marker))
        return True

    def unconfirmed(self) -> Milestone | None:
        """The first milestone not known reached."""
        return self.milestones[self._confirmed] if self._confirmed < len(self.milestones) else None

    def confirm(self) -> None:
        """The first unconfirmed milestone's marker is reached."""
        self.milestones[self._confirmed].reached = True
        self._confirmed += 1

    def readiness(self, sent: int, chain: bool) -> tuple[int, Any, Any]:
        """(ready regions, marker packs queue behind, marker still awaited) for a job that sent ``sent``.

        A backend that chains packs gets every reported region at once, its
        packs queued behind the furthest report's marker on the device;
        otherwise only reached milestones count.
        """
        ready, after, waiting = sent, None, None
        for m in self.milestones:
            if m.regions <= sent:
                continue
            if chain:
                after = m.marker if m.marker is not None else after
            elif not m.reached:
                waiting = m.marker
                break
            ready = m.regions
        return ready, after, waiting

    def end_job(self, job: PushJob, failed: Failed | None, now: float) -> None:
        """Account a job that is over (its ``Done``): its stats, when it completed, and why it failed."""
        t_end = job.t_complete or now
        if job.t_post:
            job.stats.complete_s = max(0.0, t_end - job.t_post)
        self.stats.merge(job.stats)
        self.times.latest("completed", t_end)
        if failed is not None:
            self.failed = failed
        self.jobs.pop(job.key, None)

    def take_outcome(self) -> tuple[PushStats, PushTimes, Failed | None]:
        """Stats, times and failure for a Result; the record starts afresh (a re-issued prefill lives on)."""
        out = (self.stats, self.times, self.failed)
        self.stats, self.times, self.failed = PushStats(), PushTimes(), None
        for job in self.jobs.values():
            job.times = self.times
        return out

    def refresh_wake_at(self) -> None:
        self.wake_at = min((j.wake_at() for j in self.jobs.values() if j.wake_at()), default=0)
