"""D side: the receive engine's shell (side channel, NIXL notifications, backend unpacks, one loop).

``register`` is called as soon as D allocates blocks for a request whose
prefill runs elsewhere; the thread says hello to each P rank that writes to
this D rank (once per rank), sends the registration, and counts what each
writing P rank's parts cover. ``poll`` reports each transfer once, when no P
rank will write into its blocks any more (fencing).

The rules are ``kvpush.decode.fencing.Fencing``'s; this thread feeds it messages,
notifications and unpack markers, and carries out its actions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from kvpush.backends.base import Backend
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.errors import ProtocolError
from kvpush.core.layout import KVLayout, Region
from kvpush.core.limits import Throttle
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.plan import staged_bytes, unpack_pieces
from kvpush.core.staging import FreeSlot
from kvpush.core.topology import ConnKey, bystander_channels, writer_channels
from kvpush.decode.allow import Allowed
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import (
    UNKNOWN_SENDER,
    AwaitUnpacks,
    Cancel,
    Foreign,
    Overdue,
    Report,
    SendAbort,
    SendRegister,
    Stale,
    StartUnpack,
    WaitUnpacks,
)
from kvpush.decode.incoming import Action, Asked, Incoming
from kvpush.decode.registration import guess_parts, register_message, unpack_choice
from kvpush.engine.conns import Conn, Conns, ConnState, Dialer
from kvpush.engine.loop import EngineLoop
from kvpush.engine.types import PeerAddress
from kvpush.observability.metrics import Count
from kvpush.transport.auth import LOG_EVERY_S
from kvpush.transport.side_channel import client_keys

log = logging.getLogger(__name__)

TIMER_PERIOD_S = 0.05
WARM_POLL_S = 1e-3
"""How often D polls NIXL notifications for registrations no P rank has said it is writing (``Posting``):
a fallback for a lost heads-up and for failures P sends as notifications. Transfers being written are
polled every ``busy_poll_max_s``."""


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
        self.book = Fencing(
            len(self.layout.regions),
            config.leases.transfer_timeout_s,
            config.polling.peer_dead_s,
            config.leases.transfer_hard_cap_s,
            config.leases.quarantine_s,
            Allowed.parse(config.security.allowed_prefills),
        )
        self._foreign_log = Throttle(LOG_EVERY_S)
        self.counters = self.book.counters
        self.conns: Conns  # made with the agent (``setup``), before any call reaches the thread
        self._next_timer = 0.0
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
        skip_blocks: tuple[int, ...] = (),
        capability: str = "",
    ) -> None:
        """Ask P to write tokens ``[start_token, num_tokens)`` into these blocks (``skip_blocks[g]``: leading
        blocks of group ``g`` D does not hold, as a sliding window's). ``capability``: the transfer's
        (``kvpush.core.capability``), from P's answer or the router."""
        # On the caller's thread, on the request's path: one copy into uint32 arrays, the wire's form (the
        # message is their bytes; the checks and D's unpack list take them as they are); a bad id raises
        # here, naming it.
        ids = tuple(protocol.block_id_array(g, f"block_ids[{i}]") for i, g in enumerate(block_ids))
        skip = tuple(int(n) for n in skip_blocks)
        self.call(
            lambda: self._on_register(transfer_id, request_id, peer, ids, num_tokens, start_token, skip, capability)
        )

    def abort(self, transfer_id: str, reason: str = "aborted on D") -> None:
        """Give up on a transfer; ``poll`` reports it once no P rank can still write."""
        why = Failed(Stage.TRANSFER, Cause.ABORTED, reason)
        self.call(lambda: self._do(self.book.abort(transfer_id, why, time.monotonic())))

    def cancel(
        self,
        transfer_id: str,
        request_id: str,
        peer: PeerAddress,
        reason: str = "cancelled on D",
        capability: str = "",
    ) -> None:
        """D gave up on a transfer it never registered: tell the P ranks that would have written it.

        A P that already parked the finished prefill frees it now instead of
        at its lease; one still computing it releases it when it finishes. A
        transfer this rank did register is aborted as usual.
        """
        why = Failed(Stage.TRANSFER, Cause.ABORTED, reason)
        writers = self._writers(peer)
        now = time.monotonic
        self.call(lambda: self._do(self.book.cancel(transfer_id, request_id, writers, why, now(), capability)))

    def stats(self) -> dict[str, Any]:
        return self.call_sync(
            lambda: {
                **self.counters,
                "pending": len(self.book),
                "connections": self.conns.ready(),
                "staging_slots_in_use": self._slots.slots_in_use,
                "quarantined_blocks": self.book.quarantined_blocks(),
            }
        )

    # -- engine thread -----------------------------------------------------
    def setup(self) -> None:
        keys = client_keys(self.cfg)  # before the agent: missing keys are a start-up error
        self.open_agent("d")
        self.conns = Conns(
            self.name,
            self.cfg,
            self.engine_id,
            self.rank,
            fences=self.book,
            dialer=Dialer(self.ctx, self.poller, keys, self.cfg),
            hello=self._hello,
            unload=self.agent.remove_peer,
            bump=self.bump,
        )

    def _hello(self, epoch: int) -> protocol.Hello:
        """This D rank's hello: who it is, its NIXL agent, its KV layout and staging region."""
        staging = None
        if self._staging is not None:
            staging = Region(self._staging.addr, self._staging.size, self._staging.device_id)
        return protocol.Hello(
            engine_id=self.engine_id,
            rank=self.rank,
            tp_size=self.tp_size,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            layout=self.layout,
            model=self.cfg.model,
            staging=staging,
            epoch=epoch,
            staging_mem=self._staging.mem if self._staging is not None else None,
            nixl_version=self.agent.nixl_version,
            nixl_backends=self.agent.backends,
        )

    def teardown(self) -> None:
        self.conns.close()
        self.agent.close()

    def step(self, now: float) -> bool:
        for key, conn, msg in self.conns.recv(now):
            self._on_control(key, conn, msg, now)
        if self.book.current or self.book.superseded or self.conns.handshaking():
            for agent_name, data in self.agent.notifs(drain=bool(self.book.hot)):
                self._on_notif(agent_name, data, now)
        self._do([AwaitUnpacks(inc, p, block=False) for inc, p in self.book.still_unpacking()])
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            for key, reason, epoch in self.conns.tick(now):
                self._do(self.book.conn_dead(key, reason, time.monotonic(), epoch))
            self._do(self.book.expire(now))
            self.refresh_gauges()
        return bool(self.book.hot or self.book.superseded or self.book.unpacking)

    def idle_wait_s(self) -> float:
        """Registrations waiting for P to start writing: their notifications are polled every
        ``WARM_POLL_S``, not every ``busy_poll_max_s`` (each poll takes the GIL from D's decode loop)."""
        warm = self.book.current or self.conns.handshaking()
        return min(self.idle_poll_max_s, WARM_POLL_S) if warm else self.idle_poll_max_s

    def refresh_gauges(self) -> None:
        self.gauges = {
            "pending_registrations": float(len(self.book)),
            "fencing": float(len(self.book.superseded)),
            "connections": float(self.conns.ready()),
            "quarantined_blocks": float(self.book.quarantined_blocks()),
        }

    # -- events ---------------------------------------------------------------------
    def _on_register(
        self,
        transfer_id: str,
        request_id: str,
        peer: PeerAddress,
        block_ids: tuple[np.ndarray, ...],  # uint32, from ``protocol.block_id_array``
        num_tokens: int,
        start_token: int,
        skip_blocks: tuple[int, ...] = (),
        capability: str = "",
    ) -> None:
        now = time.monotonic()
        writers = self._writers(peer)
        bystanders = self._bystanders(peer)
        asked = Asked(transfer_id, request_id, block_ids, num_tokens, start_token, skip_blocks, capability)
        self._do(self.book.register(asked, writers, now, bystanders))

    def _bystanders(self, peer: PeerAddress) -> dict[int, ConnKey]:
        return bystander_channels(peer.host, peer.port, peer.tp_size, self.tp_size, self.layout.num_heads)

    def _writers(self, peer: PeerAddress) -> dict[int, ConnKey]:
        return writer_channels(peer.host, peer.port, peer.tp_size, self.rank, self.tp_size, self.layout.num_heads)

    def _on_control(self, key: ConnKey, conn: Conn, msg: Any, now: float) -> None:
        if isinstance(msg, protocol.HelloReply):
            if not self.conns.on_hello_reply(key, conn, msg, now):
                return
            if conn.state is ConnState.READY:
                self._do(self.book.fenced(key, conn.epoch, now))
                self._do(self.book.conn_ready(key, now, conn.epoch))
            elif not conn.busy:
                self._do(self.book.conn_refused(key, conn.reason, now))
        elif isinstance(msg, protocol.Posting):
            self.book.posting(msg.transfer_id, msg.rank, msg.attempt)
        elif isinstance(msg, protocol.Ack):
            if self.book.acknowledged(msg):
                what = (msg.rank, msg.transfer_id, msg.state, msg.tokens_ahead)
                log.debug("%s: P rank %d: %s is %s (%d tokens ahead)", self.name, *what)
        elif isinstance(msg, protocol.Failure):
            self._do(self.book.failure(msg, time.monotonic(), sender=key))
        elif not isinstance(msg, protocol.Heartbeat):
            log.warning("%s: unexpected %s from P %s:%s", self.name, type(msg).__name__, *key)

    def _on_notif(self, agent_name: str, data: bytes, now: float) -> None:
        try:
            msg = protocol.decode(data, expected=(protocol.Completion, protocol.Failure, protocol.Heartbeat))
        except ProtocolError as exc:
            self.bump(Count.REJECTED_MESSAGES)
            log.warning("%s: rejected notification from %s: %s", self.name, agent_name, exc)
            return
        self.conns.heard_from_agent(agent_name, now)
        if isinstance(msg, protocol.Heartbeat):
            return  # P's greeting as it loaded this agent: it connects where loading does not (Agent.add_peer)
        sender = self.conns.key_of(agent_name)
        if isinstance(msg, protocol.Failure):
            self._do(self.book.failure(msg, time.monotonic(), sender=sender))
        else:
            self._do(self.book.completion(msg, time.monotonic(), sender=sender))

    # -- actions --------------------------------------------------------------------
    def _do(self, actions: list[Action]) -> None:
        """Carry out the fencing machine's actions in order, feeding each answer back."""
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            fed = self._act(a)
            todo[:0] = fed

    def _act(self, a: Action) -> list[Action]:
        if isinstance(a, SendRegister):
            return self._send_register(a.incoming, a.p_rank)
        if isinstance(a, SendAbort):
            inc, w = a.incoming, a.incoming.writers[a.p_rank]
            conn = self.conns.get(w.conn)
            if conn is not None and conn.state in (ConnState.READY, ConnState.DEAD):
                # To a dead P too, best effort: if it is only slow, the abort reaches it before it posts.
                abort = protocol.Abort(inc.transfer_id, inc.request_id, a.reason, inc.attempt, inc.asked.capability)
                conn.client.send(abort)
            if conn is None or conn.state is not ConnState.READY:
                why = inc.aborting or Failed(Stage.TRANSFER, Cause.ABORTED, a.reason)
                return self.book.on(inc, inc.writer_failed(a.p_rank, why, time.monotonic()))
        elif isinstance(a, Cancel):
            # Queued behind the Hello on a new connection: P reads them in order.
            abort = protocol.Abort(a.transfer_id, a.request_id, a.reason, 0, a.capability)
            self.conns.open(a.conn, time.monotonic()).client.send(abort)
        elif isinstance(a, StartUnpack):
            return self._start_unpack(a)
        elif isinstance(a, AwaitUnpacks):
            return self._await_unpacks(a)
        elif isinstance(a, WaitUnpacks):
            for marker in a.markers:
                try:
                    self.backend.wait_ready(marker)
                except Exception:
                    log.exception("%s: waiting for an unpack failed", self.name)
        elif isinstance(a, FreeSlot):
            self._slots.free(a.offset)
        elif isinstance(a, Foreign):
            held = self._foreign_log.note(a.sender, time.monotonic())
            if held is not None:
                more = f" ({held} more since the last line)" if held else ""
                host, port = a.sender or UNKNOWN_SENDER
                who = f"P {host}:{port}" if (host, port) != UNKNOWN_SENDER else "an agent this D has no link to"
                log.warning(
                    "%s: ignored a message for %s naming P rank %d from %s: the transfer was not registered with it%s",
                    self.name,
                    a.transfer_id,
                    a.p_rank,
                    who,
                    more,
                )
        elif isinstance(a, Stale):
            log.warning("%s: stale or unknown message for %s from P rank %d", self.name, a.transfer_id, a.p_rank)
        elif isinstance(a, Overdue):
            w = a.incoming.writers[a.p_rank]
            log.warning(
                "%s: %s: P %s:%d (rank %d) is still unfenced %.0fs after it was given up on; its %d blocks stay "
                "withheld from vLLM until it answers a hello (it may be frozen and still write them)",
                self.name,
                a.incoming.transfer_id,
                *w.conn,
                a.p_rank,
                a.held_s,
                a.incoming.quarantined_blocks(),
            )
        elif isinstance(a, Report):
            if not a.result.fenced:
                log.warning(
                    "%s: %s failed; its %d blocks stay quarantined until the writer is fenced (%s)",
                    self.name,
                    a.result.transfer_id,
                    a.incoming.quarantined_blocks(),
                    a.result.reason,
                )
            self.emit(a.result)
        return []

    def _send_register(self, inc: Incoming, p: int) -> list[Action]:
        """Say hello to the writer's P rank if need be; once its connection is ready, send the registration."""
        now = time.monotonic()
        conn = self.conns.open(inc.writers[p].conn, now)
        if conn.state is ConnState.REFUSED and not conn.busy:
            return self.book.on(inc, inc.conn_refused(inc.writers[p].conn, conn.reason, now))
        if conn.state is not ConnState.READY:
            return []  # the hello reply brings ``conn_ready``
        assert conn.layout is not None
        ask = inc.asked
        try:
            blocks, want, pieces = unpack_choice(self.cfg, conn.layout, self.layout, ask)
        except Exception as exc:
            why = Failed(Stage.REGISTER, Cause.BAD_REGISTRATION, f"bad registration: {exc}")
            return self.book.on(inc, inc.writer_failed(p, why, now))
        grant = self._grant(conn, inc, want)
        t_send = time.monotonic()  # before the send: P may read the message before this thread runs again
        ok = conn.client.send(register_message(self.cfg, inc, self.engine_id, self.rank, grant))
        unpack, region_bytes = None, 0
        if grant is not None and ok:
            # After the send, while P pairs, plans and packs: this thread handles P's first part only later.
            # The checks above make this build infallible; if it fails anyway, the part fails the writer.
            try:
                if pieces is None:
                    pieces = unpack_pieces(conn.layout, self.layout, blocks, ask.num_tokens, ask.start_token)
                unpack, region_bytes = pieces, int(pieces[:, 1].sum()) if pieces.size else 0
                self._prepare_unpack(pieces, grant.offset)
            except Exception:
                log.exception("%s: building the unpack list of %s failed", self.name, inc.transfer_id)
        return self.book.on(inc, inc.register_sent(p, grant, unpack, region_bytes, ok, t_send))

    def _grant(self, conn: Conn, inc: Incoming, want: bool) -> protocol.StagingGrant | None:
        """A slot of D's staging region for this writer, when D's own fragmentation wants one."""
        assert conn.layout is not None
        size = staged_bytes(conn.layout, self.layout, inc.asked.num_tokens, inc.asked.start_token)
        if size <= 0 or self._staging is None or not want:
            return None
        off = self._slots.alloc(size)
        if off is None:
            self.bump(Count.STAGING_FULL)
            return None
        return protocol.StagingGrant(off, size)

    def _prepare_unpack(self, pieces: np.ndarray, offset: int) -> None:
        """Hand the backend the unpack list (and the parts P will most likely cut) after the registration
        left: the first part needs P's pack and a WRITE first, so the upload is off the critical path."""
        assert self._staging is not None
        parts = guess_parts(self.cfg, len(self.layout.regions), pieces, self._staging.addr + offset)
        try:
            self.copy.prepare_unpack(self.region_bases, pieces, parts=parts)
        except Exception:
            log.exception("%s: prepare_unpack failed (unpack will do it)", self.name)

    def _start_unpack(self, a: StartUnpack) -> list[Action]:
        w = a.incoming.writers[a.p_rank]
        assert w.grant is not None and self._staging is not None
        t0 = time.monotonic()
        # The payload is region-major: this part's regions sit at their own offset in the slot.
        staging = self._staging.addr + w.grant.offset + a.r0 * w.region_bytes
        try:
            marker = self.copy.start_unpack(self.region_bases[a.r0 : a.r1], w.unpack, staging)
        except Exception as exc:
            why = Failed(Stage.UNPACK, Cause.OTHER, f"unpack failed: {exc}")
            return self.book.on(a.incoming, a.incoming.writer_failed(a.p_rank, why, time.monotonic()))
        t1 = time.monotonic()
        return self.book.unpack_started(a, marker, t1 - t0, t1)

    def _await_unpacks(self, a: AwaitUnpacks) -> list[Action]:
        """Feed the writer's finished unpacks in order (a synchronous backend's are done at once)."""
        inc, w = a.incoming, a.incoming.writers[a.p_rank]
        if a.block:
            for _, _, marker in w.unpacking:
                try:
                    self.backend.wait_ready(marker)
                except Exception:
                    break  # the poll below reports the failure
        out: list[Action] = []
        while w.unpacking and not w.final:
            try:
                done = self.backend.poll_ready(w.unpacking[0][2])
            except Exception as exc:
                why = Failed(Stage.UNPACK, Cause.OTHER, f"unpack failed: {exc}")
                return out + self.book.on(inc, inc.writer_failed(a.p_rank, why, time.monotonic()))
            if not done:
                break
            out += self.book.on(inc, inc.unpacked(a.p_rank, time.monotonic()))
        return out
