"""P side: the push engine's shell (side channel, NIXL, backend calls, one loop).

The engine hands over a finished prefill with ``prefill_finished``
(whole-request push) or announces it with ``prefill_started`` and then
reports layers as the forward writes them with ``layer_written`` (layer-wise
push), and later learns from ``poll`` which requests' blocks it may free.
Nothing here blocks the caller.

Every rule lives in the pure machines: ``Rendezvous`` pairs registrations
with prefills and owns each transfer's record, a ``PushJob`` per (transfer,
D rank) decides what to pack and post and when, and ``StagingSlots`` which
push or parked prefill holds which staging slot. This thread only feeds
them events (messages, readiness, device markers, NIXL states) and carries
out their decisions and actions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpush.backends.base import Backend
from kvpush.backends.peer import peer_copies_on
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.capability import Binding, derive_key
from kvpush.core.counts import Count
from kvpush.core.errors import KVPushError
from kvpush.core.layout import KVLayout
from kvpush.core.limits import peer_limits
from kvpush.core.outcome import Cause, Failed, PrefillState, PushStats, PushTimes, Result, Stage
from kvpush.engine import by_index
from kvpush.engine.answers import Answers
from kvpush.engine.hand_over import HandOver
from kvpush.engine.loop import EngineLoop
from kvpush.engine.peer_writes import Writes
from kvpush.engine.peers import PeerTable
from kvpush.engine.pushes import PushRunner
from kvpush.engine.waiter import MarkerWaiter
from kvpush.prefill.decisions import Acknowledge, Decision, Hold, Prefill, Push, Refuse, Release
from kvpush.prefill.push_job import DKey, PushJob
from kvpush.prefill.rendezvous import Rendezvous
from kvpush.prefill.rounds_job import RoundsJob
from kvpush.prefill.slots import StagingSlots
from kvpush.transport.key_set import DeclaredRanks
from kvpush.transport.side_channel import Server, peer_budgets, server_keys

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
        self.rendezvous = Rendezvous(prefill_lease_s=config.leases.prefill_lease_s, limits=peer_limits(config))
        # Made with the agent, the staging region and the side channel (``setup``), before any call reaches the
        # thread: the D ranks that said hello, the staging slots' rule, the I/O halves of pushes and hand-overs.
        self.peers: PeerTable
        self.slots: StagingSlots
        self.runner: PushRunner
        self.hand_over: HandOver
        self.send_postings = True
        """Tell D when a push starts writing (``protocol.Posting``; D then polls that transfer busily). Tests
        turn it off to see D's fallback for a Posting lost on the way."""
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
        if regions < len(self.region_bases) and all(regions < self.rendezvous.wake_at(tid) for tid in tids):
            self.quiet_reports += 1
            self._inbox.put(fn)
        else:
            self.call(fn)

    def forward_done(self, transfer_ids: list[str], marker: Any = None) -> None:
        """Every layer of these started prefills is written (the end of the forward)."""
        self.layer_written(transfer_ids, len(self._layer_ends) - 1, marker)

    def abort(self, transfer_id: str, reason: str = "aborted on P") -> None:
        self.call(lambda: self._abort(transfer_id, reason))

    def prefill_states(self, states: list[tuple[str, PrefillState, int]]) -> None:
        """Where P's scheduler holds these prefills: (transfer id, queued or running, prompt tokens ahead).

        D's registrations for them are acknowledged with it and kept while
        the prefill is queued or running (``UNKNOWN``: no longer held).
        """
        todo = list(states)
        self.call(lambda: self._apply([d for t, st, n in todo for d in self.rendezvous.on_prefill_state(t, st, n)]))

    def stats(self) -> dict[str, Any]:
        """Counters and rendezvous sizes (read from the engine thread)."""

        def read() -> dict[str, Any]:
            extra = {
                "peers": len(self.peers),
                "marker_waits": self._waiter.waits if self._waiter is not None else 0,
                "quiet_reports": self.quiet_reports,
                "tombstones": self.rendezvous.tombstones(),
                "staging_slots_in_use": self.slots.in_use,
            }
            gate = self.server.gate
            if gate is not None:  # authenticated connections: the most one key has held, those shut over a cap,
                # handshakes refused for a barred key, and every handshake whose key was checked
                extra["key_connections_peak"] = gate.conns.peak
                extra["key_connections_shut"] = gate.conns.shut_total
                extra["key_handshakes_barred"] = gate.conns.barred_total
                extra["handshakes_checked"] = gate.checked
            pending = {**self.rendezvous.pending(), **self.slots.gauges()}
            return {**self.counters, **pending, "queued": self.rendezvous.queued(), **extra}

        return self.call_sync(read)

    # -- engine thread ---------------------------------------------------
    def setup(self) -> None:
        keys = server_keys(self.cfg)  # before the agent: missing keys are a start-up error
        if keys is not None:
            self.rendezvous.binding = Binding(derive_key(keys.secret), self.cfg.security.capability == "required")
            if not self.rendezvous.binding.required:
                log.warning(
                    "%s: capability optional: registrations and aborts without a transfer's capability are "
                    "accepted, so any D key that knows a transfer id may take or cancel a transfer no D "
                    "registered with its capability (docs/security.md)",
                    self.name,
                )
        self.open_agent("p")
        by_index.prepare_local(self.agent, self.layout)  # once, over the KV just registered
        port = self.cfg.side_channel_port + self.rank
        self.server = Server(
            self.ctx,
            self.cfg.side_channel_host,
            port,
            keys,
            peer_budgets(self.cfg),
            self.cfg.limits.preauth_per_address,
            self.cfg.limits.peer_max_ranks,
        )
        declared = DeclaredRanks(keys.decoders_dir) if keys is not None else lambda key: None
        self.writes = Writes(self.name, self.agent, self.backend, peer_copies_on(self.cfg, self.backend))
        self.peers = PeerTable(
            self.name,
            self.cfg,
            self.engine_id,
            self.rank,
            self.tp_size,
            self.layout,
            server=self.server,
            agent=self.agent,
            rendezvous=self.rendezvous,
            port=self,
            declared_ranks=declared,
            maps=self.writes,
        )
        self._make_pushes()
        self.poller.register(self.server.sock, 1)
        self.address = (self.server.host, self.server.port)
        log.info("%s: side channel on %s:%d", self.name, *self.address)

    def _make_pushes(self) -> None:
        """The staging slots' rule and the I/O halves of pushes, hand-overs and answers (after the peer table)."""
        self.slots = StagingSlots(self._slots, self.cfg, self.layout)
        self.runner = PushRunner(
            self.name,
            self.cfg,
            self.rank,
            self.layout,
            backend=self.backend,
            copy=self.copy,
            agent=self.agent,
            staging=self._staging,
            slots=self.slots,
            peers=self.peers,
            port=self,
            writes=self.writes,
        )
        self.hand_over = HandOver(
            self.name,
            self.cfg,
            self.layout,
            self.backend,
            self.copy,
            self._staging,
            self.slots,
            self,
            peer_copies_only=self.peers.all_mapped,
        )
        self.answers = Answers(self.name, self.rank, self.server, self.peers, self)

    def teardown(self) -> None:
        if self._waiter is not None:
            self._waiter.close()
        self.hand_over.close()  # a pack into staging ends before the staging goes
        self.runner.release_flying(self._jobs())
        self.server.close()
        self.agent.close()

    def step(self, now: float) -> bool:
        # Before this step reads the side channel: after a freeze, words D sent before it gave up are read only now.
        self.runner.look_at_silence(self._jobs(), now)
        self.server.deliver(lambda ident, key, msg: self.peers.on_message(ident, key, msg, now), self.peers.admits)
        self._progress()
        if self.agent.flushing(now):
            self.agent.progress()  # a notification sent without a WRITE (peer write, empty push) still leaving
        if self.slots.markers():
            self.hand_over.packs_ended(self.rendezvous.record)
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            self._apply(self.rendezvous.expire(now))
            self.peers.check(now)
            self.agent.expire(now)
            self.refresh_gauges()
        return self._busy()

    def refresh_gauges(self) -> None:
        self.gauges = {**self.rendezvous.pending(), **self.slots.gauges(), "peers": float(len(self.peers))}

    def _busy(self) -> bool:
        """Busy (short polls) only while WRITEs fly: those need NIXL's progress, which is ours to drive.

        A device marker (a pack, or the KV it waits for) is left to the
        waiter thread, which wakes this one when it is reached; a job waiting
        for layers is woken by ``layer_written``'s call. Polling for either
        from here would take the GIL from the forward's launches (``waiter.py``).
        """
        jobs = self._jobs()
        if any(j.flying for j in jobs) or self.agent.flushing(time.monotonic()):
            return True
        marker = next((j.watch for j in jobs if j.watch is not None), None)
        if marker is None:
            marker = next(iter(self.slots.markers()), None)
        if marker is not None:
            be = self.backend
            if self._waiter is None:
                self._waiter = MarkerWaiter(be.wait_ready, self.wake, self.name, bind=be.bind_engine_thread)
            self._waiter.watch(marker)
        return False

    # -- events from the caller and from D ---------------------------------------
    def _on_prefill(self, prefill: Prefill, regions: int, ready: Any, t: float) -> None:
        if not regions:
            self.bump(Count.LAYERWISE_PREFILLS)
        decisions = self.rendezvous.on_prefill(prefill, t)
        self._apply(decisions)  # a re-issued prefill's Release takes the old record's outcome first
        rec = self.rendezvous.record(prefill.transfer_id)
        if rec is not None and not any(isinstance(d, Release) and d.prefill is prefill for d in decisions):
            rec.reset_readiness(regions, ready)
            if regions:
                rec.times.prefill_done = t
            else:
                rec.times.prefill_start = t
            # Packed at hand-over only when parked: a registration waiting packs in its push, as planned.
            parked = bool(regions) and not any(isinstance(d, Push) for d in decisions)
            self.hand_over.prepare(prefill, rec, ready, parked=parked)

    def _on_layers(self, transfer_ids: list[str], regions: int, marker: Any, t: float) -> None:
        self.bump(Count.LAYER_REPORTS)
        for tid in transfer_ids:
            rec = self.rendezvous.record(tid)
            reported = rec is not None and rec.report(regions, marker, len(self.region_bases))
            if reported and regions >= len(self.region_bases):
                rec.times.prefill_done = t

    def on_register(self, ident: bytes, reg: protocol.Register, now: float, owner: str, cap: int) -> None:
        """A registration from a D rank the peer table accepted, by the D key ``owner``; ``cap``: the block ids
        that rank's open registrations may hold."""
        decisions = self.rendezvous.on_register(reg, now, expected=self.peers.expected(reg), owner=owner, cap=cap)
        rec = self.rendezvous.record(reg.transfer_id)
        if rec is not None:
            # Its own clock reading: ``now`` is the step's start, which can precede the message's arrival.
            rec.times.first("registered", time.monotonic())
        self._apply(decisions)

    def on_credit(self, key: DKey, msg: protocol.Credit) -> None:
        """D rank ``key`` credits parts of its push in rounds; one for another attempt, or for no push of that
        D rank in rounds, changes nothing."""
        rec = self.rendezvous.record(msg.transfer_id)
        job = rec.jobs.get(key) if rec is not None else None
        if rec is not None and isinstance(job, RoundsJob) and job.reg.attempt == msg.attempt:
            self.runner.credit(msg.transfer_id, rec, job, msg.parts)

    def on_remote_abort(self, msg: protocol.Abort, by: DKey, writer: bool = True) -> None:
        """D gave up, or (``writer`` False) told a P rank it does not write to that it is not needed: D takes
        this KV (replicated on several P ranks: MLA's latent, heads with more ranks than heads) from another."""
        if writer:
            self._abort(msg.transfer_id, f"aborted by D: {msg.reason}", by)
            return
        why = Failed(Stage.RENDEZVOUS, Cause.NOT_NEEDED, f"not needed by D: {msg.reason}")
        self._apply(self.rendezvous.cancel(msg.transfer_id, time.monotonic(), why, by))

    def _abort(self, transfer_id: str, reason: str, by: DKey | None = None) -> None:
        self.bump(Count.ABORTS)
        why = Failed(Stage.RENDEZVOUS, Cause.ABORTED, reason)
        self._apply(self.rendezvous.cancel(transfer_id, time.monotonic(), why, by))

    def drop_peer(self, key: DKey, reason: str, now: float) -> None:
        """Forget D rank ``key``: abort what it registered, cancel its pushes, give back their prebuilt WRITEs
        now (they name its NIXL agent, which the peer table unloads next)."""
        decisions = self.rendezvous.drop_peer(key, now, reason)
        for tid, rec in list(self.rendezvous.pushing()):
            job = rec.jobs.get(key)
            if job is not None:
                self.runner.drive(tid, rec, job)
        self._apply(decisions)

    def _jobs(self) -> list[PushJob]:
        return [j for _, rec in self.rendezvous.pushing() for j in rec.jobs.values()]

    def writing_to(self, key: DKey) -> bool:
        """A WRITE into D rank ``key`` is in flight."""
        return any(key in rec.jobs and rec.jobs[key].flying for _, rec in self.rendezvous.pushing())

    def fail(self, ident: bytes, reg: protocol.Register, failed: Failed) -> None:
        """Tell a D rank that this registration will not (all) be written (``Answers.fail``)."""
        self.answers.fail(ident, reg, failed)

    def _apply(self, decisions: list[Decision]) -> None:
        """Carry out the rendezvous' decisions (a ``Push`` starts at the step's end, from the rendezvous)."""
        for d in decisions:
            if isinstance(d, Release):
                self._released(d)
            elif isinstance(d, Refuse):
                if d.cause is Cause.EXPIRED:
                    self.bump(Count.EXPIRED_REGISTRATIONS)
                self.answers.refuse(d.reg, d.failed)
            elif isinstance(d, Hold):
                self.bump(Count.DEFERRED_REGISTRATIONS)
            elif isinstance(d, Acknowledge):
                self.answers.ack(d.reg, d.state, d.tokens_ahead)

    def _released(self, d: Release) -> None:
        if d.record is not None:  # the prefill's own end (not a refused re-issue): its parked slot goes too
            self.slots.prefill_ended(d.prefill.transfer_id)
        stats, times, failed = d.record.take_outcome() if d.record is not None else (PushStats(), PushTimes(), None)
        times.released = time.monotonic()
        self.bump(Count.RELEASED)
        if d.cause is Cause.EXPIRED:
            self.bump(Count.EXPIRED_PREFILLS)
        p = d.prefill
        if d.cause is Cause.NOT_NEEDED:  # another P rank writes this KV: releasing it unpushed is a success
            self.emit(Result(p.transfer_id, p.request_id, True, d.reason, d.cause, Stage.RENDEZVOUS, stats, times))
            return
        why = failed if d.cause is None else Failed(Stage.RENDEZVOUS, d.cause, d.reason)
        if why is None:
            self.emit(Result(p.transfer_id, p.request_id, True, stats=stats, times=times))
        else:
            res = Result(p.transfer_id, p.request_id, False, why.reason, why.cause, why.stage, stats, times)
            self.emit(res)

    # -- pushes ---------------------------------------------------------------
    def _progress(self) -> None:
        """Start the pushes paired in this step, then drive every push job (readiness, packs, WRITEs)."""
        for tid, rec in list(self.rendezvous.pushing()):
            for push in self.rendezvous.unstarted(tid):
                self.runner.start_job(tid, rec, push.prefill, push.reg)
            for job in list(rec.jobs.values()):
                self.runner.drive(tid, rec, job)
            rec.refresh_wake_at()

    def push_ended(self, transfer_id: str, key: DKey, failed: Failed | None) -> None:
        """A push ended (``failed`` None: written): carry out what the rendezvous decides."""
        self._apply(self.rendezvous.push_ended(transfer_id, key, failed))

    def tell_posting(self, reg: protocol.Register, peer: Any) -> None:
        """Tell the push's D rank that it starts writing (unless ``send_postings`` is off)."""
        if self.send_postings:
            self.server.send(peer.ident, protocol.Posting(reg.transfer_id, self.rank, reg.attempt))
