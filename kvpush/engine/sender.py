"""P side: pair registrations with finished prefills and push the KV.

Runs entirely on its own thread: the engine hands over a finished prefill
with ``prefill_finished`` and later learns from ``poll`` which requests' blocks
it may free. Nothing here blocks the caller.
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
from kvpush.errors import KVPushError, LayoutError
from kvpush.layout import KVLayout, check_compatible
from kvpush.plan import Plan, build_plan
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
class _InFlight:
    handle: Any
    reg: protocol.Register
    prefill: Prefill
    plan: Plan
    slot: int | None
    t_post: float
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
        self._markers: dict[str, Any] = {}
        self._queued_pushes: list[Push] = []
        self._flying: list[_InFlight] = []
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

    def abort(self, transfer_id: str, reason: str = "aborted on P") -> None:
        self.call(lambda: self._on_local_abort(transfer_id, reason))

    def stats(self) -> dict[str, Any]:
        """Counters and rendezvous sizes (read from the engine thread)."""
        return self.call_sync(lambda: {**self.counters, **self.rdv.pending(), "peers": len(self._peers)})

    # -- engine thread ---------------------------------------------------
    def setup(self) -> None:
        self.open_agent("p")
        self.server = Server(self.ctx, self.cfg.side_channel_host, self.cfg.side_channel_port + self.rank)
        self.poller.register(self.server.sock, 1)
        self.address = (self.server.host, self.server.port)
        log.info("%s: side channel on %s:%d", self.name, *self.address)

    def teardown(self) -> None:
        for f in self._flying:
            self.agent.release(f.handle)
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
                self._push(push.prefill, push.reg)
        self._progress()
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            self._apply(self.rdv.expire(now))
            self._check_peers(now)
            self.refresh_gauges()
            if len(self._times) > len(self.rdv):
                self._prune_times()
        return bool(self._flying)

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
            if any((f.reg.engine_id, f.reg.rank) == key for f in self._flying):
                reason = "an earlier session of this D rank still has WRITEs in flight; say hello again shortly"
                self.server.send(ident, protocol.HelloReply(ok=False, reason=reason))
                return
            self._drop_peer(key, "said hello again (restarted?)", now)
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

    def _on_prefill(self, prefill: Prefill, ready: Any, t_done: float | None = None) -> None:
        self._markers[prefill.transfer_id] = ready
        now = time.monotonic()
        self._times.setdefault(prefill.transfer_id, {})["prefill_done"] = now if t_done is None else t_done
        self._apply(self.rdv.on_prefill(prefill, now))

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
                self._markers.pop(d.prefill.transfer_id, None)
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

    def _push(self, prefill: Prefill, reg: protocol.Register) -> None:
        t0 = time.perf_counter()
        peer = self._peers.get((reg.engine_id, reg.rank))
        if peer is None:
            self._errors[reg.transfer_id] = f"D {reg.engine_id} rank {reg.rank} is gone"
            self._pushed(reg)
            return
        slot: int | None = None
        try:
            if reg.num_tokens > prefill.num_tokens:
                raise KVPushError(f"D asks for {reg.num_tokens} tokens, P computed {prefill.num_tokens}")
            self.backend.wait_ready(self._markers.get(prefill.transfer_id))
            t_ready = time.perf_counter()
            plan, slot = self._plan(prefill, reg, peer)
            t_plan = time.perf_counter()
            if plan.kind == "staged":
                assert plan.pack is not None and self._staging is not None and slot is not None
                bases = [r.base for r in self.layout.regions]
                self.backend.pack(bases, plan.pack, self._staging.addr + slot)
            t_pack = time.perf_counter()
            notif = protocol.encode(
                protocol.Completion(
                    reg.transfer_id,
                    reg.request_id,
                    self.rank,
                    plan.kind,
                    plan.nbytes,
                    plan.descriptors,
                    reg.staging if plan.kind == "staged" else None,
                    reg.attempt,
                )
            )
            if plan.kind == "empty":
                self.agent.send_notif(peer.agent, notif)
            else:
                handle, state = self.agent.write(
                    plan.local, str(self.layout.mem), plan.remote, str(peer.layout.mem), peer.agent, notif
                )
        except Exception as exc:
            # Nothing was posted: free the slot and answer D, so neither side waits.
            if slot is not None:
                self._slots.free(slot)
            self._errors[reg.transfer_id] = f"post failed: {exc}"
            self._fail(peer.ident, reg, "post", str(exc))
            self._pushed(reg)
            return
        # perf_counter and monotonic are the same clock on Linux (CLOCK_MONOTONIC).
        tt = self._times.setdefault(reg.transfer_id, {})
        tt["push_start"] = min(tt.get("push_start", t0), t0)
        tt.setdefault("ready", t_ready)
        tt.setdefault("planned", t_plan)
        tt.setdefault("packed", t_pack)
        if plan.kind == "empty":
            tt["posted"] = tt["completed"] = time.perf_counter()
            self._bump("plan_empty_total")
            self._tstats.setdefault(reg.transfer_id, {})["plan_empty"] = 1.0
            self._done(reg, prefill, plan, None, ok=True)
            return
        t_post = time.perf_counter()
        tt["posted"] = max(tt.get("posted", t_post), t_post)
        stats = {
            "wait_ready_s": t_ready - t0,
            "plan_s": t_plan - t_ready,
            "pack_s": t_pack - t_plan,
            "post_s": t_post - t_pack,
            "bytes": float(plan.nbytes),
            "pieces": float(plan.pieces),
            "descriptors": float(plan.descriptors),
            f"plan_{plan.kind}": 1.0,
        }
        log.debug(
            "%s: push %s -> %s/%d plan=%s bytes=%d pieces=%d descs=%d est=%s",
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
        self._bump("bytes_total", plan.nbytes)
        self._bump("descriptors_total", plan.descriptors)
        f = _InFlight(handle, reg, prefill, plan, slot, t_post, stats)
        if state == "ERR":
            self._finish(f, ok=False)
        elif state == "DONE":
            self._finish(f, ok=True)
        else:
            self._flying.append(f)

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
        live = {f.reg.transfer_id for f in self._flying} | {k[0] for k in self._deferred}
        for tid in [t for t in self._times if t not in live and self.rdv.stage(t) is None]:
            del self._times[tid]

    def _progress(self) -> None:
        if not self._flying:
            return
        still: list[_InFlight] = []
        for f in self._flying:
            state = self.agent.state(f.handle)
            if state == "PROC":
                still.append(f)
            else:
                self._finish(f, ok=state == "DONE")
        self._flying = still

    def _finish(self, f: _InFlight, ok: bool) -> None:
        t_end = time.perf_counter()
        f.stats["complete_s"] = t_end - f.t_post
        tt = self._times.setdefault(f.reg.transfer_id, {})
        tt["completed"] = max(tt.get("completed", t_end), t_end)
        acc = self._tstats.setdefault(f.reg.transfer_id, {})
        for k, v in f.stats.items():
            acc[k] = acc.get(k, 0.0) + v  # summed over this P rank's pushes of the transfer
        self.agent.release(f.handle)
        self._done(f.reg, f.prefill, f.plan, f.slot, ok)

    def _done(self, reg: protocol.Register, prefill: Prefill, plan: Plan, slot: int | None, ok: bool) -> None:
        if slot is not None:
            self._slots.free(slot)
        if not ok:
            self._errors[reg.transfer_id] = f"WRITE to D {reg.engine_id} rank {reg.rank} failed"
            peer = self._peers.get((reg.engine_id, reg.rank))
            if peer is not None:
                self._fail(peer.ident, reg, "write", "NIXL reported an error for the WRITE")
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
