"""P side: pair registrations with prefills and push the KV.

Runs entirely on its own thread: the engine hands over a finished prefill
with ``prefill_finished`` (whole-request push) or announces it with
``prefill_started`` and then reports layers as they are written with
``kv_ready`` (layer-wise push), and later learns from ``poll`` which
requests' blocks it may free. Nothing here blocks the caller.

A push to one D rank is a *job*: planned once when the registration meets
the prefill (for a layer-wise push that is before the KV exists, so planning
is off the critical path), then posted in parts, each a WRITE of a range of
regions with its own completion, as those regions become ready.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvpush import protocol
from kvpush.backends.base import Backend
from kvpush.config import Config
from kvpush.engine.loop import EngineLoop
from kvpush.engine.types import Result
from kvpush.engine.waiter import MarkerWaiter
from kvpush.errors import KVPushError, LayoutError
from kvpush.layout import KVLayout, check_compatible
from kvpush.plan import (
    Plan,
    build_plan,
    next_part_at,
    part_count,
    part_descriptors,
    ready_part_end,
    split_regions,
)
from kvpush.rendezvous import Decision, Prefill, Push, Refuse, Release, Rendezvous
from kvpush.topology import targets_for
from kvpush.transport.side_channel import Server

log = logging.getLogger(__name__)

TIMER_PERIOD_S = 0.05


@dataclass
class _Peer:
    """A D rank that said hello."""

    ident: bytes
    engine_id: str
    rank: int
    tp_size: int
    agent: str
    layout: KVLayout
    staging: Any
    last_seen: float


@dataclass
class _Job:
    """The push of one transfer to one D rank, from pairing until its last part completes."""

    reg: protocol.Register
    prefill: Prefill
    peer_key: tuple[str, int]
    t_start: float
    plan: Plan | None = None
    slot: int | None = None
    sent: int = 0  # regions [0, sent) are posted or being packed
    posted: int = 0  # how many regions are posted (a cancel may drop packed parts)
    packing: list[tuple[int, int, Any, Any]] = field(default_factory=list)  # (r0, r1, pack marker, KV marker)
    flying: list[Any] = field(default_factory=list)  # NIXL handles of posted parts not yet done
    made: dict[tuple[int, int], tuple[Any, int]] = field(default_factory=dict)  # (r0, r1) -> unposted WRITE, descs
    waiting: Any = None  # the marker of regions reported ready, not reached yet (backends that do not chain)
    step: int = 0  # regions the latest layer report added (the forward's reports are alike)
    told: bool = False  # D was told that this push starts (``Posting``)
    error: str = ""
    error_stage: str = ""
    cancel: str = ""
    t_post: float = 0.0
    t_complete: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


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
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._waiter: MarkerWaiter | None = None  # created at the first device marker to wait for
        # transfer id -> the fewest ready regions that can start its next part (replaced, never mutated:
        # ``kv_ready`` reads it on the forward's thread); absent: any report wakes the push thread.
        self._wake_at: dict[str, int] = {}
        self.quiet_reports = 0  # kv_ready calls that did not wake the push thread (written by the caller)
        # transfer id -> milestones (regions [0, n) written, marker ordering them), ascending: the
        # forward is issued ahead of the device, so several layers are reported before the first is
        # done, and each layer is pushed as soon as *its* marker is reached.
        self._ready: dict[str, list[tuple[int, Any]]] = {}
        self._queued_pushes: list[Push] = []
        self._jobs: list[_Job] = []
        # A re-issued registration whose earlier attempt is being written now:
        # it waits here until that WRITE ends, then is paired again.
        self._deferred: dict[tuple[str, str, int], protocol.Register] = {}
        self._errors: dict[str, str] = {}  # transfer id -> why one of its pushes failed
        self._tstats: dict[str, dict[str, float]] = {}  # transfer id -> push timings, for its Result
        self._times: dict[str, dict[str, float]] = {}  # transfer id -> when each stage happened (monotonic)
        self._next_timer = 0.0
        self.counters: dict[str, float] = {}
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
        """Hand over a finished prefill; its blocks stay untouched until ``poll`` returns it."""
        prefill = Prefill(transfer_id, request_id, tuple(tuple(int(b) for b in g) for g in block_ids), num_tokens)
        t_done = time.monotonic()  # the caller's moment, not when the engine thread gets to it
        self.call(lambda: self._on_prefill(prefill, ready, t_done))

    def prefill_started(
        self,
        transfer_id: str,
        request_id: str,
        block_ids: list[list[int]] | tuple[tuple[int, ...], ...],
        num_tokens: int,
    ) -> None:
        """Announce a prefill whose KV will be reported by ``kv_ready`` (layer-wise push).

        Its blocks must stay untouched until ``poll`` returns it, even if it is
        aborted: a layer may be being written to D.
        """
        prefill = Prefill(transfer_id, request_id, tuple(tuple(int(b) for b in g) for g in block_ids), num_tokens)
        self.call(lambda: self._on_prefill(prefill, None, None, ready_regions=0))

    def kv_ready(self, transfer_ids: list[str], regions: int, marker: Any = None) -> None:
        """Regions ``[0, regions)`` of these started prefills are written (ordered by ``marker``).

        Called on the forward's thread, once per layer. A report that cannot
        start a part (layers are grouped) is queued without waking the push
        thread: a wake-up takes the GIL from the forward's launches for a
        whole engine step (on H200, 64 wake-ups slowed a 2k-token forward by
        ~8 ms). The push thread reads it at its next wake-up, which a report
        that can start a part, the last one, or its own timers bring.
        """
        t = time.monotonic()
        tids = list(transfer_ids)
        fn = lambda: self._on_kv_ready(tids, regions, marker, t)  # noqa: E731
        wake_at = self._wake_at
        if regions < len(self.region_bases) and all(regions < wake_at.get(tid, 0) for tid in tids):
            self.quiet_reports += 1
            self._inbox.put(fn)
        else:
            self.call(fn)

    def abort(self, transfer_id: str, reason: str = "aborted on P") -> None:
        self.call(lambda: self._on_local_abort(transfer_id, reason))

    def stats(self) -> dict[str, Any]:
        """Counters and rendezvous sizes (read from the engine thread)."""

        def read() -> dict[str, Any]:
            waits = self._waiter.waits if self._waiter is not None else 0
            extra = {"peers": len(self._peers), "marker_waits": waits, "quiet_reports": self.quiet_reports}
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
        for job in self._jobs:
            for handle in job.flying:
                self.agent.release(handle)
        self.server.close()
        self.agent.close()

    def _bump(self, key: str, by: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + by

    def step(self, now: float) -> bool:
        for ident, msg in self.server.recv():
            self._on_message(ident, msg, now)
        while self._queued_pushes:
            batch, self._queued_pushes = self._queued_pushes, []
            for push in batch:
                self._start_job(push.prefill, push.reg)
        self._progress()
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            self._apply(self.rdv.expire(now))
            self._check_peers(now)
            self.refresh_gauges()
            if len(self._times) > len(self.rdv):
                self._prune_times()
        return self._busy()

    def _busy(self) -> bool:
        """Busy (short polls) only while WRITEs fly: those need NIXL's progress, which is ours to drive.

        A device marker (a pack, or the KV it waits for) is left to the
        waiter thread, which wakes this one when it is reached; a job waiting
        for layers is woken by ``kv_ready``'s call. Polling for either from
        here would take the GIL from the forward's launches (``waiter.py``).
        """
        if any(j.flying for j in self._jobs):
            return True
        for j in self._jobs:
            marker = j.packing[0][2] if j.packing else j.waiting
            if marker is not None:
                if self._waiter is None:
                    self._waiter = MarkerWaiter(
                        self.backend.wait_ready, self.wake, self.name, bind=self.backend.bind_thread
                    )
                self._waiter.watch(marker)
                return False
        return False

    def _on_message(self, ident: bytes, msg: Any, now: float) -> None:
        if isinstance(msg, protocol.Hello):
            self._on_hello(ident, msg, now)
            return
        if isinstance(msg, protocol.TimeQuery):
            # Anyone may ask the time (``kvpush doctor --peer``): it reveals nothing else.
            self.server.send(ident, protocol.TimeReply(msg.seq, msg.sent_at, time.time()))
            return
        peer = self._peer_by_ident(ident)
        if peer is not None:
            peer.last_seen = now
        if isinstance(msg, protocol.Heartbeat):
            # Only known peers get an answer: a D rank whose hello this P never
            # saw (P restarted) then sees P fall silent and says hello again.
            if peer is not None:
                self.server.send(ident, protocol.Heartbeat(self.engine_id, self.rank, msg.seq, time.time()))
        elif isinstance(msg, protocol.Register):
            self._on_register(ident, peer, msg, now)
        elif isinstance(msg, protocol.Abort):
            self._on_remote_abort(msg, now)
        else:
            log.warning("%s: unexpected %s on the side channel", self.name, type(msg).__name__)

    def _peer_by_ident(self, ident: bytes) -> _Peer | None:
        for p in self._peers.values():
            if p.ident == ident:
                return p
        return None

    def _on_hello(self, ident: bytes, msg: protocol.Hello, now: float) -> None:
        reason = ""
        if self.cfg.model and msg.model and msg.model != self.cfg.model:
            reason = f"model differs: P serves {self.cfg.model!r}, D serves {msg.model!r}"
        else:
            try:
                check_compatible(self.layout, msg.layout)
                msg.layout.validate()
            except LayoutError as exc:
                reason = str(exc)
        if reason:
            log.warning("%s: refused D %s rank %d: %s", self.name, msg.engine_id, msg.rank, reason)
            self.server.send(ident, protocol.HelloReply(ok=False, reason=reason))
            return
        key = (msg.engine_id, msg.rank)
        if key in self._peers:
            # The same D rank says hello again: it restarted (or declared this P
            # dead and came back). Its old registrations point into memory of a
            # previous session, and NIXL refuses to load an agent name twice.
            if any(j.peer_key == key and j.flying for j in self._jobs):
                reason = "an earlier session of this D rank still has WRITEs in flight; say hello again shortly"
                self.server.send(ident, protocol.HelloReply(ok=False, reason=reason))
                return
            self._drop_peer(key, "said hello again (restarted?)", now)
            self._progress()  # jobs to the old session end now, before it is known again
        try:
            agent_name = self.agent.add_peer(msg.agent_metadata)
        except Exception as exc:
            reason = f"cannot load D's NIXL metadata: {exc}"
            self.server.send(ident, protocol.HelloReply(ok=False, reason=reason))
            return
        self._peers[(msg.engine_id, msg.rank)] = _Peer(
            ident, msg.engine_id, msg.rank, msg.tp_size, agent_name, msg.layout, msg.staging, now
        )
        self.server.send(
            ident,
            protocol.HelloReply(
                ok=True,
                engine_id=self.engine_id,
                rank=self.rank,
                tp_size=self.tp_size,
                agent_name=self.agent.name,
                agent_metadata=self.agent.metadata(),
                layout=self.layout,
            ),
        )

    def _on_register(self, ident: bytes, peer: _Peer | None, reg: protocol.Register, now: float) -> None:
        self._bump("registrations_total")
        if peer is None or (peer.engine_id, peer.rank) != (reg.engine_id, reg.rank):
            self._fail(ident, reg, "register", "registration before a successful hello from this D rank")
            return
        problem = self._check_register(peer, reg)
        if problem:
            self._fail(ident, reg, "register", problem)
            return
        prev = next(
            (
                (r, flying)
                for r, flying in self.rdv.registrations(reg.transfer_id)
                if (r.engine_id, r.rank) == (reg.engine_id, reg.rank) and r.attempt != reg.attempt
            ),
            None,
        )
        if prev is not None and prev[1]:
            # D re-allocated while P writes the previous attempt's blocks. That
            # WRITE cannot be recalled, so the new attempt waits for it and is
            # pushed next; D learns the old blocks are fenced from that WRITE's
            # own completion, never earlier.
            older = self._deferred.get((reg.transfer_id, reg.engine_id, reg.rank))
            if older is not None:
                self._fail(ident, older, "superseded", f"replaced by attempt {reg.attempt}")
            self._deferred[(reg.transfer_id, reg.engine_id, reg.rank)] = reg
            self._bump("deferred_registrations_total")
            return
        # Its own clock reading: ``now`` is the step's start, which can precede the message's arrival.
        self._times.setdefault(reg.transfer_id, {}).setdefault("registered", time.monotonic())
        decisions = self.rdv.on_register(reg, now, expected=self._expected(peer))
        if prev is not None:
            # The rendezvous replaced the earlier attempt, which will never be
            # written: tell D so it can reuse those blocks now.
            self._fail(ident, prev[0], "superseded", f"replaced by attempt {reg.attempt}")
        self._apply(decisions)

    def _expected(self, peer: _Peer) -> int:
        """How many D ranks of ``peer``'s instance this P rank writes to."""
        return max(1, len(targets_for(self.rank, self.tp_size, peer.tp_size, self.layout.num_heads)))

    def _check_register(self, peer: _Peer, reg: protocol.Register) -> str:
        groups = 1 + max(r.group for r in self.layout.regions)
        if len(reg.block_ids) != groups:
            return f"registration has {len(reg.block_ids)} block groups, layout has {groups}"
        need = -(-reg.num_tokens // peer.layout.block_size)
        for g, ids in enumerate(reg.block_ids):
            if len(ids) < need:
                return f"group {g} has {len(ids)} blocks, {need} needed for {reg.num_tokens} tokens"
            if ids and max(ids[:need], default=0) >= peer.layout.num_blocks:
                return f"group {g} block id {max(ids[:need])} out of range (D has {peer.layout.num_blocks} blocks)"
        if reg.staging is not None:
            cap = peer.staging.size if peer.staging is not None else 0
            if reg.staging.offset + reg.staging.size > cap:
                grant = f"[{reg.staging.offset}, +{reg.staging.size})"
                return f"staging grant {grant} outside D's staging region ({cap} bytes)"
        return ""

    def _fail(self, ident: bytes, reg: protocol.Register, stage: str, reason: str) -> None:
        self._bump("failures_total")
        self._bump(f"refused_{stage}_total")
        log.warning(
            "%s: transfer %s from D %s rank %d failed at %s: %s",
            self.name,
            reg.transfer_id,
            reg.engine_id,
            reg.rank,
            stage,
            reason,
        )
        self.server.send(
            ident,
            protocol.Failure(reg.transfer_id, reg.request_id, self.rank, stage, reason, attempt=reg.attempt),
        )

    def _on_prefill(
        self, prefill: Prefill, ready: Any, t_done: float | None = None, ready_regions: int | None = None
    ) -> None:
        now = time.monotonic()
        n = len(self.layout.regions) if ready_regions is None else ready_regions
        tt = self._times.setdefault(prefill.transfer_id, {})
        if n == len(self.layout.regions):
            tt["prefill_done"] = now if t_done is None else t_done
        else:
            tt["prefill_start"] = now
            self._bump("layerwise_prefills_total")
        decisions = self.rdv.on_prefill(prefill, now)
        if not any(isinstance(d, Release) and d.prefill is prefill for d in decisions):
            # A re-issued prefill replaces the old one's readiness (its blocks are new).
            self._ready[prefill.transfer_id] = [(n, ready)] if n else []
        self._apply(decisions)

    def _on_kv_ready(self, transfer_ids: list[str], regions: int, marker: Any, t: float) -> None:
        n = len(self.layout.regions)
        self._bump("layer_reports_total")
        for tid in transfer_ids:
            milestones = self._ready.get(tid)
            if milestones is None or (milestones and milestones[-1][0] >= regions):
                continue  # unknown, already released, or a stale report
            milestones.append((min(regions, n), marker))
            if regions >= n:
                self._times.setdefault(tid, {})["prefill_done"] = t

    def _on_remote_abort(self, msg: protocol.Abort, now: float) -> None:
        self._bump("aborts_total")
        self._abort(msg.transfer_id, f"aborted by D: {msg.reason}", now)

    def _on_local_abort(self, transfer_id: str, reason: str) -> None:
        self._bump("aborts_total")
        self._abort(transfer_id, reason, time.monotonic())

    def _abort(self, transfer_id: str, reason: str, now: float) -> None:
        # Registrations not being written get an explicit answer so D can free
        # its blocks; those in flight answer with their completion.
        cancelled = [p for p in self._queued_pushes if p.reg.transfer_id == transfer_id]
        self._queued_pushes = [p for p in self._queued_pushes if p.reg.transfer_id != transfer_id]
        for push in cancelled:
            peer = self._peers.get((push.reg.engine_id, push.reg.rank))
            if peer is not None:
                self._fail(peer.ident, push.reg, "aborted", reason)
        for key in [k for k in self._deferred if k[0] == transfer_id]:
            reg = self._deferred.pop(key)
            peer = self._peers.get((reg.engine_id, reg.rank))
            if peer is not None:
                self.server.send(
                    peer.ident,
                    protocol.Failure(reg.transfer_id, reg.request_id, self.rank, "aborted", reason, reg.attempt),
                )
        for job in self._jobs:
            if job.reg.transfer_id == transfer_id and not job.cancel:
                job.cancel = reason
        for reg, flying in self.rdv.registrations(transfer_id):
            if not flying:
                peer = self._peers.get((reg.engine_id, reg.rank))
                if peer is not None:
                    self.server.send(
                        peer.ident,
                        protocol.Failure(reg.transfer_id, reg.request_id, self.rank, "aborted", reason, reg.attempt),
                    )
        self._apply(self.rdv.on_abort(transfer_id, now, reason))
        for push in cancelled:
            self._apply(self.rdv.on_pushed(transfer_id, push.reg.engine_id, push.reg.rank))

    def _check_peers(self, now: float) -> None:
        for key, peer in list(self._peers.items()):
            if now - peer.last_seen > self.cfg.peer_dead_s:
                self._bump("dead_peers_total")
                self._drop_peer(key, f"silent for {now - peer.last_seen:.1f}s: declared dead", now)

    def _drop_peer(self, key: tuple[str, int], why: str, now: float) -> None:
        """Forget a D rank: abort the transfers it registered for and unload its NIXL agent."""
        peer = self._peers.pop(key)
        log.warning("%s: D %s rank %d %s", self.name, key[0], key[1], why)
        for dk in [dk for dk in self._deferred if dk[1:] == key]:
            del self._deferred[dk]
        for job in self._jobs:
            if job.peer_key == key:
                self._release_made(job)  # before the agent goes: they name it
                if not job.cancel:
                    job.cancel = f"D {key[0]} rank {key[1]} {why}"
        for tid in self.rdv.transfers_of(peer.engine_id):
            if any((r.engine_id, r.rank) == key for r, _ in self.rdv.registrations(tid)):
                self._apply(self.rdv.on_abort(tid, now, f"D {key[0]} rank {key[1]} {why}"))
        if not any(p.agent == peer.agent for p in self._peers.values()):
            self.agent.remove_peer(peer.agent)

    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Push):
                # Posted at the end of the step, after every message read in
                # it: an Abort that arrived with the Register cancels the push.
                self._queued_pushes.append(d)
            elif isinstance(d, Release):
                if self.rdv.stage(d.prefill.transfer_id) is None:
                    self._ready.pop(d.prefill.transfer_id, None)
                # "pushed" means every expected push ended, not that each succeeded.
                err = self._errors.pop(d.prefill.transfer_id, "")
                ok = d.reason == "pushed" and not err
                self._bump("released_total")
                if d.reason.startswith("lease expired"):
                    self._bump("expired_prefills_total")
                why = "" if ok else (err if d.reason == "pushed" else d.reason)
                stats = self._tstats.pop(d.prefill.transfer_id, {})
                times = self._times.pop(d.prefill.transfer_id, {})
                times["released"] = time.monotonic()
                self.emit(Result(d.prefill.transfer_id, d.prefill.request_id, ok, why, stats, times))
            elif isinstance(d, Refuse):
                if "expired" in d.reason:
                    self._bump("expired_registrations_total")
                peer = self._peers.get((d.reg.engine_id, d.reg.rank))
                if peer is not None:
                    self._fail(peer.ident, d.reg, "rendezvous", d.reason)

    # -- pushes ---------------------------------------------------------------
    def _start_job(self, prefill: Prefill, reg: protocol.Register) -> None:
        """Pair made: plan now (often before the KV exists), post parts as regions become ready."""
        t0 = time.perf_counter()
        peer = self._peers.get((reg.engine_id, reg.rank))
        if peer is None:
            self._errors[reg.transfer_id] = f"D {reg.engine_id} rank {reg.rank} is gone"
            self._pushed(reg)
            return
        job = _Job(reg, prefill, (reg.engine_id, reg.rank), t0)
        try:
            if reg.num_tokens > prefill.num_tokens:
                raise KVPushError(f"D asks for {reg.num_tokens} tokens, P computed {prefill.num_tokens}")
            job.plan, job.slot = self._plan(prefill, reg, peer)
        except Exception as exc:
            self._errors[reg.transfer_id] = f"planning failed: {exc}"
            self._fail(peer.ident, reg, "post", str(exc))
            self._pushed(reg)
            return
        if job.plan.kind == "staged" and job.plan.pack is not None:
            # Announced ahead (the KV is not ready yet): the push will most likely be cut like this.
            ahead = bool(prefill.num_tokens) and not self._ready.get(reg.transfer_id)
            cut = split_regions(0, job.plan.nregions, self._parts(job.plan, job.plan.nregions)) if ahead else []
            parts = []
            if self._staging is not None and job.slot is not None:
                base = self._staging.addr + job.slot
                parts = [(r0, r1, base + r0 * job.plan.region_bytes) for r0, r1 in cut]
            try:
                self.copy.prepare_pack(self.region_bases, job.plan.pack, parts=parts)
            except Exception:
                log.exception("%s: prepare_pack failed (pack will do it)", self.name)
            self._make_parts(job, peer, cut)
        t_plan = time.perf_counter()
        job.stats["plan_s"] = t_plan - t0
        tt = self._times.setdefault(reg.transfer_id, {})
        tt["push_start"] = min(tt.get("push_start", t0), t0)
        tt.setdefault("planned", t_plan)
        plan = job.plan
        log.debug(
            "%s: push %s -> %s/%d plan=%s bytes=%d pieces=%d descs<=%d est=%s",
            self.name,
            reg.transfer_id,
            reg.engine_id,
            reg.rank,
            plan.kind,
            plan.nbytes,
            plan.pieces,
            plan.descriptors,
            plan.estimate,
        )
        self._bump(f"plan_{plan.kind}_total")
        self._jobs.append(job)

    def _advance(self, job: _Job) -> bool:
        """Post what became ready, reap finished parts; True when the job is over."""
        plan, peer = job.plan, self._peers.get(job.peer_key)
        assert plan is not None
        if peer is None and not job.cancel:
            job.cancel = f"D {job.peer_key[0]} rank {job.peer_key[1]} is gone"
        if plan.kind == "empty" and job.sent == 0 and not (job.cancel or job.error):
            assert peer is not None
            self._tell_posting(job, peer)
            try:
                self.agent.send_notif(peer.agent, self._completion(job, 0, plan.nregions, 0))
            except Exception as exc:
                job.error, job.error_stage = f"post failed: {exc}", "post"
            job.sent = job.posted = plan.nregions
        ready, job.waiting, after = job.sent, None, None
        # A staged push on a backend that chains: the packs are queued behind the KV's marker on the
        # device as soon as the regions are reported, instead of after this thread sees the marker.
        chain = plan.kind == "staged" and self.backend.capabilities.chained_ready
        last = step = 0  # step: regions added by the report that ``ready`` comes from
        if not (job.cancel or job.error):
            for regions, marker in self._ready.get(job.reg.transfer_id, ()):
                if regions > job.sent:
                    if chain:
                        after = marker if marker is not None else after
                    elif not self.backend.poll_ready(marker):
                        job.waiting = marker
                        break
                    ready, step = regions, regions - last
                last = regions
        job.step = step or job.step
        cfg = self.cfg
        ready = ready_part_end(
            job.sent,
            ready,
            step,
            plan.nregions,
            plan.region_bytes,
            cfg.layerwise_min_part_bytes,
            cfg.layerwise_lead_layers,
        )
        if ready > job.sent:
            assert peer is not None
            tt = self._times.setdefault(job.reg.transfer_id, {})
            t_ready = time.perf_counter()
            tt.setdefault("ready", t_ready)
            if "wait_ready_s" not in job.stats:
                # Planned at pairing; this is how long the KV took after that (layer-wise: the forward).
                job.stats["wait_ready_s"] = max(0.0, t_ready - job.t_start - job.stats.get("plan_s", 0.0))
            for r0, r1 in split_regions(job.sent, ready, self._parts(plan, ready - job.sent)):
                if not self._start_part(job, peer, r0, r1, after):
                    break
                # One pack ahead: part k is posted while part k+1 packs (a launch costs ~0.05-0.1 ms of
                # host time, which would otherwise delay the first WRITE by one launch per part). Waiting
                # for the first part's pack before launching the second was slower on H200 (the GPU
                # idles while the thread posts and launches).
                self._post_packed(job, peer, keep=1)
        self._post_packed(job, peer)
        job.flying = [h for h in job.flying if not self._part_ended(job, h, self.agent.state(h))]
        return not job.flying and not job.packing and (job.posted == plan.nregions or bool(job.cancel or job.error))

    def _parts(self, plan: Plan, nregions: int) -> int:
        """How many WRITEs a run of ready regions is cut into (``push_parts``, see ``plan.part_count``)."""
        if plan.kind != "staged":
            return 1
        return part_count(self.cfg.push_parts, nregions * plan.region_bytes)

    def _part_ended(self, job: _Job, handle: Any, state: str) -> bool:
        """Release a part's handle once NIXL says it is over; a failed WRITE ends the job."""
        if state == "PROC":
            return False
        self.agent.release(handle)
        job.t_complete = time.perf_counter()
        if state != "DONE":
            job.error, job.error_stage = f"WRITE to D {job.peer_key[0]} rank {job.peer_key[1]} failed", "write"
        return True

    def _completion(self, job: _Job, r0: int, r1: int, ndesc: int) -> bytes:
        plan = job.plan
        assert plan is not None
        staged = plan.kind == "staged"
        return protocol.encode(
            protocol.Completion(
                job.reg.transfer_id,
                job.reg.request_id,
                self.rank,
                plan.kind,
                (r1 - r0) * plan.region_bytes,
                ndesc,
                job.reg.staging if staged else None,
                job.reg.attempt,
                region_start=r0,
                region_end=r1,
            )
        )

    def _start_part(self, job: _Job, peer: _Peer, r0: int, r1: int, after: Any = None) -> bool:
        """Post regions ``[r0, r1)``, or for a staged plan start packing them (posted once packed).

        The pack is asynchronous where the backend can (``start_pack``), so
        several parts are packed back to back on the device while this thread
        keeps completing the parts already posted.
        """
        plan = job.plan
        assert plan is not None
        job.sent = r1
        if plan.kind != "staged":
            job.stats.setdefault("pack_s", 0.0)  # a direct push has a pack stage of zero, as metrics expect
            self._tell_posting(job, peer)
            return self._post_part(job, peer, r0, r1)
        assert plan.pack is not None and self._staging is not None and job.slot is not None
        t0 = time.perf_counter()
        try:
            staging = self._staging.addr + job.slot + r0 * plan.region_bytes
            # ``after`` only for backends that chain: others may implement start_pack without it.
            if after is not None:
                marker = self.copy.start_pack(self.region_bases[r0:r1], plan.pack, staging, after=after)
            else:
                marker = self.copy.start_pack(self.region_bases[r0:r1], plan.pack, staging)
        except Exception as exc:
            job.error, job.error_stage = f"pack failed: {exc}", "post"
            return False
        job.stats["pack_s"] = job.stats.get("pack_s", 0.0) + time.perf_counter() - t0
        job.packing.append((r0, r1, marker, after))
        self._tell_posting(job, peer)  # after the pack's launch: the message is sent while the device packs
        return True

    def _tell_posting(self, job: _Job, peer: _Peer) -> None:
        """Once per push, before its first part: D polls busily only for transfers it was told of."""
        if not job.told:
            job.told = True
            self.server.send(peer.ident, protocol.Posting(job.reg.transfer_id, self.rank, job.reg.attempt))

    def _post_packed(self, job: _Job, peer: _Peer | None, keep: int = 0) -> None:
        """Post the packed parts whose pack is done, in order, all but the last ``keep``; on cancel drop them.

        Once every region of the job is packing (the KV is complete: the tail
        of the push), the thread *waits* for each pack instead of polling it:
        packs are short kernels of ours, and a poll's sleep would add up to
        ~0.06 ms to the critical path per part. Before that (layers still
        computing) it polls, so a pack slowed by the forward blocks nothing.
        """
        assert job.plan is not None
        block = job.sent == job.plan.nregions and not (job.cancel or job.error)
        while len(job.packing) > keep:
            r0, r1, marker, after = job.packing[0]
            try:
                # Waiting is for our own short kernel only, never for a layer still computing.
                if block and (after is None or self.backend.poll_ready(after)):
                    self.backend.wait_ready(marker)
                    done = True
                else:
                    done = self.backend.poll_ready(marker)
            except Exception as exc:
                job.error, job.error_stage, done = f"pack failed: {exc}", "post", True
            if not done:
                return
            job.packing.pop(0)
            if job.cancel or job.error or peer is None:
                continue  # nothing more is posted; the pack had to end before P's blocks go back
            self._post_part(job, peer, r0, r1)  # it stamps "packed"

    def _make_parts(self, job: _Job, peer: _Peer, cut: list[tuple[int, int]]) -> None:
        """Build the WRITEs of the parts ``cut`` that a push whose KV is not ready yet will most likely post.

        A prefill announced ahead (``prefill_started``) is usually reported
        ready all at once (whole-request) and then cut like this; a part that
        comes out otherwise (layers) is built when posted, and unused ones are
        released with the job.
        """
        try:
            for r0, r1 in cut:
                job.made[(r0, r1)] = self._build_part(job, peer, r0, r1)
        except Exception:
            log.exception("%s: building %s's WRITEs ahead failed (built when posted)", self.name, job.reg.transfer_id)
            self._release_made(job)

    def _build_part(self, job: _Job, peer: _Peer, r0: int, r1: int) -> tuple[Any, int]:
        """The unposted WRITE of regions ``[r0, r1)`` with its completion notification, and its descriptor count."""
        plan = job.plan
        assert plan is not None
        local, remote = part_descriptors(plan, self.layout, peer.layout, r0, r1)
        notif = self._completion(job, r0, r1, local.shape[0])
        handle = self.agent.prepare_write(local, str(self.layout.mem), remote, str(peer.layout.mem), peer.agent, notif)
        return handle, local.shape[0]

    def _release_made(self, job: _Job) -> None:
        for handle, _ in job.made.values():
            self.agent.release(handle)
        job.made.clear()

    def _post_part(self, job: _Job, peer: _Peer, r0: int, r1: int) -> bool:
        plan = job.plan
        assert plan is not None
        t1 = time.perf_counter()
        try:
            made = job.made.pop((r0, r1), None)
            handle, ndesc = made if made is not None else self._build_part(job, peer, r0, r1)
            state = self.agent.post(handle)
            if made is not None:
                self._bump("parts_prebuilt_total")
        except Exception as exc:
            job.error, job.error_stage = f"post failed: {exc}", "post"
            return False
        t2 = time.perf_counter()
        job.posted += r1 - r0
        st = job.stats
        st["post_s"] = st.get("post_s", 0.0) + t2 - t1
        st["descriptors"] = st.get("descriptors", 0.0) + ndesc
        nbytes = (r1 - r0) * plan.region_bytes
        st["bytes"] = st.get("bytes", 0.0) + nbytes
        st["parts"] = st.get("parts", 0.0) + 1
        self._bump("bytes_total", nbytes)
        self._bump("descriptors_total", ndesc)
        self._bump("parts_total")
        tt = self._times.setdefault(job.reg.transfer_id, {})
        tt.setdefault("packed", t1)
        tt["posted"] = max(tt.get("posted", t2), t2)
        job.t_post = t2
        if not self._part_ended(job, handle, state):
            job.flying.append(handle)
        return not job.error

    def _plan(self, prefill: Prefill, reg: protocol.Register, peer: _Peer) -> tuple[Plan, int | None]:
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
        if plan.kind != "staged" and slot is not None:
            self._slots.free(slot)
            slot = None
        return plan, slot

    def refresh_gauges(self) -> None:
        self.gauges = {**self.rdv.pending(), "peers": float(len(self._peers))}

    def _prune_times(self) -> None:
        """Forget stage times of transfers that ended without a Result (aborted or expired before pairing)."""
        live = {j.reg.transfer_id for j in self._jobs} | {k[0] for k in self._deferred}
        for tid in [t for t in self._times if t not in live and self.rdv.stage(t) is None]:
            del self._times[tid]

    def _progress(self) -> None:
        if not self._jobs:
            return
        still: list[_Job] = []
        for job in self._jobs:
            try:
                over = self._advance(job)
            except Exception as exc:
                # A bug or a backend failure must end this push (D is told), not wedge the loop.
                log.exception("%s: push %s failed", self.name, job.reg.transfer_id)
                job.error, job.error_stage = f"push failed: {exc}", "post"
                over = not job.flying
            if over:
                self._finish(job)
            else:
                still.append(job)
        self._jobs = still
        wake_at: dict[str, int] = {}
        for job in still:
            plan, tid = job.plan, job.reg.transfer_id
            if plan is not None and job.sent < plan.nregions and not (job.cancel or job.error):
                at = next_part_at(
                    job.sent,
                    job.step,
                    plan.nregions,
                    plan.region_bytes,
                    self.cfg.layerwise_min_part_bytes,
                    self.cfg.layerwise_lead_layers,
                )
                wake_at[tid] = min(at, wake_at.get(tid, at))
        self._wake_at = wake_at

    def _finish(self, job: _Job) -> None:
        plan = job.plan
        assert plan is not None
        reg = job.reg
        self._release_made(job)
        if job.slot is not None:
            self._slots.free(job.slot)
        tt = self._times.setdefault(reg.transfer_id, {})
        t_end = job.t_complete or time.perf_counter()
        tt["completed"] = max(tt.get("completed", t_end), t_end)
        job.stats[f"plan_{plan.kind}"] = 1.0
        job.stats["pieces"] = float(plan.pieces)
        if job.t_post:
            job.stats["complete_s"] = max(0.0, t_end - job.t_post)
        acc = self._tstats.setdefault(reg.transfer_id, {})
        for k, v in job.stats.items():
            acc[k] = acc.get(k, 0.0) + v  # summed over this P rank's pushes of the transfer
        if job.error or (job.cancel and job.posted < plan.nregions):
            # Some regions will never be written: tell D, whose writer is
            # otherwise still counting regions. Sent only now, when no part is
            # in flight, so nothing lands after D reads it.
            why = job.error or job.cancel
            self._errors[reg.transfer_id] = why
            peer = self._peers.get(job.peer_key)
            if peer is not None:
                self._fail(peer.ident, reg, job.error_stage if job.error else "aborted", why)
        self._pushed(reg)

    def _pushed(self, reg: protocol.Register) -> None:
        """A push to one D rank ended; pair a deferred re-registration from that rank now."""
        decisions = self.rdv.on_pushed(reg.transfer_id, reg.engine_id, reg.rank)
        nxt = self._deferred.pop((reg.transfer_id, reg.engine_id, reg.rank), None)
        if nxt is not None:
            now = time.monotonic()
            released = [d for d in decisions if isinstance(d, Release) and d.prefill.transfer_id == reg.transfer_id]
            decisions = [d for d in decisions if not any(d is r for r in released)]
            self._errors.pop(reg.transfer_id, None)  # only the new attempt's outcome counts
            if released:
                # The rendezvous let go of the prefill with this push; keep its
                # blocks and pair them with the new attempt instead.
                decisions += self.rdv.on_register(nxt, now, expected=1)
                decisions += self.rdv.on_prefill(released[0].prefill, now)
            else:
                peer = self._peers.get((nxt.engine_id, nxt.rank))
                expected = self._expected(peer) if peer is not None else 1
                decisions += self.rdv.on_register(nxt, now, expected=expected)
        self._apply(decisions)
