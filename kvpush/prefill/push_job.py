"""P's push of one transfer to one D rank, as a sans-I/O state machine.

A *job* starts when a registration meets its prefill (``kvpush.prefill.rendezvous``
decides that), is planned once, and then posts *parts*: WRITEs of a range of
regions, each with its own completion, as the KV becomes ready. The job never
touches NIXL, the backend or a socket. Events in, a list of actions out:
every event (``ready``, ``check_packs``, ``pack_started``, ``packed``,
``pack_pending``, ``posted``, ``written``, ``failed``) returns the actions due
now, in order. An action that asks a question (``StartPack``, ``CheckPack``,
``Post``) ends its list: the shell carries it out and answers with the event
it names, whose list continues. *Notes* (``heard``, ``cancel``,
``peer_gone``, ``fault``) change what the job does and return nothing: the
rendezvous makes two of them outside the shell's loop, and what they lead to
comes out of the job's next event (the shell drives every job each step).
The actions are ``kvpush.prefill.push_actions``'.

Rules it keeps: nothing is packed or posted once the job is cancelled or has
failed; a pack that is running still ends before the job does (P's blocks
are read by it); D is sent its ``Failure`` (``SendFailure``) only when no part is in flight any more, so
nothing lands after D reads it; ``Done`` comes exactly once.

A push counts only while its D rank counts it. D declares a silent P rank
dead, fails its transfers and withholds their blocks until it is fenced; a
WRITE of that P rank that ends later (it was frozen) lands in withheld
blocks that D no longer counts. So the job fails, not succeeds, when D gave
up before its last part ended: D's abort, D's rank forgotten (declared dead
or said hello again: ``cancel(discard=True)``, ``peer_gone``), or, when the
last part ends or whenever P looks while a part is posted, D silent for
longer than ``dead_s`` (``heard``: the last word from D; by the same rule D
has not heard from this P rank either, and has given it up). A false alarm
only fails a push D took (P's result is then the pessimistic one); the
other way round P would report success for KV that D threw away.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvpush.core.outcome import Cause, Failed, PlanKind, PushStats, PushTimes, Stage, XferState
from kvpush.core.parts import split_regions
from kvpush.core.protocol import Register
from kvpush.prefill.job_plan import JobPlan, Prepacked
from kvpush.prefill.push_actions import (
    QUESTIONS,
    Action,
    CheckPack,
    Done,
    Notify,
    Post,
    ReleaseMade,
    SendFailure,
    StartPack,
)

DKey = tuple[str, int]
"""A D rank: (engine id, rank)."""


# -- the job -------------------------------------------------------------------------------------


@dataclass
class _Packing:
    r0: int
    r1: int
    marker: Any
    after: Any


class PushJob:
    """The push of one transfer to one D rank, from pairing until its last part is over."""

    def __init__(
        self,
        reg: Register,
        plan: JobPlan,
        times: PushTimes,
        t_start: float,
        plan_s: float,
        slot: int | None = None,
        made: dict[tuple[int, int], tuple[Any, int]] | None = None,
        prepacked: Prepacked | None = None,
        dead_s: float = float("inf"),
    ) -> None:
        self.reg = reg
        self.dead_s = dead_s
        self.heard_at = t_start  # the last word from D's rank (``heard``)
        self.discarded: Failed | None = None  # D gave up while parts were posted: what landed does not count
        self.key: DKey = (reg.engine_id, reg.rank)
        self.plan = plan
        self.times = times  # the transfer's stage times (shared by its jobs)
        self.t_start = t_start
        self.slot = slot
        self.made = dict(made or {})
        self.stats = PushStats(plan=plan.kind, plan_s=plan_s, pieces=plan.plan.pieces)
        self.prepacked = prepacked if plan.kind is PlanKind.STAGED else None
        if plan.kind in (PlanKind.DIRECT, PlanKind.PEER) or self.prepacked is not None:
            self.stats.pack_s = 0.0  # a direct or peer push, or one packed at hand-over, has no pack stage
        self.sent = 0  # regions [0, sent) are posted or being packed
        self.nposted = 0  # regions posted (a cancel may drop packed parts)
        self.packing: deque[_Packing] = deque()
        self.flying: list[Any] = []  # handles of posted WRITEs not yet over
        self.waiting: Any = None  # the KV marker this job waits for (backends that do not chain)
        self.told = False
        self.failure: Failed | None = None
        self.cancelled: Failed | None = None
        self.t_post = 0.0
        self.t_complete = 0.0
        self.done = False
        self._todo: deque[tuple[Any, ...]] = deque()
        self._asked: Action | None = None  # the action whose result is awaited
        self._keep = 0  # packs the check in progress leaves running (one while parts are still being started)
        if self.prepacked is not None:
            # Every part is in the slot packed at hand-over, or will be once its marker is reached: each part
            # waits for that marker (a cancel too: the pack writes the slot until then), nothing is packed here.
            p = self.prepacked
            for r0, r1 in split_regions(0, plan.nregions, plan.parts(plan.nregions)):
                self.packing.append(_Packing(r0, r1, p.marker, p.after))
            self.sent = plan.nregions

    # -- queries -------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """Cancelled or failed: nothing more is packed or posted."""
        return self.failure is not None or self.cancelled is not None

    @property
    def over(self) -> bool:
        n = self.plan.nregions
        return not self.flying and not self.packing and (self.nposted == n or self.stopped)

    @property
    def watch(self) -> Any:
        """The device marker this job waits for (the oldest pack, else the KV), or None."""
        return self.packing[0].marker if self.packing else self.waiting

    @property
    def oldest_pack(self) -> tuple[int, int] | None:
        """The regions ``(r0, r1)`` of the oldest pack running, or None."""
        return (self.packing[0].r0, self.packing[0].r1) if self.packing else None

    def wake_at(self) -> int:
        """Fewest ready regions that can start this job's next part (0: any report may)."""
        if self.stopped or self.sent >= self.plan.nregions:
            return 0
        return self.plan.schedule.wake_at(self.sent)

    # -- events (each returns the actions due now) ---------------------------
    def ready(self, ready: int, after: Any, waiting: Any, now: float) -> list[Action]:
        """Regions ``[0, ready)`` are written (packs and peer copies queue behind ``after``); ``waiting``: the
        next KV marker.

        Queues the parts the schedule posts now; an empty plan announces
        itself at once (it has no bytes to wait for).
        """
        if not self.stopped:
            self._queue_ready(ready, after, waiting, now)
        return self._actions()

    def _queue_ready(self, ready: int, after: Any, waiting: Any, now: float) -> None:
        plan = self.plan
        self.waiting = waiting
        if plan.kind is PlanKind.EMPTY:
            if self.sent == 0:
                self.sent = plan.nregions
                self._todo.extend([("notify",), ("post", 0, plan.nregions)])
            return
        if self.prepacked is not None:
            self._prepacked_parts(now)
            return
        end = plan.schedule.part_end(self.sent, ready)
        if end <= self.sent:
            return
        self.times.first("ready", now)
        if self.stats.wait_ready_s is None:
            # Planned at pairing; this is how long the KV took after that (layer-wise: the forward).
            self.stats.wait_ready_s = max(0.0, now - self.t_start - (self.stats.plan_s or 0.0))
        for r0, r1 in split_regions(self.sent, end, plan.parts(end - self.sent)):
            self.sent = r1
            if plan.kind is PlanKind.STAGED:
                # One pack ahead: part k is posted while part k+1 packs; the heads-up goes after the
                # first pack's launch, so it is sent while the device packs.
                self._todo.extend([("pack", r0, r1, after), ("notify",), ("check", 1)])
            else:
                self._todo.extend([("notify",), ("post", r0, r1, after)])

    def _prepacked_parts(self, now: float) -> None:
        """Packed at hand-over (the parts are queued as packing since the job began): tell D, then post each
        part once the pack's marker is reached. The KV was written before that pack: no readiness to wait for."""
        if self.stats.wait_ready_s is not None:
            return
        self.times.first("ready", now)
        self.stats.wait_ready_s = 0.0
        self._todo.extend([("notify",), ("check", 0)])

    def check_packs(self) -> list[Action]:
        """Ask about the packs that may be done (every step, after ``ready``: a pack ends on the device, unseen)."""
        if self.packing or any(item[0] == "pack" for item in self._todo):
            self._todo.append(("check", 0))
        return self._actions()

    def pack_started(self, marker: Any, seconds: float) -> list[Action]:
        """The asked ``StartPack`` runs until ``marker`` is reached (``seconds``: its launch)."""
        a = self._answer(StartPack)
        self.stats.pack_s = (self.stats.pack_s or 0.0) + seconds
        self.packing.append(_Packing(a.r0, a.r1, marker, a.after))
        return self._actions()

    def packed(self) -> list[Action]:
        """The oldest pack is done: post it, then look at the next one."""
        self._answer(CheckPack)
        p = self.packing.popleft()
        # Once stopped, nothing is posted; the pack only had to end before P's blocks go back.
        self._todo.appendleft(("check", self._keep))
        if not self.stopped:
            self._todo.appendleft(("post", p.r0, p.r1))
        return self._actions()

    def pack_pending(self) -> list[Action]:
        """The oldest pack is still running."""
        self._answer(CheckPack)
        return self._actions()

    def posted(self, handle: Any, ndesc: int, state: XferState, t0: float, t1: float) -> list[Action]:
        """The WRITE of the asked part was posted (``state``: NIXL's answer to the post)."""
        a = self._answer(Post)
        self.nposted += a.r1 - a.r0
        if self.plan.kind is not PlanKind.EMPTY:
            st = self.stats
            st.post_s = (st.post_s or 0.0) + t1 - t0
            st.descriptors += ndesc
            st.bytes += a.nbytes
            st.parts += 1
            self.times.first("packed", t0)
            self.times.latest("posted", t1)
            self.t_post = t1
            if state is XferState.PROC:
                self.flying.append(handle)
            else:
                self._ended(state, t1)
        return self._actions()

    def written(self, handle: Any, state: XferState, now: float) -> list[Action]:
        """A posted WRITE is over (``DONE`` or ``ERR``); ``PROC`` changes nothing."""
        if state is not XferState.PROC:
            self.flying = [h for h in self.flying if h is not handle]
            self._ended(state, now)
        return self._actions()

    def failed(self, failed: Failed) -> list[Action]:
        """The asked action failed (a pack, a post, a check): the job ends once nothing is in flight."""
        a = self._asked
        self._asked = None
        if isinstance(a, CheckPack) and self.packing:
            self.packing.popleft()  # a failed pack is over too
            self._todo.appendleft(("check", self._keep))
        if self.failure is None:
            self.failure = failed
        return self._actions()

    # -- notes (what follows comes out of the next event) ---------------------
    def cancel(self, cause: Cause, reason: str, discard: bool = False) -> None:
        """Stop posting (an abort, D gone); what is in flight or packing still ends first. ``discard``: D gave
        up (its abort, its rank forgotten): D does not count what lands from now on, so the push failed even
        if every part was posted already."""
        if self.cancelled is None:
            stage = Stage.POST if self.sent else Stage.RENDEZVOUS
            self.cancelled = Failed(stage, cause, reason)
        if discard and self.discarded is None and not self.done:
            self.discarded = Failed(Stage.WRITE, cause, f"{reason}; D does not count what lands after it gave up")

    def fault(self, failed: Failed) -> None:
        """Something other than an asked action failed (a bug, an error carrying out another action): nothing
        more is packed or posted, and the job fails once nothing is in flight. A question already asked is
        still carried out and answered (a pack started then still ends before the job does)."""
        if self.failure is None:
            self.failure = failed

    def peer_gone(self, reason: str) -> None:
        """D's rank is forgotten: cancel, and give back the WRITEs built for it first thing at the next event
        (they name its agent)."""
        self.cancel(Cause.DEAD_PEER, reason, discard=True)
        self._todo.appendleft(("release",))

    def heard(self, t: float, now: float) -> None:
        """D's rank last said something at ``t`` (a heartbeat, any message), looked at ``now``: silent longer
        than ``dead_s`` while a part is posted, D has given this P rank up and does not count the push. P's
        shell looks before it reads the side channel, so a word D sent before it gave up, read only after a
        freeze, does not hide the silence."""
        silent = now - self.heard_at
        if self.nposted and not self.done and silent > self.dead_s and self.discarded is None:
            d = f"D {self.key[0]} rank {self.key[1]}"
            why = f"{d} silent for {silent:.1f}s while the WRITE was posted (this P rank frozen, or the link down): "
            why += f"D gives a P rank up after peer_dead_s ({self.dead_s:g}s) and does not count what lands later"
            self.discarded = Failed(Stage.WRITE, Cause.DEAD_PEER, why)
        self.heard_at = max(self.heard_at, t)

    # -- actions -------------------------------------------------------------
    def _actions(self) -> list[Action]:
        """The actions due now, up to and including the first question (``QUESTIONS``)."""
        assert self._asked is None, f"{self._asked} was not answered"
        out: list[Action] = []
        while (a := self._next()) is not None:
            out.append(a)
            if isinstance(a, QUESTIONS):
                self._asked = a
                break
        return out

    def _next(self) -> Action | None:
        while self._todo:
            a = self._action(self._todo.popleft())
            if a is not None:
                return a
        if self.done or not self.over:
            return None
        if self.made:
            return self._action(("release",))
        self.done = True
        why = self.failure or self.discarded
        if why is None and self.cancelled is not None and self.nposted < self.plan.nregions:
            why = self.cancelled
        self._todo.append(("done", why))
        return SendFailure(why, self.reg) if why is not None else self._next()

    def _action(self, item: tuple[Any, ...]) -> Action | None:
        kind = item[0]
        if kind == "notify":
            if self.told or self.stopped:
                return None
            self.told = True
            return Notify(self.reg)
        if kind in ("pack", "post") and self.stopped:
            return None
        if kind == "pack":
            r0, r1 = item[1], item[2]
            assert self.slot is not None, "a staged job without a staging slot"
            return StartPack(r0, r1, item[3], self.slot + r0 * self.plan.region_bytes)
        if kind == "post":
            r0, r1 = item[1], item[2]
            nbytes = self.plan.plan.bytes_of(r0, r1) if self.plan.kind is not PlanKind.EMPTY else 0
            after = item[3] if len(item) > 3 else None
            return Post(r0, r1, self.made.pop((r0, r1), None), nbytes, after)
        if kind == "check":
            return self._check(item[1])
        if kind == "release":
            handles, self.made = tuple(h for h, _ in self.made.values()), {}
            return ReleaseMade(handles) if handles else None
        return Done(item[1], self.key, self.slot)

    def _check(self, keep: int) -> CheckPack | None:
        """``CheckPack`` of the oldest pack while more than ``keep`` are running.

        In the tail (every region is packing or posted) the thread waits for
        each pack instead of polling: packs are short kernels of ours, and a
        poll's sleep would add to the critical path per part. But not while a
        part's WRITE flies: NIXL completes it and sends its notification only
        when this thread drives NIXL, so waiting for pack k+1 would hold part
        k's notification back by that pack (D would unpack nothing while P
        packs); then it polls, and the WRITE is driven between polls. Before
        the tail (layers still computing) it polls, so a pack slowed by the
        forward blocks nothing.
        """
        if len(self.packing) <= keep:
            return None
        self._keep = keep
        head = self.packing[0]
        block = self.sent == self.plan.nregions and not self.stopped and not self.flying
        return CheckPack(head.marker, head.after, block)

    def _answer(self, kind: type) -> Any:
        a = self._asked
        assert isinstance(a, kind), f"answer for {kind.__name__}, but {a} was asked"
        self._asked = None
        return a

    def _ended(self, state: XferState, now: float) -> None:
        self.t_complete = now
        if state is not XferState.DONE and self.failure is None:
            d = f"D {self.key[0]} rank {self.key[1]}"
            self.failure = Failed(Stage.WRITE, Cause.WRITE_ERROR, f"WRITE to {d} failed")
        self.heard(self.heard_at, now)
