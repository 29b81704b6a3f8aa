"""P side: the push engine's shell (side channel, NIXL, backend calls, one loop).

The engine hands over a finished prefill with ``prefill_finished``
(whole-request push) or announces it with ``prefill_started`` and then
reports layers as the forward writes them with ``layer_written`` (layer-wise
push), and later learns from ``poll`` which requests' blocks it may free.
Nothing here blocks the caller.

Every rule lives in the pure machines: ``Rendezvous`` pairs registrations
with prefills and owns each transfer's record, and a ``PushJob`` per
(transfer, D rank) decides what to pack and post and when. This thread only
feeds them events (messages, readiness, device markers, NIXL states) and
carries out their decisions and actions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpush import protocol
from kvpush.backends.base import Backend
from kvpush.config import Config
from kvpush.engine.loop import EngineLoop
from kvpush.engine.peers import PeerTable
from kvpush.engine.types import Result
from kvpush.engine.waiter import MarkerWaiter
from kvpush.errors import KVPushError
from kvpush.layout import KVLayout
from kvpush.metrics import Count
from kvpush.outcome import Cause, Failed, PlanKind, PushStats, PushTimes, Stage, XferState
from kvpush.plan import PartSchedule, Plan, build_plan, part_descriptors, split_regions
from kvpush.push_job import (
    CheckPack,
    DKey,
    Done,
    Fail,
    JobPlan,
    Notify,
    Post,
    PushJob,
    ReleaseMade,
    StartPack,
    Transfer,
)
from kvpush.rendezvous import Decision, Hold, Prefill, Refuse, Release, Rendezvous
from kvpush.transport.side_channel import Server

log = logging.getLogger(__name__)

TIMER_PERIOD_S = 0.05


class Sender(EngineLoop):
    """One P rank's push engine."""

    SIDE = "prefill"

    def __init__(
        self,
        config: Config,
        backend: Backend,
        layout: KVLayout,
        engine_id: str,
        rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__("push", config, backend, layout, engine_id, rank, tp_size)
        self.rdv = Rendezvous(prefill_lease_s=config.prefill_lease_s)
        self.peers = PeerTable(self, layout)
        self._layer_ends = tuple(self.layout.regions_through(i) for i in range(self.layout.num_layers))
        self._waiter: MarkerWaiter | None = None  # created at the first device marker to wait for
        self.quiet_reports = 0  # layer reports that did not wake the push thread (written by the caller)
        self._next_timer = 0.0
        self.address: tuple[str, int] = ("", 0)
        self.start()

    # -- caller API ----------------------------------------------------
    def prefill_finished(
        self,
        transfer_id: str,
        request_id: str,
        block_ids: list[list[int]] | tuple[tuple[int, ...], ...],
        num_tokens: int,
        ready: Any = None,
    ) -> None:
        """Hand over a finished prefill (every layer written, ordered by ``ready``); its blocks stay
        untouched until ``poll`` returns it."""
        prefill = Prefill(transfer_id, request_id, tuple(tuple(int(b) for b in g) for g in block_ids), num_tokens)
        t_done = time.monotonic()  # the caller's moment, not when the engine thread gets to it
        self.call(lambda: self._on_prefill(prefill, len(self.region_bases), ready, t_done))

    def prefill_started(
        self,
        transfer_id: str,
        request_id: str,
        block_ids: list[list[int]] | tuple[tuple[int, ...], ...],
        num_tokens: int,
    ) -> None:
        """Announce a prefill whose layers will be reported by ``layer_written`` (layer-wise push).

        Its blocks must stay untouched until ``poll`` returns it, even if it is
        aborted: a layer may be being written to D.
        """
        prefill = Prefill(transfer_id, request_id, tuple(tuple(int(b) for b in g) for g in block_ids), num_tokens)
        t = time.monotonic()
        self.call(lambda: self._on_prefill(prefill, 0, None, t))

    def layer_written(self, transfer_ids: list[str], layer: int, marker: Any = None) -> None:
        """Layers ``0..layer`` of these started prefills are written (ordered by ``marker``).

        Called on the forward's thread, once per layer. A report that cannot
        start a part (layers are held back or grouped) is queued without
        waking the push thread: a wake-up takes the GIL from the forward's
        launches for a whole engine step. The push thread reads it at its
        next wake-up, which a report that can start a part, the last one, or
        its own timers bring.
        """
        if not 0 <= layer < len(self._layer_ends):
            raise KVPushError(f"layer {layer} outside the layout's {len(self._layer_ends)} layers")
        regions = self._layer_ends[layer]
        t = time.monotonic()
        tids = list(transfer_ids)
        fn = lambda: self._on_layers(tids, regions, marker, t)  # noqa: E731
        if regions < len(self.region_bases) and all(regions < self.rdv.wake_at(tid) for tid in tids):
            self.quiet_reports += 1
            self._inbox.put(fn)
        else:
            self.call(fn)

    def forward_done(self, transfer_ids: list[str], marker: Any = None) -> None:
        """Every layer of these started prefills is written (the end of the forward)."""
        self.layer_written(transfer_ids, len(self._layer_ends) - 1, marker)

    def abort(self, transfer_id: str, reason: str = "aborted on P") -> None:
        self.call(lambda: self._abort(transfer_id, reason))

    def stats(self) -> dict[str, Any]:
        """Counters and rendezvous sizes (read from the engine thread)."""

        def read() -> dict[str, Any]:
            waits = self._waiter.waits if self._waiter is not None else 0
            extra = {"peers": len(self.peers), "marker_waits": waits, "quiet_reports": self.quiet_reports}
            return {**self.counters, **self.rdv.pending(), **extra}

        return self.call_sync(read)

    # -- engine thread ---------------------------------------------------
    def setup(self) -> None:
        self.open_agent("p")
        self.server = Server(self.ctx, self.cfg.side_channel_host, self.cfg.side_channel_port + self.rank)
        self.poller.register(self.server.sock, 1)
        self.address = (self.server.host, self.server.port)
        log.info("%s: side channel on %s:%d", self.name, *self.address)

    def teardown(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        for _, rec in self.rdv.pushing():
            for job in rec.jobs.values():
                for handle in job.flying:
                    self.agent.release(handle)
        self.server.close()
        self.agent.close()

    def step(self, now: float) -> bool:
        for ident, msg in self.server.recv():
            self.peers.on_message(ident, msg, now)
        self._progress()
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            self._apply(self.rdv.expire(now))
            self.peers.check(now)
            self.refresh_gauges()
        return self._busy()

    def refresh_gauges(self) -> None:
        self.gauges = {**self.rdv.pending(), "peers": float(len(self.peers))}

    def _busy(self) -> bool:
        """Busy (short polls) only while WRITEs fly: those need NIXL's progress, which is ours to drive.

        A device marker (a pack, or the KV it waits for) is left to the
        waiter thread, which wakes this one when it is reached; a job waiting
        for layers is woken by ``layer_written``'s call. Polling for either
        from here would take the GIL from the forward's launches (``waiter.py``).
        """
        jobs = [j for _, rec in self.rdv.pushing() for j in rec.jobs.values()]
        if any(j.flying for j in jobs):
            return True
        marker = next((j.watch for j in jobs if j.watch is not None), None)
        if marker is not None:
            if self._waiter is None:
                self._waiter = MarkerWaiter(self.backend.wait_ready, self.wake, self.name)
            self._waiter.watch(marker)
        return False

    # -- events from the caller and from D ---------------------------------------
    def _on_prefill(self, prefill: Prefill, regions: int, ready: Any, t: float) -> None:
        if not regions:
            self.bump(Count.LAYERWISE_PREFILLS)
        decisions = self.rdv.on_prefill(prefill, t)
        self._apply(decisions)  # a re-issued prefill's Release takes the old record's outcome first
        rec = self.rdv.record(prefill.transfer_id)
        if rec is not None and not any(isinstance(d, Release) and d.prefill is prefill for d in decisions):
            rec.reset_readiness(regions, ready)
            if regions:
                rec.times.prefill_done = t
            else:
                rec.times.prefill_start = t

    def _on_layers(self, transfer_ids: list[str], regions: int, marker: Any, t: float) -> None:
        self.bump(Count.LAYER_REPORTS)
        for tid in transfer_ids:
            rec = self.rdv.record(tid)
            reported = rec is not None and rec.report(regions, marker, len(self.region_bases))
            if reported and regions >= len(self.region_bases):
                rec.times.prefill_done = t

    def on_register(self, ident: bytes, reg: protocol.Register, now: float) -> None:
        """A registration from a D rank the peer table accepted."""
        decisions = self.rdv.on_register(reg, now, expected=self.peers.expected(reg))
        rec = self.rdv.record(reg.transfer_id)
        if rec is not None:
            # Its own clock reading: ``now`` is the step's start, which can precede the message's arrival.
            rec.times.first("registered", time.monotonic())
        self._apply(decisions)

    def on_remote_abort(self, msg: protocol.Abort) -> None:
        self._abort(msg.transfer_id, f"aborted by D: {msg.reason}")

    def _abort(self, transfer_id: str, reason: str) -> None:
        self.bump(Count.ABORTS)
        self._apply(self.rdv.cancel(transfer_id, time.monotonic(), Failed(Stage.RENDEZVOUS, Cause.ABORTED, reason)))

    def drop_peer(self, key: DKey, reason: str, now: float) -> None:
        """Forget D rank ``key``: abort what it registered, cancel its pushes, give back their prebuilt WRITEs
        now (they name its NIXL agent, which the peer table unloads next)."""
        decisions = self.rdv.drop_peer(key, now, reason)
        for tid, rec in list(self.rdv.pushing()):
            job = rec.jobs.get(key)
            if job is not None:
                self._drive_safely(tid, rec, job)
        self._apply(decisions)

    def writing_to(self, key: DKey) -> bool:
        """A WRITE into D rank ``key`` is in flight."""
        return any(key in rec.jobs and rec.jobs[key].flying for _, rec in self.rdv.pushing())

    def fail(self, ident: bytes, reg: protocol.Register, failed: Failed) -> None:
        """Tell a D rank that this registration will not (all) be written."""
        self.bump(Count.FAILURES_SENT)
        log.warning(
            "%s: transfer %s from D %s rank %d failed at %s: %s",
            self.name,
            reg.transfer_id,
            reg.engine_id,
            reg.rank,
            failed.stage,
            failed.reason,
        )
        msg = protocol.Failure(
            reg.transfer_id, reg.request_id, self.rank, failed.stage, failed.cause, failed.reason, attempt=reg.attempt
        )
        self.server.send(ident, msg)

    def _apply(self, decisions: list[Decision]) -> None:
        """Carry out the rendezvous' decisions (a ``Push`` starts at the step's end, from the rendezvous)."""
        for d in decisions:
            if isinstance(d, Release):
                self._released(d)
            elif isinstance(d, Refuse):
                if d.cause is Cause.EXPIRED:
                    self.bump(Count.EXPIRED_REGISTRATIONS)
                ident = self.peers.ident_of((d.reg.engine_id, d.reg.rank))
                if ident is not None:
                    self.fail(ident, d.reg, d.failed)
            elif isinstance(d, Hold):
                self.bump(Count.DEFERRED_REGISTRATIONS)

    def _released(self, d: Release) -> None:
        stats, times, failed = d.record.take_outcome() if d.record is not None else (PushStats(), PushTimes(), None)
        times.released = time.monotonic()
        self.bump(Count.RELEASED)
        if d.cause is Cause.EXPIRED:
            self.bump(Count.EXPIRED_PREFILLS)
        why = failed if d.cause is None else Failed(Stage.RENDEZVOUS, d.cause, d.reason)
        p = d.prefill
        if why is None:
            self.emit(Result(p.transfer_id, p.request_id, True, stats=stats, times=times))
        else:
            res = Result(p.transfer_id, p.request_id, False, why.reason, why.cause, why.stage, stats, times)
            self.emit(res)

    # -- pushes ---------------------------------------------------------------
    def _progress(self) -> None:
        """Start the pushes paired in this step, then drive every push job (readiness, packs, WRITEs)."""
        for tid, rec in list(self.rdv.pushing()):
            for push in self.rdv.unstarted(tid):
                self._start_job(tid, rec, push.prefill, push.reg)
            for job in list(rec.jobs.values()):
                self._drive_safely(tid, rec, job)
            rec.refresh_wake_at()

    def _drive_safely(self, tid: str, rec: Transfer, job: PushJob) -> None:
        try:
            self._drive(tid, rec, job)
        except Exception as exc:
            # A bug or a backend failure must end this push (D is told), not wedge the loop.
            log.exception("%s: push %s failed", self.name, tid)
            job.failed(Failed(Stage.POST, Cause.OTHER, f"push failed: {exc}"))
            self._carry_out(tid, rec, job)

    def _drive(self, tid: str, rec: Transfer, job: PushJob) -> None:
        chain = job.plan.chain
        if not chain and not job.stopped:
            while (m := rec.unconfirmed()) is not None and self.backend.poll_ready(m.marker):
                rec.confirm()
        job.ready(*rec.readiness(job.sent, chain), time.monotonic())
        job.check_packs()
        self._carry_out(tid, rec, job)
        for handle in list(job.flying):
            state = self.agent.state(handle)
            if state is not XferState.PROC:
                self.agent.release(handle)
                job.written(handle, state, time.monotonic())
        self._carry_out(tid, rec, job)

    def _carry_out(self, tid: str, rec: Transfer, job: PushJob) -> None:
        """Carry out the job's actions until it has none (each answered before the next)."""
        while (a := job.next_action()) is not None:
            if isinstance(a, StartPack):
                self._start_pack(job, a)
            elif isinstance(a, CheckPack):
                self._check_pack(job, a)
            elif isinstance(a, Post):
                self._post(job, a)
            elif isinstance(a, Notify):
                peer = self.peers.get(job.key)
                if peer is not None:
                    self._tell_posting(job, peer)
            elif isinstance(a, ReleaseMade):
                for handle in a.handles:
                    self.agent.release(handle)
            elif isinstance(a, Fail):
                ident = self.peers.ident_of(job.key)
                if ident is not None:
                    self.fail(ident, job.reg, a.failed)
            elif isinstance(a, Done):
                if job.slot is not None:
                    self._slots.free(job.slot)
                rec.end_job(job, a.failed, time.monotonic())
                self._apply(self.rdv.push_ended(tid, job.key, a.failed))

    def _tell_posting(self, job: PushJob, peer: Any) -> None:
        self.server.send(peer.ident, protocol.Posting(job.reg.transfer_id, self.rank, job.reg.attempt))

    def _start_pack(self, job: PushJob, a: StartPack) -> None:
        """Start packing a part; asynchronous where the backend can, so several parts pack back to back."""
        plan = job.plan.plan
        assert plan.pack is not None and self._staging is not None and job.slot is not None
        t0 = time.monotonic()
        try:
            staging = self._staging.addr + job.slot + a.r0 * plan.region_bytes
            # ``after`` only for backends that chain: others may implement start_pack without it.
            if a.after is not None:
                marker = self.backend.start_pack(self.region_bases[a.r0 : a.r1], plan.pack, staging, after=a.after)
            else:
                marker = self.backend.start_pack(self.region_bases[a.r0 : a.r1], plan.pack, staging)
        except Exception as exc:
            job.failed(Failed(Stage.PACK, Cause.POST_ERROR, f"pack failed: {exc}"))
            return
        job.pack_started(marker, time.monotonic() - t0)

    def _check_pack(self, job: PushJob, a: CheckPack) -> None:
        try:
            if a.block and (a.after is None or self.backend.poll_ready(a.after)):
                self.backend.wait_ready(a.marker)  # our own short kernel, never a layer still computing
                done = True
            else:
                done = self.backend.poll_ready(a.marker)
        except Exception as exc:
            job.failed(Failed(Stage.PACK, Cause.POST_ERROR, f"pack failed: {exc}"))
            return
        if done:
            job.packed()
        else:
            job.pack_pending()

    def _post(self, job: PushJob, a: Post) -> None:
        peer = self.peers.get(job.key)
        t1 = time.monotonic()
        handle, ndesc, state = None, 0, XferState.DONE
        try:
            if peer is None:
                raise KVPushError(f"D {job.key[0]} rank {job.key[1]} is gone")
            if job.plan.kind is PlanKind.EMPTY:
                self.agent.send_notif(peer.agent, self._completion(job, a.r0, a.r1, 0))
            else:
                handle, ndesc = a.made if a.made is not None else self._build_part(job, peer, a.r0, a.r1)
                state = self.agent.post(handle)
        except Exception as exc:
            job.failed(Failed(Stage.POST, Cause.POST_ERROR, f"post failed: {exc}"))
            return
        t2 = time.monotonic()
        if handle is not None:
            self.bump(Count.PARTS)
            self.bump(Count.BYTES, (a.r1 - a.r0) * job.plan.region_bytes)
            self.bump(Count.DESCRIPTORS, ndesc)
            if a.made is not None:
                self.bump(Count.PARTS_PREBUILT)
            if state is not XferState.PROC:
                self.agent.release(handle)
        job.posted(handle, ndesc, state, t1, t2)

    def _start_job(self, tid: str, rec: Transfer, prefill: Prefill, reg: protocol.Register) -> None:
        """Pair made: plan now (often before the KV exists); the job posts parts as regions become ready."""
        t0 = time.monotonic()
        key = (reg.engine_id, reg.rank)
        peer = self.peers.get(key)
        if peer is None:
            gone = Failed(Stage.RENDEZVOUS, Cause.DEAD_PEER, f"D {reg.engine_id} rank {reg.rank} is gone")
            self._apply(self.rdv.push_ended(tid, key, gone))
            return
        try:
            if reg.num_tokens > prefill.num_tokens:
                why = f"D asks for {reg.num_tokens} tokens, P computed {prefill.num_tokens}"
                raise _BadRegistration(why)
            plan, slot = self._plan(prefill, reg, peer)
        except Exception as exc:
            cause = Cause.BAD_REGISTRATION if isinstance(exc, _BadRegistration) else Cause.POST_ERROR
            self.fail(peer.ident, reg, Failed(Stage.PLAN, cause, str(exc)))
            self._apply(self.rdv.push_ended(tid, key, Failed(Stage.PLAN, cause, f"planning failed: {exc}")))
            return
        cfg = self.cfg
        sched = PartSchedule(
            self._layer_ends, plan.region_bytes, cfg.layerwise_min_part_bytes, cfg.layerwise_lead_layers
        )
        chain = plan.kind is PlanKind.STAGED and self.backend.chains_ready
        jp = JobPlan(plan, sched, cfg.push_parts, chain)
        made = self._prepare(jp, prefill, rec, peer, reg, slot) if plan.kind is PlanKind.STAGED else {}
        t_plan = time.monotonic()
        rec.jobs[key] = PushJob(reg, jp, rec.times, t0, t_plan - t0, slot, made)
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
        self.bump(Count.plan(plan.kind))

    def _prepare(
        self, jp: JobPlan, prefill: Prefill, rec: Transfer, peer: Any, reg: protocol.Register, slot: int | None
    ) -> dict[tuple[int, int], tuple[Any, int]]:
        """Hand the backend its piece tables now and, for a push announced ahead (its KV not reported
        yet, so most likely reported whole and cut like this), build the parts' WRITEs; a part cut
        otherwise (layers) is built when posted, unused ones are given back with the job."""
        plan = jp.plan
        assert plan.pack is not None
        ahead = bool(prefill.num_tokens) and not rec.milestones
        cut = split_regions(0, plan.nregions, jp.parts(plan.nregions)) if ahead else []
        parts = []
        if self._staging is not None and slot is not None:
            base = self._staging.addr + slot
            parts = [(r0, r1, base + r0 * plan.region_bytes) for r0, r1 in cut]
        try:
            self.backend.prepare_pack(self.region_bases, plan.pack, parts=parts)
        except Exception:
            log.exception("%s: prepare_pack failed (pack will do it)", self.name)
        made: dict[tuple[int, int], tuple[Any, int]] = {}
        try:
            for r0, r1 in cut:
                made[(r0, r1)] = self._build_part_of(plan, reg, peer, r0, r1)
        except Exception:
            log.exception("%s: building %s's WRITEs ahead failed (built when posted)", self.name, reg.transfer_id)
            for handle, _ in made.values():
                self.agent.release(handle)
            made = {}
        return made

    def _build_part(self, job: PushJob, peer: Any, r0: int, r1: int) -> tuple[Any, int]:
        return self._build_part_of(job.plan.plan, job.reg, peer, r0, r1)

    def _build_part_of(self, plan: Plan, reg: protocol.Register, peer: Any, r0: int, r1: int) -> tuple[Any, int]:
        """The unposted WRITE of regions ``[r0, r1)`` with its completion notification, and its descriptor count."""
        local, remote = part_descriptors(plan, self.layout, peer.layout, r0, r1)
        notif = _completion(plan, reg, self.rank, r0, r1, local.shape[0])
        handle = self.agent.prepare_write(local, str(self.layout.mem), remote, str(peer.layout.mem), peer.agent, notif)
        return handle, local.shape[0]

    def _completion(self, job: PushJob, r0: int, r1: int, ndesc: int) -> bytes:
        return _completion(job.plan.plan, job.reg, self.rank, r0, r1, ndesc)

    def _plan(self, prefill: Prefill, reg: protocol.Register, peer: Any) -> tuple[Plan, int | None]:
        slot = None
        local = remote = None
        if reg.staging is not None and peer.staging is not None and self._staging is not None:
            slot = self._slots.alloc(reg.staging.size)
            if slot is not None:
                local = (self._staging.addr + slot, self._staging.device_id)
                remote = (peer.staging.base + reg.staging.offset, reg.staging.size, peer.staging.device_id)
        plan = build_plan(
            self.cfg,
            self.layout,
            peer.layout,
            prefill.block_ids[0],
            reg.block_ids[0],
            reg.num_tokens,
            reg.start_token,
            staging_local=local,
            staging_remote=remote,
            pack_bw=self.backend.pack_bandwidth(),
        )
        if plan.kind is not PlanKind.STAGED and slot is not None:
            self._slots.free(slot)
            slot = None
        return plan, slot


class _BadRegistration(KVPushError):
    """D asks for what P cannot write (more tokens than the prefill computed)."""


def _completion(plan: Plan, reg: protocol.Register, rank: int, r0: int, r1: int, ndesc: int) -> bytes:
    """The notification that travels with the WRITE of regions ``[r0, r1)``."""
    staged = plan.kind is PlanKind.STAGED
    return protocol.encode(
        protocol.Completion(
            reg.transfer_id,
            reg.request_id,
            rank,
            plan.kind,
            (r1 - r0) * plan.region_bytes,
            ndesc,
            reg.staging if staged else None,
            reg.attempt,
            region_start=r0,
            region_end=r1,
        )
    )
