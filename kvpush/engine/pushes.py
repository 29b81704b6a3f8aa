"""Carrying out P's push jobs: the backend's packs, NIXL's WRITEs, the plan made at pairing.

The sender's engine thread calls ``start_job`` for each push the rendezvous
decided and ``drive`` for each job on every step; the rules of what to do
when are ``kvpush.prefill.push_job.PushJob``'s. Here is only I/O: confirm device
markers, start and check packs, build and post WRITEs, and answer each of the
job's actions with what happened.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, StagingBuffer
from kvpush.backends.copy import Copier
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.errors import KVPushError
from kvpush.core.layout import KVLayout, heads_overlap
from kvpush.core.outcome import Cause, Failed, PlanKind, Stage, XferState
from kvpush.core.parts import PartSchedule, split_regions
from kvpush.core.payload import pack_pieces
from kvpush.core.plan import Plan, build_plan, group_tokens, part_descriptors
from kvpush.core.staging import FreeSlot, SlotAllocator
from kvpush.engine.ports import PeerLookup, PushPort
from kvpush.observability.metrics import Count
from kvpush.prefill.prepack import Prepack, Prepacks, packs_at_hand_over
from kvpush.prefill.push_job import (
    CheckPack,
    Done,
    Fail,
    JobPlan,
    Notify,
    Post,
    Prepacked,
    PushJob,
    ReleaseMade,
    StartPack,
)
from kvpush.prefill.rendezvous import Prefill
from kvpush.prefill.transfer import PackAhead, Transfer
from kvpush.transport.nixl_agent import Agent

log = logging.getLogger(__name__)


@dataclass
class PushRunner:
    """The I/O half of one P rank's push jobs, made with the engine's agent (``Sender.setup``).

    ``layer_ends``: the regions written through each layer; ``staging``, ``slots``: P's staging region and
    its allocator; ``prepacks``: the slots packed at hand-over; ``peers``: the D ranks that said hello;
    ``port``: what the jobs tell the engine.
    """

    name: str
    cfg: Config
    rank: int
    layout: KVLayout
    region_bases: list[int]
    layer_ends: tuple[int, ...]
    backend: Backend
    copy: Copier
    agent: Agent
    staging: StagingBuffer | None
    slots: SlotAllocator
    prepacks: Prepacks
    peers: PeerLookup
    port: PushPort
    last_staging_plan: PlanKind | None = None
    """The kind of the last plan made with a staging slot on both sides (``prepack.packs_at_hand_over``)."""

    def free_slots(self, frees: list[FreeSlot]) -> None:
        """Give staging slots back (packed at hand-over, no longer held)."""
        for f in frees:
            self.slots.free(f.offset)

    def drive(self, tid: str, rec: Transfer, job: PushJob) -> None:
        """Feed the job what happened (readiness, packs, WRITEs) and carry out what it asks for."""
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
                    self.port.tell_posting(job, peer)
            elif isinstance(a, ReleaseMade):
                for handle in a.handles:
                    self.agent.release(handle)
            elif isinstance(a, Fail):
                ident = self.peers.ident_of(job.key)
                if ident is not None:
                    self.port.fail(ident, job.reg, a.failed)
            elif isinstance(a, Done):
                if job.slot is not None:
                    self.slots.free(job.slot)
                rec.end_job(job, a.failed, time.monotonic())
                self.port.push_ended(tid, job.key, a.failed)

    def _start_pack(self, job: PushJob, a: StartPack) -> None:
        """Start packing a part; asynchronous where the backend can, so several parts pack back to back."""
        plan = job.plan.plan
        assert plan.pack is not None and self.staging is not None and job.slot is not None
        t0 = time.monotonic()
        try:
            staging = self.staging.addr + job.slot + a.r0 * plan.region_bytes
            # ``after`` only for backends that chain: others may implement start_pack without it.
            if a.after is not None:
                marker = self.copy.start_pack(self.region_bases[a.r0 : a.r1], plan.pack, staging, after=a.after)
            else:
                marker = self.copy.start_pack(self.region_bases[a.r0 : a.r1], plan.pack, staging)
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
                job.heard(peer.last_seen, time.monotonic())  # a post may return after a freeze
        except Exception as exc:
            job.failed(Failed(Stage.POST, Cause.POST_ERROR, f"post failed: {exc}"))
            return
        t2 = time.monotonic()
        if handle is not None:
            self.port.bump(Count.PARTS)
            self.port.bump(Count.BYTES, job.plan.plan.bytes_of(a.r0, a.r1))
            self.port.bump(Count.DESCRIPTORS, ndesc)
            if a.made is not None:
                self.port.bump(Count.PARTS_PREBUILT)
            if state is not XferState.PROC:
                self.agent.release(handle)
        job.posted(handle, ndesc, state, t1, t2)

    def start_job(self, tid: str, rec: Transfer, prefill: Prefill, reg: protocol.Register) -> None:
        """Pair made: plan now (often before the KV exists); the job posts parts as regions become ready."""
        t0 = time.monotonic()
        key = (reg.engine_id, reg.rank)
        peer = self.peers.get(key)
        if peer is None:
            gone = Failed(Stage.RENDEZVOUS, Cause.DEAD_PEER, f"D {reg.engine_id} rank {reg.rank} is gone")
            self.port.push_ended(tid, key, gone)
            return
        try:
            if reg.num_tokens > prefill.num_tokens:
                why = f"D asks for {reg.num_tokens} tokens, P computed {prefill.num_tokens}"
                raise _BadRegistration(why)
            plan, slot, prepacked = self._plan(prefill, reg, peer, rec)
        except Exception as exc:
            cause = Cause.BAD_REGISTRATION if isinstance(exc, _BadRegistration) else Cause.POST_ERROR
            self.port.fail(peer.ident, reg, Failed(Stage.PLAN, cause, str(exc)))
            self.port.push_ended(tid, key, Failed(Stage.PLAN, cause, f"planning failed: {exc}"))
            return
        cfg = self.cfg
        sched = PartSchedule(
            self.layer_ends,
            plan.region_bytes,
            cfg.per_layer.layerwise_min_part_bytes,
            cfg.per_layer.layerwise_lead_layers,
        )
        chain = plan.kind is PlanKind.STAGED and self.backend.capabilities.chained_ready
        jp = JobPlan(plan, sched, cfg.staging.push_parts, chain)
        made = {}
        if plan.kind is PlanKind.STAGED and prepacked is None:
            made = self._prepare(jp, prefill, rec, peer, reg, slot)
        t_plan = time.monotonic()
        job = PushJob(reg, jp, rec.times, t0, t_plan - t0, slot, made, prepacked, dead_s=cfg.polling.peer_dead_s)
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
        self.port.bump(Count.plan(plan.kind))

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
        lmem, rmem = self.layout.mem, peer.layout.mem
        if plan.kind is PlanKind.STAGED and self.staging is not None:  # staging may live elsewhere than the KV
            lmem, rmem = self.staging.mem, peer.staging_mem
        handle = self.agent.prepare_write(local, str(lmem), remote, str(rmem), peer.agent, notif)
        return handle, local.shape[0]

    def _completion(self, job: PushJob, r0: int, r1: int, ndesc: int) -> bytes:
        return _completion(job.plan.plan, job.reg, self.rank, r0, r1, ndesc)

    def prepare_prefill(self, prefill: Prefill, rec: Transfer, ready: Any = None, parked: bool = False) -> None:
        """Build a prefill's pack list as it is handed over, and give it to the backend (``prepare_pack``).

        The staged payload needs only P's own block ids, so a registration
        that arrives later (behind a sequential router it always does) finds
        its pack list made: P's planning leaves the path from D's
        registration to the first WRITE. Built for the whole prompt and P's
        own heads; a registration asking for fewer gets its list at pairing.
        A finished prefill ``parked`` (no registration waiting) is also packed
        now where that pays whatever D's blocks are (``_pack_at_hand_over``).
        """
        rec.pack_ahead = None
        if (
            self.staging is None
            or self.cfg.staging.plan == "direct"
            or prefill.num_tokens <= 0
            or not prefill.block_ids
        ):
            return
        heads = (self.layout.head_start, self.layout.head_end)
        try:
            blocks = np.asarray(prefill.block_ids[self.layout.token_group], dtype=np.int64)
            pack = pack_pieces(self.layout, heads, blocks, prefill.num_tokens, 0)
        except Exception as exc:  # the registration's planning will say what is wrong
            log.debug("%s: no pack list ahead for %s: %s", self.name, prefill.transfer_id, exc)
            return
        rec.pack_ahead = PackAhead(prefill, heads, prefill.num_tokens, 0, pack, blocks)
        self.port.bump(Count.PACKS_AHEAD)
        try:
            self.copy.prepare_pack(self.region_bases, pack)
        except Exception:
            log.exception("%s: prepare_pack failed (pack will do it)", self.name)
        if parked:
            self._pack_at_hand_over(prefill, rec, rec.pack_ahead, ready)

    def _pack_at_hand_over(self, prefill: Prefill, rec: Transfer, pa: PackAhead, ready: Any) -> None:
        """Pack a finished prefill into a staging slot now, when staging should win (``prepack.packs_at_hand_over``).

        Only when a slot within the parked share (``kvpush.prefill.prepack``) is free
        at once, and the pack can be ordered after the KV: a chaining backend
        queues it behind the ready marker on the device; another packs only
        KV already written (else the push packs at pairing, as without this).
        """
        if not self.cfg.staging.pack_at_hand_over or self.staging is None or self.layout.hybrid:
            return
        bw = self.backend.pack_bandwidth()
        if not packs_at_hand_over(self.cfg, self.layout, pa.blocks, pa.num_tokens, pa.pack, bw, self.last_staging_plan):
            return
        chain = self.backend.capabilities.chained_ready
        if ready is not None and not chain and not self.backend.poll_ready(ready):
            return
        size = int(pa.pack[:, 1].sum()) * len(self.region_bases)
        if not self.prepacks.admits(size) or (slot := self.slots.alloc(size)) is None:
            return
        t0 = time.monotonic()
        try:
            after = ready if chain else None
            marker = self.copy.start_pack(self.region_bases, pa.pack, self.staging.addr + slot, after=after)
        except Exception:
            log.exception("%s: pack at hand-over of %s failed (the push packs)", self.name, prefill.transfer_id)
            self.slots.free(slot)
            return
        self.free_slots(self.prepacks.hold(prefill.transfer_id, Prepack(slot, size, pa.pack, after, marker)))
        self.port.bump(Count.PACKS_AT_HAND_OVER)
        rec.times.first("ready", t0)
        if marker is None:
            rec.times.first("packed", time.monotonic())

    def _plan(
        self, prefill: Prefill, reg: protocol.Register, peer: Any, rec: Transfer
    ) -> tuple[Plan, int | None, Prepacked | None]:
        """The plan, its P slot and, when it takes the slot packed at hand-over, that pack (``Prepacked``).

        A packed slot the plan does not take (a direct plan, another list) is
        dropped: freed, or set aside until its pack ends."""
        tid = prefill.transfer_id
        slot = None
        local = remote = None
        ahead = self._pack_ahead(prefill, reg, peer, rec)
        held = self.prepacks.get(tid)
        staging = reg.staging is not None and peer.staging is not None and self.staging is not None
        if held is not None and not (staging and ahead is held.pack and held.size <= reg.staging.size):
            self.free_slots(self.prepacks.drop(tid))  # packed for a push this is not
            held = None
        if staging:
            slot = held.slot if held is not None else self._alloc(reg.staging.size)
            if slot is not None:
                local = (self.staging.addr + slot, self.staging.device_id)
                remote = (peer.staging.base + reg.staging.offset, reg.staging.size, peer.staging.device_id)
        src_blocks = prefill.block_ids[self.layout.token_group]
        if ahead is not None and rec.pack_ahead is not None and rec.pack_ahead.blocks is not None:
            src_blocks = rec.pack_ahead.blocks
        plan = build_plan(
            self.cfg,
            self.layout,
            peer.layout,
            src_blocks,
            reg.block_ids[peer.layout.token_group],
            reg.num_tokens,
            reg.start_token,
            staging_local=local,
            staging_remote=remote,
            pack_bw=self.backend.pack_bandwidth(),
            groups=group_tokens(prefill.block_ids, peer.layout, reg.block_ids, reg.start_token, reg.skip_blocks),
            pack=ahead,
        )
        if local is not None:
            self.last_staging_plan = plan.kind  # what the next parked prefill's pack at hand-over goes by
        took = self.prepacks.claim(tid, plan.pack) if plan.kind is PlanKind.STAGED else None
        if held is not None and took is None:
            slot = None  # the plan did not take the packed slot: it stays the prefill's until dropped here
            self.free_slots(self.prepacks.drop(tid))
        if plan.kind is not PlanKind.STAGED and slot is not None:
            self.slots.free(slot)
            slot = None
        if plan.kind is PlanKind.STAGED and ahead is not None:
            self.port.bump(Count.PACKS_AHEAD_USED)
        if took is None:
            return plan, slot, None
        self.port.bump(Count.PACKS_AT_HAND_OVER_USED)
        return plan, slot, Prepacked(took.marker if not took.reached else None, took.after)

    def _alloc(self, size: int) -> int | None:
        """A slot for a push whose D registered: parked prefills' packed slots are taken back, the oldest
        first, before it goes without (``kvpush.prefill.prepack``)."""
        while (slot := self.slots.alloc(size)) is None and size <= self.slots.capacity:
            victim = self.prepacks.evictable()
            if victim is None:
                return None
            self.free_slots(self.prepacks.drop(victim))
            self.port.bump(Count.PACKS_AT_HAND_OVER_EVICTED)
        return slot

    def _pack_ahead(self, prefill: Prefill, reg: protocol.Register, peer: Any, rec: Transfer) -> Any:
        if rec.pack_ahead is None:
            return None
        return rec.pack_ahead.fits(prefill, heads_overlap(self.layout, peer.layout), reg.num_tokens, reg.start_token)


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
            plan.bytes_of(r0, r1),
            ndesc,
            reg.staging if staged else None,
            reg.attempt,
            region_start=r0,
            region_end=r1,
        )
    )
