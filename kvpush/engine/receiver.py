"""D side: register destination blocks with P and count completions.

``register`` is called as soon as D allocates blocks for a request whose
prefill runs elsewhere; the thread says hello to each P rank that writes to
this D rank (once per rank), sends the registration, and counts one
completion notification per writing P rank. ``poll`` reports each transfer
once, when no P rank will write into its blocks any more (fencing): after
all completions, or after every writer answered an abort or was declared dead.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush import protocol
from kvpush.backends.base import Backend
from kvpush.config import Config
from kvpush.engine.loop import EngineLoop
from kvpush.engine.types import PeerAddress, Result
from kvpush.errors import ProtocolError
from kvpush.layout import KVLayout, Region
from kvpush.plan import part_count, split_regions, staged_bytes, unpack_pieces, wants_staging
from kvpush.topology import writers_for
from kvpush.transport.side_channel import Client

log = logging.getLogger(__name__)

TIMER_PERIOD_S = 0.05
WARM_POLL_S = 1e-3
"""How often D polls NIXL notifications for registrations no P rank has said it is writing (``Posting``):
a fallback for a lost heads-up and for failures P sends as notifications. Transfers being written are
polled every ``busy_poll_max_s``."""
REFUSED_RETRY_S = 5.0
"""A P rank that refused the handshake is asked again after this long, on the next registration:
the refusal may have been transient (a restart in progress) or fixed by redeploying P."""


class ConnState(enum.StrEnum):
    HELLO_SENT = "hello_sent"
    READY = "ready"
    REFUSED = "refused"
    DEAD = "dead"


@dataclass
class _Conn:
    """This D rank's link to one P rank."""

    client: Client
    state: ConnState
    since: float
    last_seen: float
    last_hb: float = 0.0
    hb_seq: int = 0
    reason: str = ""
    p_rank: int = 0
    agent: str = ""
    layout: KVLayout | None = None


@dataclass
class _Writer:
    """One P rank's part of one transfer."""

    conn_key: tuple[str, int]
    p_rank: int
    sent: bool = False
    final: bool = False
    ok: bool = False
    reason: str = ""
    grant: protocol.StagingGrant | None = None
    unpack: np.ndarray | None = None
    covered: bytearray | None = None  # 1 per region whose part arrived (a push may come in several)
    unpacking: list[tuple[int, int, Any]] = field(default_factory=list)  # parts (r0, r1, marker) being unpacked


@dataclass
class _Incoming:
    transfer_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    start_token: int
    writers: dict[int, _Writer]
    deadline: float
    t_register: float
    attempt: int = 0
    aborting: str = ""
    abort_deadline: float = float("inf")
    stats: dict[str, float] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)


class Receiver(EngineLoop):
    """One D rank's receive engine."""

    SIDE = "decode"

    def __init__(
        self,
        config: Config,
        backend: Backend,
        layout: KVLayout,
        engine_id: str,
        rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__("recv", config, backend, layout, engine_id, rank, tp_size)
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._by_agent: dict[str, tuple[str, int]] = {}
        self._transfers: dict[str, _Incoming] = {}
        self._superseded: list[_Incoming] = []
        self._unpacking: list[tuple[_Incoming, _Writer]] = []  # writers with an unpack in progress
        self._hot: set[str] = set()  # transfers a P rank said it is writing (``Posting``): polled busily
        self._next_timer = 0.0
        self.counters: dict[str, float] = {}
        self.start()

    # -- caller API ----------------------------------------------------
    def register(
        self,
        transfer_id: str,
        request_id: str,
        peer: PeerAddress,
        block_ids: list[list[int]] | tuple[tuple[int, ...], ...],
        num_tokens: int,
        start_token: int = 0,
    ) -> None:
        """Ask P to write tokens ``[start_token, num_tokens)`` into these blocks."""
        ids = tuple(tuple(int(b) for b in g) for g in block_ids)
        self.call(lambda: self._on_register(transfer_id, request_id, peer, ids, num_tokens, start_token))

    def abort(self, transfer_id: str, reason: str = "aborted on D") -> None:
        """Give up on a transfer; ``poll`` reports it once no P rank can still write."""
        self.call(lambda: self._on_abort(transfer_id, reason, time.monotonic()))

    def cancel(self, transfer_id: str, request_id: str, peer: PeerAddress, reason: str = "cancelled on D") -> None:
        """D gave up on a transfer it never registered: tell the P ranks that would have written it.

        A P that already parked the finished prefill frees it now instead of
        at its lease; one still computing it releases it when it finishes. A
        transfer this rank did register is aborted as usual.
        """
        self.call(lambda: self._on_cancel(transfer_id, request_id, peer, reason, time.monotonic()))

    def stats(self) -> dict[str, Any]:
        return self.call_sync(
            lambda: {
                **self.counters,
                "pending": len(self._transfers),
                "connections": sum(c.state is ConnState.READY for c in self._conns.values()),
                "staging_slots_in_use": self._slots.slots_in_use,
            }
        )

    # -- engine thread -----------------------------------------------------
    def setup(self) -> None:
        self.open_agent("d")

    def teardown(self) -> None:
        for c in self._conns.values():
            c.client.close()
        self.agent.close()

    def _bump(self, key: str, by: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + by

    def step(self, now: float) -> bool:
        for key, conn in list(self._conns.items()):
            for msg in conn.client.recv():
                conn.last_seen = now
                self._on_control(key, conn, msg, now)
        if self._transfers or self._superseded:
            for agent_name, data in self.agent.notifs():
                self._on_notif(agent_name, data, now)
        if self._unpacking:
            self._poll_unpacks()
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            self._timers(now)
            self.refresh_gauges()
        return bool(self._hot or self._superseded or self._unpacking)

    def idle_wait_s(self) -> float:
        """Registrations waiting for P to start writing: their notifications are polled every
        ``WARM_POLL_S``, not every ``busy_poll_max_s`` (each poll takes the GIL from D's decode loop)."""
        return min(self.idle_poll_max_s, WARM_POLL_S) if self._transfers else self.idle_poll_max_s

    def refresh_gauges(self) -> None:
        self.gauges = {
            "pending_registrations": float(len(self._transfers)),
            "fencing": float(len(self._superseded)),
            "connections": float(sum(c.state is ConnState.READY for c in self._conns.values())),
        }

    # registration ---------------------------------------------------------
    def _conn(self, host: str, port: int, now: float) -> _Conn:
        key = (host, port)
        conn = self._conns.get(key)
        stale = conn is not None and (
            (conn.state is ConnState.REFUSED and now - conn.since >= REFUSED_RETRY_S)
            # P stopped answering heartbeats (it restarted and does not know us): say hello again
            or (conn.state is ConnState.READY and now - conn.last_seen > self.cfg.peer_dead_s)
        )
        if conn is None or conn.state is ConnState.DEAD or stale:
            if conn is not None:
                conn.client.close()
                self.poller.unregister(conn.client.sock)
            client = Client(self.ctx, host, port)
            self.poller.register(client.sock, 1)
            conn = _Conn(client, ConnState.HELLO_SENT, now, now)
            self._conns[key] = conn
            staging = None
            if self._staging is not None:
                staging = Region(self._staging.addr, self._staging.size, self._staging.device_id)
            client.send(
                protocol.Hello(
                    engine_id=self.engine_id,
                    rank=self.rank,
                    tp_size=self.tp_size,
                    agent_name=self.agent.name,
                    agent_metadata=self.agent.metadata(),
                    layout=self.layout,
                    model=self.cfg.model,
                    staging=staging,
                )
            )
        return conn

    def _on_register(
        self,
        transfer_id: str,
        request_id: str,
        peer: PeerAddress,
        block_ids: tuple[tuple[int, ...], ...],
        num_tokens: int,
        start_token: int,
    ) -> None:
        now = time.monotonic()
        self._bump("registrations_total")
        old = self._transfers.pop(transfer_id, None)
        self._hot.discard(transfer_id)
        attempt = 0
        if old is not None:
            # Re-issued on D (preempted and re-allocated). P replaces the old
            # registration when it reads the new one and answers the old attempt
            # with a "superseded" failure, unless the old one is being written,
            # in which case it completes it and only then pushes the new one. So
            # an old writer is fenced once P answers the old attempt or completes
            # the new one; until then it stays here.
            attempt = old.attempt + 1
            old.aborting = "superseded by a re-issued registration"
            old.abort_deadline = now + self.cfg.peer_dead_s
            self._superseded.append(old)
            for w in old.writers.values():
                if not w.sent and not w.final:
                    self._writer_final(old, w, ok=False, reason=old.aborting)
        writers = writers_for(self.rank, self.tp_size, peer.tp_size, self.layout.num_heads)
        inc = _Incoming(
            transfer_id,
            request_id,
            block_ids,
            num_tokens,
            start_token,
            {p: _Writer((peer.host, peer.port + p), p) for p in writers},
            now + self.cfg.transfer_timeout_s,
            now,
            attempt,
        )
        inc.times["registered"] = now
        self._transfers[transfer_id] = inc
        for w in inc.writers.values():
            conn = self._conn(*w.conn_key, now)
            if conn.state is ConnState.READY:
                self._send_register(inc, w, conn)
            elif conn.state is ConnState.REFUSED:
                self._writer_final(inc, w, ok=False, reason=conn.reason)

    def _send_register(self, inc: _Incoming, w: _Writer, conn: _Conn) -> None:
        assert conn.layout is not None
        try:
            pieces = unpack_pieces(conn.layout, self.layout, inc.block_ids[0], inc.num_tokens, inc.start_token)
        except Exception as exc:
            self._writer_final(inc, w, ok=False, reason=f"bad registration: {exc}")
            return
        grant = None
        size = staged_bytes(conn.layout, self.layout, inc.num_tokens, inc.start_token)
        if size > 0 and self._staging is not None and wants_staging(self.cfg, conn.layout, self.layout, pieces):
            off = self._slots.alloc(size)
            if off is not None:
                grant = protocol.StagingGrant(off, size)
                w.unpack = pieces
                try:
                    self.copy.prepare_unpack(self.region_bases, pieces, parts=self._guess_parts(pieces, off))
                except Exception:
                    log.exception("%s: prepare_unpack failed (unpack will do it)", self.name)
            else:
                self._bump("staging_full_total")
        w.grant = grant
        t_send = time.monotonic()  # before the send: P may read the message before this thread runs again
        ok = conn.client.send(
            protocol.Register(
                transfer_id=inc.transfer_id,
                request_id=inc.request_id,
                engine_id=self.engine_id,
                rank=self.rank,
                block_ids=inc.block_ids,
                num_tokens=inc.num_tokens,
                start_token=inc.start_token,
                lease_ms=int(self.cfg.registration_lease_s * 1000),
                staging=grant,
                attempt=inc.attempt,
            )
        )
        w.sent = ok
        if ok:
            inc.times["sent"] = t_send  # the last writer's: D waits for every P rank
        if not ok:
            self._writer_final(inc, w, ok=False, reason="side channel send failed")

    def _guess_parts(self, pieces: np.ndarray, offset: int) -> list[tuple[int, int, int]]:
        """The parts P will most likely cut a whole-request push into (its rule, D's own config), as
        ``(r0, r1, staging_addr)`` for ``prepare_unpack``; a part cut otherwise is unpacked all the same."""
        assert self._staging is not None
        n = len(self.layout.regions)
        region_bytes = int(pieces[:, 1].sum()) if pieces.size else 0
        k = part_count(self.cfg.push_parts, n * region_bytes)
        base = self._staging.addr + offset
        return [(r0, r1, base + r0 * region_bytes) for r0, r1 in split_regions(0, n, k)]

    # messages ---------------------------------------------------------------
    def _on_control(self, key: tuple[str, int], conn: _Conn, msg: Any, now: float) -> None:
        if isinstance(msg, protocol.HelloReply):
            if not msg.ok or msg.layout is None:
                conn.state, conn.reason = ConnState.REFUSED, f"P {key[0]}:{key[1]} refused the handshake: {msg.reason}"
                conn.since = now
                log.error("%s: %s", self.name, conn.reason)
            else:
                conn.state, conn.p_rank, conn.agent, conn.layout = ConnState.READY, msg.rank, msg.agent_name, msg.layout
                self._by_agent[msg.agent_name] = key
            for inc in list(self._transfers.values()):
                for w in inc.writers.values():
                    if w.conn_key == key and not w.sent and not w.final:
                        if conn.state is ConnState.READY and not inc.aborting:
                            self._send_register(inc, w, conn)
                        else:
                            self._writer_final(inc, w, ok=False, reason=conn.reason or inc.aborting)
        elif isinstance(msg, protocol.Posting):
            inc = self._transfers.get(msg.transfer_id)
            if inc is not None and inc.attempt == msg.attempt and msg.rank in inc.writers:
                self._hot.add(msg.transfer_id)
                self._bump("postings_total")
        elif isinstance(msg, protocol.Failure):
            self._on_failure(msg)
        elif isinstance(msg, protocol.Heartbeat):
            pass
        else:
            log.warning("%s: unexpected %s from P %s:%s", self.name, type(msg).__name__, *key)

    def _on_notif(self, agent_name: str, data: bytes, now: float) -> None:
        try:
            msg = protocol.decode(data, expected=(protocol.Completion, protocol.Failure))
        except ProtocolError as exc:
            self._bump("rejected_messages_total")
            log.warning("%s: rejected notification from %s: %s", self.name, agent_name, exc)
            return
        key = self._by_agent.get(agent_name)
        if key is not None and key in self._conns:
            self._conns[key].last_seen = now
        if isinstance(msg, protocol.Failure):
            self._on_failure(msg)
            return
        inc, w = self._lookup(msg.transfer_id, msg.rank, msg.attempt, fences_older=True)
        if inc is None or w is None:
            return
        n = len(self.layout.regions)
        r0, r1 = (msg.region_start, msg.region_end) if msg.region_end else (0, n)
        if w.covered is None:
            w.covered = bytearray(n)
        if r1 > n or any(w.covered[r0:r1]):
            why = "outside D's regions" if r1 > n else "announced twice"
            self._writer_final(inc, w, ok=False, reason=f"completion for regions [{r0}, {r1}) {why} ({n} regions)")
            return
        if msg.plan == "staged":
            if w.grant is None or msg.staging != w.grant or w.unpack is None or self._staging is None:
                self._writer_final(inc, w, ok=False, reason="staged completion does not match the granted slot")
                return
            t0 = time.perf_counter()
            # The payload is region-major: this part's regions sit at their own offset in the slot.
            region_bytes = int(w.unpack[:, 1].sum())
            staging = self._staging.addr + w.grant.offset + r0 * region_bytes
            try:
                marker = self.copy.start_unpack(self.region_bases[r0:r1], w.unpack, staging)
            except Exception as exc:
                self._writer_final(inc, w, ok=False, reason=f"unpack failed: {exc}")
                return
            inc.stats["unpack_s"] = inc.stats.get("unpack_s", 0.0) + time.perf_counter() - t0
            # Claimed now (a repeated announcement is refused), reported once unpacked.
            w.covered[r0:r1] = b"\x02" * (r1 - r0)
            w.unpacking.append((r0, r1, marker))
            if len(w.unpacking) == 1:
                self._unpacking.append((inc, w))
        else:
            w.covered[r0:r1] = b"\x01" * (r1 - r0)
        inc.stats["bytes"] = inc.stats.get("bytes", 0.0) + msg.nbytes
        inc.stats["descriptors"] = inc.stats.get("descriptors", 0.0) + msg.descriptors
        inc.stats["parts"] = inc.stats.get("parts", 0.0) + 1
        self._bump("parts_total")
        inc.stats[f"plan_{msg.plan}"] = 1.0
        inc.times.setdefault("first_part", time.monotonic())
        inc.times["last_part"] = time.monotonic()  # the last one's: what the tail after it is made of
        if msg.plan == "staged":
            if not w.covered.count(0):
                # This part completes the writer: its unpacks are the critical path now, and short
                # kernels of ours, so wait for them rather than find them done one poll's sleep later.
                for _, _, marker in w.unpacking:
                    try:
                        self.backend.wait_ready(marker)
                    except Exception:
                        break  # the poll below reports the failure
            self._poll_unpacks()  # done ones (a synchronous backend's at once) are marked arrived
        else:
            self._check_covered(inc, w)

    def _poll_unpacks(self) -> None:
        """Mark the parts whose unpack finished as arrived; complete writers that have everything."""
        still: list[tuple[_Incoming, _Writer]] = []
        for inc, w in self._unpacking:
            while w.unpacking and not w.final:
                r0, r1, marker = w.unpacking[0]
                try:
                    done = self.backend.poll_ready(marker)
                except Exception as exc:
                    w.unpacking.clear()
                    self._writer_final(inc, w, ok=False, reason=f"unpack failed: {exc}")
                    break
                if not done:
                    break
                w.unpacking.pop(0)
                assert w.covered is not None
                w.covered[r0:r1] = b"\x01" * (r1 - r0)
            if w.unpacking and not w.final:
                still.append((inc, w))
            elif not w.final:
                self._check_covered(inc, w)
        self._unpacking = still

    def _check_covered(self, inc: _Incoming, w: _Writer) -> None:
        assert w.covered is not None
        if w.covered.count(1) < len(w.covered):
            return
        inc.times["completed"] = time.monotonic()
        self._writer_final(inc, w, ok=True, reason="")

    def _on_failure(self, msg: protocol.Failure) -> None:
        inc, w = self._lookup(msg.transfer_id, msg.rank, msg.attempt, fences_older=False)
        if inc is None or w is None:
            return
        self._writer_final(inc, w, ok=False, reason=f"P rank {msg.rank} failed at {msg.stage}: {msg.reason}")

    def _lookup(
        self, transfer_id: str, p_rank: int, attempt: int, fences_older: bool
    ) -> tuple[_Incoming | None, _Writer | None]:
        """The writer a message answers; also fences superseded attempts it proves dead.

        Only a *completion* of a newer attempt proves that P no longer writes
        an older one (P pushes a re-registration only after the previous
        attempt's WRITE ended). A failure of a newer attempt proves nothing: P
        may have rejected it while the older one is parked or being written.
        """
        for old in list(self._superseded):
            if old.transfer_id != transfer_id:
                continue
            w = old.writers.get(p_rank)
            if w is not None and not w.final and old.attempt <= attempt:
                if old.attempt == attempt:
                    return old, w
                if fences_older:
                    self._writer_final(old, w, ok=False, reason=old.aborting)
        inc = self._transfers.get(transfer_id)
        w = inc.writers.get(p_rank) if inc is not None else None
        if inc is None or w is None or attempt != inc.attempt or w.final:
            self._bump("stale_notifications_total")
            log.warning("%s: stale or unknown message for %s from P rank %d", self.name, transfer_id, p_rank)
            return None, None
        return inc, w

    # completion and fencing -------------------------------------------------
    def _writer_final(self, inc: _Incoming, w: _Writer, ok: bool, reason: str) -> None:
        if w.unpacking:
            # Ended while an unpack still writes into its blocks (an abort or a
            # failure): wait for it, so nothing lands after the blocks go back.
            for _, _, marker in w.unpacking:
                try:
                    self.backend.wait_ready(marker)
                except Exception:
                    log.exception("%s: waiting for an unpack of %s failed", self.name, inc.transfer_id)
            w.unpacking.clear()
        w.final, w.ok, w.reason = True, ok, reason
        if w.grant is not None:
            self._slots.free(w.grant.offset)
            w.grant = None
        if all(x.final for x in inc.writers.values()):
            if inc in self._superseded:
                self._superseded.remove(inc)
            elif self._transfers.get(inc.transfer_id) is inc:
                del self._transfers[inc.transfer_id]
                self._hot.discard(inc.transfer_id)
            good = all(x.ok for x in inc.writers.values()) and not inc.aborting
            why = "" if good else (inc.aborting or next(x.reason for x in inc.writers.values() if not x.ok))
            inc.times["result"] = time.monotonic()
            inc.stats["latency_s"] = inc.times["result"] - inc.t_register
            self._bump("completed_total" if good else "failed_total")
            self.emit(Result(inc.transfer_id, inc.request_id, good, why, inc.stats, inc.times))

    def _on_abort(self, transfer_id: str, reason: str, now: float) -> None:
        inc = self._transfers.get(transfer_id)
        if inc is None or inc.aborting:
            return
        self._bump("aborts_total")
        inc.aborting = reason
        inc.abort_deadline = now + self.cfg.peer_dead_s
        for w in list(inc.writers.values()):
            if w.final:
                continue
            conn = self._conns.get(w.conn_key)
            if not w.sent or conn is None or conn.state is not ConnState.READY:
                self._writer_final(inc, w, ok=False, reason=reason)
            else:
                conn.client.send(protocol.Abort(transfer_id, inc.request_id, reason, inc.attempt))

    def _on_cancel(self, transfer_id: str, request_id: str, peer: PeerAddress, reason: str, now: float) -> None:
        if transfer_id in self._transfers:
            self._on_abort(transfer_id, reason, now)
            return
        self._bump("cancels_total")
        for p in writers_for(self.rank, self.tp_size, peer.tp_size, self.layout.num_heads):
            # Queued behind the Hello on a new connection: P reads them in order.
            self._conn(peer.host, peer.port + p, now).client.send(protocol.Abort(transfer_id, request_id, reason, 0))

    def _timers(self, now: float) -> None:
        for key, conn in self._conns.items():
            if conn.state is ConnState.READY and now - conn.last_hb >= self.cfg.heartbeat_s:
                conn.last_hb = now
                conn.hb_seq += 1
                conn.client.send(protocol.Heartbeat(self.engine_id, self.rank, conn.hb_seq, time.time()))
            if conn.state in (ConnState.READY, ConnState.HELLO_SENT) and now - conn.last_seen > self.cfg.peer_dead_s:
                waiting = [
                    i for i in self._transfers.values() for w in i.writers.values() if w.conn_key == key and not w.final
                ]
                if conn.state is ConnState.HELLO_SENT or waiting:
                    conn.state = ConnState.DEAD
                    conn.reason = f"P {key[0]}:{key[1]} silent for {now - conn.last_seen:.1f}s: declared dead"
                    log.error("%s: %s", self.name, conn.reason)
                    self._bump("dead_peers_total")
                    if conn.agent:
                        self.agent.remove_peer(conn.agent)
                    for inc in list(self._transfers.values()):
                        for w in inc.writers.values():
                            if w.conn_key == key and not w.final:
                                # Best effort: if P is only slow, not dead, the
                                # Abort reaches it before it posts the write.
                                conn.client.send(
                                    protocol.Abort(inc.transfer_id, inc.request_id, conn.reason, inc.attempt)
                                )
                                self._writer_final(inc, w, ok=False, reason=conn.reason)
        for inc in [*self._transfers.values(), *self._superseded]:
            if not inc.aborting and now >= inc.deadline:
                self._bump("expired_total")
                self._on_abort(inc.transfer_id, f"no KV from P within {self.cfg.transfer_timeout_s:g}s", now)
            elif inc.aborting and now >= inc.abort_deadline:
                for w in inc.writers.values():
                    if not w.final:
                        self._writer_final(inc, w, ok=False, reason=inc.aborting + " (P did not answer the abort)")
