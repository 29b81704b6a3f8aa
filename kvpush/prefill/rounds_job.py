"""P's push of one transfer to one D rank in rounds, through a ring of staging slots (sans-I/O).

A ``PushJob`` whose plan is ``ROUNDS`` (``kvpush.core.rounds``): the payload
is cut into parts no larger than a ring slot; part ``j`` is packed into P's
ring slot ``j % p_slots`` and written into D's ring slot ``j % d_slots``.
The same events and actions as every push job (``kvpush.prefill.push_job``,
``kvpush.prefill.push_actions``), plus one event, ``credit``: D has unpacked
parts ``[0, n)``. The rules:

* a part is packed once its regions are ready (as the push's schedule
  releases them) and its P slot is free: the WRITE of the part that used
  it before (``j - p_slots``) has ended;
* a part is posted, in order, once its pack has ended and D has credited
  every part that used its D slot before (``Ring.may_post``): a slot is
  written again only after D emptied it. So pack, wire and unpack overlap,
  ``p_slots`` packs and ``d_slots`` parts deep;
* a missing credit only holds the next posts back: D repeats its latest
  credit while it waits for parts, and a D rank that went silent is given
  up by P's liveness rule (``heard``, ``peer_gone``) like any other push;
* once cancelled or failed nothing more is packed or posted; packed parts
  waiting for a credit are dropped; packs still running and WRITEs in flight
  end before ``Done`` (P's blocks and ring are read by them), and D hears a
  ``Failure`` only once nothing is in flight;
* the push counts only where D counted it: a cancel that discards (D gave
  up) fails it even after its last part, as for every push job.

Events in, a list of actions out; a question (``StartPack``, ``CheckPack``,
``Post``) ends its list, its answer continues it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvpush.core.outcome import PushTimes, XferState
from kvpush.core.protocol import Register
from kvpush.prefill.job_plan import JobPlan
from kvpush.prefill.push_actions import QUESTIONS, Action, CheckPack, Done, Notify, Post, SendFailure, StartPack
from kvpush.prefill.push_job import PushJob, _Packing


class RoundsJob(PushJob):
    """The push of one transfer to one D rank through a ring (``JobPlan.plan.ring``), from pairing to ``Done``.

    ``slot``: the start of P's ring in its staging region; D's ring starts at the registration's grant.
    """

    def __init__(
        self,
        reg: Register,
        plan: JobPlan,
        times: PushTimes,
        t_start: float,
        plan_s: float,
        slot: int,
        dead_s: float = float("inf"),
    ) -> None:
        super().__init__(reg, plan, times, t_start, plan_s, slot, dead_s=dead_s)
        ring = plan.plan.ring
        assert ring is not None and reg.staging is not None, "a push in rounds needs its ring and D's grant"
        self.ring = ring
        self.d_base = reg.staging.offset
        self.next_part = 0  # parts [0, next_part) are packed, being packed or dropped
        self.credited = 0  # D has unpacked parts [0, credited)
        self.after: Any = None  # the furthest KV marker reported (packs of a chaining backend queue behind it)
        self.waiting_post: deque[int] = deque()  # packed parts, in order, waiting for their credit
        self.packing_parts: deque[int] = deque()  # the part of each entry of ``packing``
        self.posted_parts = 0  # parts [0, posted_parts) are posted
        self.ended = bytearray(ring.parts)  # 1: the part's WRITE is over (its P slot is free again)
        self.by_handle: dict[int, int] = {}  # flying WRITE handle's id -> its part
        self._looked = False  # the oldest pack was asked about since the last outside event

    # -- queries -------------------------------------------------------------
    @property
    def over(self) -> bool:
        return not self.flying and not self.packing and (self.posted_parts == self.ring.parts or self.stopped)

    def wake_at(self) -> int:
        """Fewest ready regions that can start this job's next pack (0: any report may)."""
        if self.stopped or self.next_part >= self.ring.parts:
            return 0
        return max(self.ring.tiles[self.next_part].r1, self.plan.schedule.wake_at(self.sent))

    # -- events (each returns the actions due now) ---------------------------
    def ready(self, ready: int, after: Any, waiting: Any, now: float) -> list[Action]:
        """Regions ``[0, ready)`` are written (packs queue behind ``after``); ``waiting``: the next KV marker.
        The push's schedule says how many of them its parts may take now (``PartSchedule.part_end``)."""
        self._looked = False
        if not self.stopped:
            self.waiting = waiting
            if after is not None:
                self.after = after
            end = self.plan.schedule.part_end(self.sent, ready)
            if end > self.sent:
                self.times.first("ready", now)
                if self.stats.wait_ready_s is None:
                    self.stats.wait_ready_s = max(0.0, now - self.t_start - (self.stats.plan_s or 0.0))
                self.sent = end
        return self._pump()

    def check_packs(self) -> list[Action]:
        self._looked = False
        return self._pump()

    def credit(self, parts: int) -> list[Action]:
        """D has unpacked parts ``[0, parts)`` (cumulative: an older or repeated credit changes nothing)."""
        self._looked = False
        self.credited = min(max(self.credited, parts), self.ring.parts)
        return self._pump()

    def pack_started(self, marker: Any, seconds: float) -> list[Action]:
        a = self._answer(StartPack)
        self.stats.pack_s = (self.stats.pack_s or 0.0) + seconds
        self.packing.append(_Packing(a.r0, a.r1, marker, a.after))
        self.packing_parts.append(a.part)
        return self._pump()

    def packed(self) -> list[Action]:
        self._answer(CheckPack)
        self._looked = False  # the next pack may be done too
        self.packing.popleft()
        j = self.packing_parts.popleft()
        if not self.stopped:
            self.waiting_post.append(j)
        return self._pump()

    def pack_pending(self) -> list[Action]:
        self._answer(CheckPack)
        self._looked = True
        return self._pump()

    def posted(self, handle: Any, ndesc: int, state: XferState, t0: float, t1: float) -> list[Action]:
        a = self._answer(Post)
        st = self.stats
        st.post_s = (st.post_s or 0.0) + t1 - t0
        st.descriptors += ndesc
        st.bytes += a.nbytes
        st.parts += 1
        self.times.first("packed", t0)
        self.times.latest("posted", t1)
        self.t_post = t1
        self.posted_parts += 1
        self.nposted = self.posted_parts
        if state is XferState.PROC:
            self.flying.append(handle)
            self.by_handle[id(handle)] = a.part
        else:
            self.ended[a.part] = 1
            self._ended(state, t1)
        return self._pump()

    def written(self, handle: Any, state: XferState, now: float) -> list[Action]:
        self._looked = False
        if state is not XferState.PROC:
            self.flying = [h for h in self.flying if h is not handle]
            j = self.by_handle.pop(id(handle), None)
            if j is not None:
                self.ended[j] = 1
            self._ended(state, now)
        return self._pump()

    def failed(self, failed: Any) -> list[Action]:
        a = self._asked
        self._asked = None
        if isinstance(a, CheckPack) and self.packing:
            self.packing.popleft()  # a failed pack is over too
            self.packing_parts.popleft()
        if self.failure is None:
            self.failure = failed
        return self._pump()

    # -- actions -------------------------------------------------------------
    def _pump(self) -> list[Action]:
        """The actions due now, up to and including the first question."""
        assert self._asked is None, f"{self._asked} was not answered"
        out: list[Action] = []
        while (a := self._due()) is not None:
            out.append(a)
            if isinstance(a, QUESTIONS):
                self._asked = a
                break
        return out

    def _due(self) -> Action | None:
        while self._todo:  # the Done after a SendFailure; a give-back of what was built ahead (none here)
            item = self._todo.popleft()
            if item[0] == "done":
                return Done(item[1], self.key, self.slot)
        if not self.stopped:
            if self.waiting_post and self.ring.may_post(self.waiting_post[0], self.credited):
                return self._post(self.waiting_post.popleft())
            if not self.told and self.next_part:
                self.told = True
                return Notify(self.reg)
            j = self.next_part
            if j < self.ring.parts and self.ring.tiles[j].r1 <= self.sent and self._p_slot_free(j):
                self.next_part += 1
                tile = self.ring.tiles[j]
                assert self.slot is not None
                return StartPack(tile.r0, tile.r1, self.after, self.slot + self.ring.p_offset(j), part=j)
        if self.packing and not self._looked:
            self._looked = True
            head = self.packing[0]
            return CheckPack(head.marker, head.after, block=not self.flying and not self.stopped)
        if self.done or not self.over:
            return None
        self.done = True
        why = self.failure or self.discarded
        if why is None and self.cancelled is not None and self.posted_parts < self.ring.parts:
            why = self.cancelled
        if why is None:
            return Done(None, self.key, self.slot)
        self._todo.append(("done", why))
        return SendFailure(why, self.reg)

    def _p_slot_free(self, j: int) -> bool:
        """P's ring slot of part ``j`` is free: no part used it before, or that part's WRITE is over."""
        k = j - self.ring.p_slots
        return k < 0 or bool(self.ended[k])

    def _post(self, j: int) -> Post:
        tile = self.ring.tiles[j]
        assert self.slot is not None
        at = (self.slot + self.ring.p_offset(j), self.d_base + self.ring.d_offset(j))
        return Post(tile.r0, tile.r1, None, tile.nbytes, part=j, at=at)
