"""Carrying out P's push jobs: the backend's packs, the WRITEs (NIXL's or peer writes), the plan made at pairing.

The sender's engine thread calls ``start_job`` for each push the rendezvous
decided and ``drive`` for each job on every step; the rules of what to do
when are ``kvpush.prefill.push_job.PushJob``'s. Here is only I/O: confirm device
markers, start and check packs, build and post WRITEs, and answer each of the
job's actions with what happened.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, StagingBuffer
from kvpush.backends.copy import Copier
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.errors import KVPushError
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import Cause, Failed, PartTimes, PlanKind, Stage, XferState
from kvpush.core.parts import split_regions
from kvpush.core.plan import Plan, group_runs, part_descriptors
from kvpush.engine import by_index
from kvpush.engine.peer_writes import Writes
from kvpush.engine.ports import PeerLookup, PushPort
from kvpush.observability.metrics import Count
from kvpush.prefill.decisions import Prefill
from kvpush.prefill.job_plan import JobPlan
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
from kvpush.prefill.push_job import PushJob
from kvpush.prefill.push_start import BadRegistration, Local, Remote, start_push
from kvpush.prefill.rounds_job import RoundsJob
from kvpush.prefill.slots import StagingSlots
from kvpush.prefill.transfer import Transfer
from kvpush.transport.nixl_agent import Agent

log = logging.getLogger(__name__)


@dataclass
class PushRunner:
    """The I/O half of one P rank's push jobs, made with the engine's agent (``Sender.setup``).

    ``staging``: P's staging region; ``slots``: the rule of its slots (``kvpush.prefill.slots``); ``peers``:
    the D ranks that said hello; ``port``: what the jobs tell the engine; ``writes``: posts, polls and gives
    back the WRITEs (``kvpush.engine.peer_writes``).
    """

    name: str
    cfg: Config
    rank: int
    layout: KVLayout
    backend: Backend
    copy: Copier
    agent: Agent
    staging: StagingBuffer | None
    slots: StagingSlots
    peers: PeerLookup
    port: PushPort
    writes: Writes

    def __post_init__(self) -> None:
        self.region_bases = [r.base for r in self.layout.regions]
        self._parts: dict[int, PartTimes] = {}  # the times of each flying WRITE's part, by handle
        self.layer_ends = tuple(self.layout.regions_through(i) for i in range(self.layout.num_layers))
        self.costs = by_index.costs_of(self.cfg, self.agent.nixl_version)  # how a direct part's WRITE is made
        staging = (self.staging.addr, self.staging.device_id) if self.staging is not None else None
        chains = self.backend.capabilities.chained_ready
        pack_bw = self.backend.pack_bandwidth()
        self.local = Local(self.cfg, self.layout, staging, self.layer_ends, pack_bw, chains, self.copy.asynchronous)
        """This P rank, as ``push_start.start_push`` decides a push's start against it."""

    def drive(self, tid: str, rec: Transfer, job: PushJob) -> None:
        """Feed the job what happened (readiness, packs, WRITEs) and carry out the actions it returns."""
        try:
            chain = job.plan.chain
            if not chain and not job.stopped:
                while (m := rec.unconfirmed()) is not None and self.backend.poll_ready(m.marker):
                    rec.confirm()
            self._apply(tid, rec, job, job.ready(*rec.readiness(job.sent, chain), time.monotonic()))
            self._apply(tid, rec, job, job.check_packs())
            for handle in list(job.flying):
                state = self.writes.state(handle)
                if state is not XferState.PROC:
                    self.writes.release(handle)
                    now = time.monotonic()
                    part = self._parts.pop(id(handle), None)
                    if part is not None:
                        part.stamp("written", now)
                    self._apply(tid, rec, job, job.written(handle, state, now))
        except Exception as exc:
            # A bug or a backend failure must end this push (D is told), not wedge the loop.
            log.exception("%s: push %s failed", self.name, tid)
            job.fault(Failed(Stage.POST, Cause.OTHER, f"push failed: {exc}"))
            self._apply(tid, rec, job, job.check_packs())

    def _apply(self, tid: str, rec: Transfer, job: PushJob, actions: list[Action]) -> None:
        """Carry out the job's actions in order; a question's answer brings the actions that follow it.

        An error carrying out one fails the job (``PushJob.failed`` for the asked action, else
        ``PushJob.fault``) and the rest still runs: ends and give-backs are never skipped."""
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            try:
                todo.extend(self._carry_out(tid, rec, job, a))
            except Exception as exc:
                log.exception("%s: push %s failed", self.name, tid)
                failed = Failed(Stage.POST, Cause.OTHER, f"push failed: {exc}")
                if isinstance(a, QUESTIONS):
                    todo.extend(job.failed(failed))
                else:
                    job.fault(failed)

    def _carry_out(self, tid: str, rec: Transfer, job: PushJob, a: Action) -> list[Action]:
        """Carry out one action; for a question, return the job's answer."""
        if isinstance(a, StartPack):
            return self._start_pack(job, a)
        if isinstance(a, CheckPack):
            return self._check_pack(job, a)
        if isinstance(a, Post):
            return self._post(job, a)
        if isinstance(a, Notify):
            peer = self.peers.get((a.reg.engine_id, a.reg.rank))
            if peer is not None:
                self.port.tell_posting(a.reg, peer)
        elif isinstance(a, ReleaseMade):
            for handle in a.handles:
                self.writes.release(handle)
        elif isinstance(a, SendFailure):
            ident = self.peers.ident_of((a.reg.engine_id, a.reg.rank))
            if ident is not None:
                self.port.fail(ident, a.reg, a.failed)
        elif isinstance(a, Done):
            self.slots.job_done(a.slot)
            rec.end_job(job, a.failed, time.monotonic())
            self.port.push_ended(tid, a.key, a.failed)
        return []

    def _start_pack(self, job: PushJob, a: StartPack) -> list[Action]:
        """Start packing a part; asynchronous where the backend can, so several parts pack back to back."""
        pack = job.plan.plan.pack
        ring = job.plan.plan.ring
        if ring is not None and job.plan.slices is not None:
            tile = ring.tiles[a.part]
            pack = job.plan.slices[(tile.q0, tile.q1)]
        assert pack is not None and self.staging is not None
        t0 = time.monotonic()
        try:
            staging = self.staging.addr + a.offset
            # ``after`` only for backends that chain: others may implement start_pack without it.
            if a.after is not None:
                marker = self.copy.start_pack(self.region_bases[a.r0 : a.r1], pack, staging, after=a.after)
            else:
                marker = self.copy.start_pack(self.region_bases[a.r0 : a.r1], pack, staging)
        except Exception as exc:
            return job.failed(Failed(Stage.PACK, Cause.POST_ERROR, f"pack failed: {exc}"))
        job.times.part(a.r0, a.r1, job.key[1]).stamp("pack", t0)
        return job.pack_started(marker, time.monotonic() - t0)

    def _check_pack(self, job: PushJob, a: CheckPack) -> list[Action]:
        try:
            if a.block and (a.after is None or self.backend.poll_ready(a.after)):
                self.backend.wait_ready(a.marker)  # our own short kernel, never a layer still computing
                done = True
            else:
                done = self.backend.poll_ready(a.marker)
        except Exception as exc:
            return job.failed(Failed(Stage.PACK, Cause.POST_ERROR, f"pack failed: {exc}"))
        if not done:
            return job.pack_pending()
        if (head := job.oldest_pack) is not None:
            job.times.part(*head, job.key[1]).stamp("packed", time.monotonic())
        return job.packed()

    def _post(self, job: PushJob, a: Post) -> list[Action]:
        peer = self.peers.get(job.key)
        t1 = time.monotonic()
        handle, ndesc, state = None, 0, XferState.DONE
        try:
            if peer is None:
                raise KVPushError(f"D {job.key[0]} rank {job.key[1]} is gone")
            if job.plan.kind is PlanKind.EMPTY:
                notif = peer.seal(_completion(job.plan.plan, job.reg, self.rank, a.r0, a.r1, 0))
                self.agent.send_notif(peer.agent, notif)
            elif job.plan.kind is PlanKind.ROUNDS:
                handle, ndesc = self._round_part(job.reg, peer, a), 1
                state = self.writes.post(handle, None)
                job.heard(peer.last_seen, time.monotonic())
            else:
                handle, ndesc = a.made if a.made is not None else self._build_part(job.plan.plan, job.reg, peer, a)
                state = self.writes.post(handle, a.after)
                job.heard(peer.last_seen, time.monotonic())  # a post may return after a freeze
        except Exception as exc:
            return job.failed(Failed(Stage.POST, Cause.POST_ERROR, f"post failed: {exc}"))
        t2 = time.monotonic()
        if handle is not None:
            part = job.times.part(a.r0, a.r1, job.key[1])
            part.stamp("post", t1)
            part.stamp("posted", t2)
            if state is XferState.PROC:
                self._parts[id(handle)] = part
            else:
                part.stamp("written", t2)
            self.port.bump(Count.PARTS)
            self.port.bump(Count.BYTES, a.nbytes)
            self.port.bump(Count.DESCRIPTORS, ndesc)
            if a.made is not None:
                self.port.bump(Count.PARTS_PREBUILT)
            if state is not XferState.PROC:
                self.writes.release(handle)
        return job.posted(handle, ndesc, state, t1, t2)

    def _round_part(self, reg: protocol.Register, peer: Any, a: Post) -> Any:
        """The unposted WRITE of part ``a.part`` of a push in rounds: from its slot of P's ring to its slot of
        D's (``a.at``), one descriptor, with its completion naming the part."""
        assert self.staging is not None and peer.staging is not None
        local = np.array([[self.staging.addr + a.at[0], a.nbytes, self.staging.device_id]], dtype=np.int64)
        remote = np.array([[peer.staging.base + a.at[1], a.nbytes, peer.staging.device_id]], dtype=np.int64)
        notif = protocol.encode(
            protocol.Completion(
                reg.transfer_id,
                reg.request_id,
                self.rank,
                PlanKind.ROUNDS,
                a.nbytes,
                1,
                reg.staging,
                reg.attempt,
                region_start=a.r0,
                region_end=a.r1,
                part=a.part,
            )
        )
        notif = peer.seal(notif)  # where D checks seals (``Peer.seal``)
        return self.agent.prepare_write(local, str(self.staging.mem), remote, str(peer.staging_mem), peer.agent, notif)

    def credit(self, tid: str, rec: Transfer, job: RoundsJob, parts: int) -> None:
        """D credited parts ``[0, parts)`` of a push in rounds: the posts they held back go now."""
        self._apply(tid, rec, job, job.credit(parts))

    def look_at_silence(self, jobs: list[PushJob], now: float) -> None:
        """Tell each posted push when its D rank last spoke (``PushJob.heard``)."""
        for job in jobs:
            peer = self.peers.get(job.key)
            if peer is not None and job.nposted:
                job.heard(peer.last_seen, now)

    def release_flying(self, jobs: list[PushJob]) -> None:
        """Shutdown: give back the handles of WRITEs still in flight."""
        for job in jobs:
            for handle in job.flying:
                self._parts.pop(id(handle), None)
                self.writes.release(handle)

    def start_job(self, tid: str, rec: Transfer, prefill: Prefill, reg: protocol.Register) -> None:
        """Pair made: how the push starts is ``push_start.start_push``'s (often before the KV exists); here the
        backend's hints, the WRITEs built ahead, and the job made, which posts parts as regions become ready."""
        t0 = time.monotonic()
        key = (reg.engine_id, reg.rank)
        peer = self.peers.get(key)
        if peer is None:
            gone = Failed(Stage.RENDEZVOUS, Cause.DEAD_PEER, f"D {reg.engine_id} rank {reg.rank} is gone")
            self.port.push_ended(tid, key, gone)
            return
        staging = (peer.staging.base, peer.staging.device_id) if peer.staging is not None else None
        remote = Remote(peer.layout, staging, peer.mapped is not None)
        try:
            start = start_push(self.local, self.slots, prefill, reg, remote, rec)
        except Exception as exc:
            cause = Cause.BAD_REGISTRATION if isinstance(exc, BadRegistration) else Cause.POST_ERROR
            self.port.fail(peer.ident, reg, Failed(Stage.PLAN, cause, str(exc)))
            self.port.push_ended(tid, key, Failed(Stage.PLAN, cause, f"planning failed: {exc}"))
            return
        for count in start.counts:
            self.port.bump(count)
        plan, jp, slot, dead_s = start.plan, start.job_plan, start.slot, self.cfg.polling.peer_dead_s
        if plan.kind is PlanKind.ROUNDS:
            assert slot is not None
            self._hint_slices(jp)
            t_plan = time.monotonic()
            self._start(tid, rec, reg, RoundsJob(reg, jp, rec.times, t0, t_plan - t0, slot, dead_s), t0, t_plan, plan)
            return
        made = {}
        if plan.kind is PlanKind.STAGED and start.prepacked is None:
            made = self._prepare(jp, prefill, rec, peer, reg, slot)
        elif plan.kind in (PlanKind.DIRECT, PlanKind.PEER) and self._ahead(prefill, rec):
            made = self._build_ahead(plan, reg, peer, [(0, plan.nregions)])
        t_plan = time.monotonic()
        job = PushJob(reg, jp, rec.times, t0, t_plan - t0, slot, made, start.prepacked, dead_s=dead_s)
        self._start(tid, rec, reg, job, t0, t_plan, plan)

    def _hint_slices(self, jp: JobPlan) -> None:
        """A push in rounds: hand the backend P's pack list cut to each stream range of its parts (one table per
        range, whatever the number of parts)."""
        try:
            for pieces in (jp.slices or {}).values():
                self.copy.prepare_pack(self.region_bases, pieces)
        except Exception:
            log.exception("%s: prepare_pack failed (pack will do it)", self.name)

    def _start(
        self, tid: str, rec: Transfer, reg: protocol.Register, job: PushJob, t0: float, t_plan: float, plan: Plan
    ) -> None:
        """The job made: P looks at its D rank's silence from now, and the transfer's record holds it."""
        key = (reg.engine_id, reg.rank)
        peer = self.peers.get(key)
        if peer is not None:
            job.heard(peer.last_seen, t_plan)
        rec.jobs[key] = job
        rec.times.first("push_start", t0)
        rec.times.first("planned", t_plan)
        log.debug(
            "%s: push %s -> %s/%d plan=%s bytes=%d pieces=%d descs<=%d est=%s",
            self.name,
            tid,
            reg.engine_id,
            reg.rank,
            plan.kind,
            plan.nbytes,
            plan.pieces,
            plan.descriptors,
            plan.estimate,
        )

    def _prepare(
        self, jp: JobPlan, prefill: Prefill, rec: Transfer, peer: Any, reg: protocol.Register, slot: int | None
    ) -> dict[tuple[int, int], tuple[Any, int]]:
        """Hand the backend its piece tables now and, for a push announced ahead (its KV not reported
        yet, so most likely reported whole and cut like this), build the parts' WRITEs; a part cut
        otherwise (layers) is built when posted, unused ones are given back with the job."""
        plan = jp.plan
        assert plan.pack is not None
        cut = split_regions(0, plan.nregions, jp.parts(plan.nregions)) if self._ahead(prefill, rec) else []
        parts = []
        if self.staging is not None and slot is not None:
            base = self.staging.addr + slot
            parts = [(r0, r1, base + r0 * plan.region_bytes) for r0, r1 in cut]
        # A list built at hand-over was handed to prepare_pack then; without parts to add, again is only work.
        prepared = rec.pack_ahead is not None and plan.pack is rec.pack_ahead.pack
        try:
            if parts or not prepared:
                self.copy.prepare_pack(self.region_bases, plan.pack, parts=parts)
        except Exception:
            log.exception("%s: prepare_pack failed (pack will do it)", self.name)
        return self._build_ahead(plan, reg, peer, cut)

    @staticmethod
    def _ahead(prefill: Prefill, rec: Transfer) -> bool:
        """The push is planned before its KV was reported: most likely reported whole, later, so the WRITEs
        of its parts can be built now, off the path from "KV ready" to D."""
        return bool(prefill.num_tokens) and not rec.milestones

    def _build_ahead(
        self, plan: Plan, reg: protocol.Register, peer: Any, cut: list[tuple[int, int]]
    ) -> dict[tuple[int, int], tuple[Any, int]]:
        """The unposted WRITEs of ``cut``'s parts, by part; the job posts them as they are due and gives back
        those its parts did not match (a layer-wise cut). A failure here only means building them when posted."""
        made: dict[tuple[int, int], tuple[Any, int]] = {}
        try:
            for r0, r1 in cut:
                made[(r0, r1)] = self._build_part_of(plan, reg, peer, r0, r1)
        except Exception:
            log.exception("%s: building %s's WRITEs ahead failed (built when posted)", self.name, reg.transfer_id)
            for handle, _ in made.values():
                self.writes.release(handle)
            made = {}
        return made

    def _build_part(self, plan: Plan, reg: protocol.Register, peer: Any, a: Post) -> tuple[Any, int]:
        return self._build_part_of(plan, reg, peer, a.r0, a.r1, ahead=False)

    def _build_part_of(
        self, plan: Plan, reg: protocol.Register, peer: Any, r0: int, r1: int, ahead: bool = True
    ) -> tuple[Any, int]:
        """The unposted WRITE of regions ``[r0, r1)`` with its completion notification, and its descriptor count
        (a peer write's: none, its pieces go to the backend's copy). ``ahead``: built before it is due, so a
        peer write has its copy prepared now; one built as it is posted launches without that extra step."""
        if plan.kind is PlanKind.PEER:
            notif = peer.seal(_completion(plan, reg, self.rank, r0, r1, 0))
            copies = self._peer_copies(plan, peer, r0, r1)
            return self.writes.peer_write(peer.mapped, copies, peer.agent, notif, prepare=ahead), 0
        if plan.kind is PlanKind.DIRECT:

            def notif_of(ndesc: int) -> bytes:
                return peer.seal(_completion(plan, reg, self.rank, r0, r1, ndesc))  # sealed like every notification

            made = by_index.build_direct(
                self.agent, self.costs, plan, self.layout, peer.layout, peer.agent, r0, r1, notif_of
            )
            if made is not None:
                handle, ndesc, count = made
                self.port.bump(count)
                return handle, ndesc
        local, remote = part_descriptors(plan, self.layout, peer.layout, r0, r1)
        notif = peer.seal(_completion(plan, reg, self.rank, r0, r1, local.shape[0]))
        lmem, rmem = self.layout.mem, peer.layout.mem
        if plan.kind is PlanKind.STAGED and self.staging is not None:  # staging may live elsewhere than the KV
            lmem, rmem = self.staging.mem, peer.staging_mem
        handle = self.agent.prepare_write(local, str(lmem), remote, str(rmem), peer.agent, notif)
        return handle, local.shape[0]

    def _peer_copies(self, plan: Plan, peer: Any, r0: int, r1: int) -> list[tuple[list[int], list[int], np.ndarray]]:
        """The copies of regions ``[r0, r1)`` of a peer plan: (P's bases, D's bases, pieces), one per run of
        regions that share their pieces (a hybrid model's group)."""
        dst = [r.base for r in peer.layout.regions]
        if not plan.group_merged:
            return [(self.region_bases[r0:r1], dst[r0:r1], plan.merged)]
        return [
            (self.region_bases[a:b], dst[a:b], plan.group_merged[plan.region_group[a]])
            for a, b in group_runs(plan, r0, r1)
        ]


def _completion(plan: Plan, reg: protocol.Register, rank: int, r0: int, r1: int, ndesc: int) -> bytes:
    """The notification that travels with the WRITE of regions ``[r0, r1)`` (the peer seals it: ``Peer.seal``)."""
    staged = plan.kind is PlanKind.STAGED
    return protocol.encode(
        protocol.Completion(
            reg.transfer_id,
            reg.request_id,
            rank,
            plan.kind,
            plan.bytes_of(r0, r1),
            ndesc,
            reg.staging if staged else None,
            reg.attempt,
            region_start=r0,
            region_end=r1,
        )
    )
