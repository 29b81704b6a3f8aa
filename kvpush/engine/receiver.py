"""D side: the receive engine's shell (side channel, NIXL notifications, backend unpacks, one loop).

``register`` is called as soon as D allocates blocks for a request whose
prefill runs elsewhere; the thread says hello to each P rank that writes to
this D rank (once per rank), sends the registration, and counts what each
writing P rank's parts cover. ``poll`` reports each transfer once, when no P
rank will write into its blocks any more (fencing).

The rules are ``kvpush.decode.fencing.Fencing``'s (every transfer) and
``kvpush.decode.link.Links``' (every P rank); this thread feeds them messages,
notifications, unpack markers and the time, and carries out their actions,
with two collaborators: ``Conns`` (the links' sockets, ``engine/conns.py``) and
``UnpackRunner`` (staging grants and unpacks, ``engine/unpacks.py``). It reads
the actions, never a machine's insides.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from kvpush.backends.base import Backend
from kvpush.backends.peer import PeerCopy, peer_copies_on
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.counts import Count
from kvpush.core.errors import ProtocolError
from kvpush.core.layout import KVLayout, Region
from kvpush.core.limits import Throttle
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.payload import unpack_pieces
from kvpush.core.staging import FreeSlot
from kvpush.core.topology import ConnKey, bystander_channels, writer_channels
from kvpush.decode.allow import Allowed
from kvpush.decode.fence import hint as fence_hint
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import (
    UNKNOWN_SENDER,
    Acknowledged,
    AwaitUnpacks,
    Cancel,
    Foreign,
    HelloAgain,
    Overdue,
    Report,
    SendAbort,
    SendCredit,
    SendRegister,
    Stale,
    StartUnpack,
    WaitUnpacks,
)
from kvpush.decode.incoming import Action, Asked
from kvpush.decode.link import Dead, LinkNews, LinkState, Ready, Refused
from kvpush.decode.registration import register_message, unpack_choice
from kvpush.decode.seals import NOTIFICATIONS, Greeting, Malformed, Unverified
from kvpush.decode.warm import warm_links
from kvpush.engine.conns import Conns, Dialer
from kvpush.engine.loop import EngineLoop
from kvpush.engine.types import PeerAddress
from kvpush.engine.unpacks import UnpackRunner
from kvpush.transport.auth import LOG_EVERY_S
from kvpush.transport.side_channel import client_keys

log = logging.getLogger(__name__)

TIMER_PERIOD_S = 0.05
WARM_POLL_S = 1e-3
"""How often D polls NIXL notifications for registrations no P rank has said it is writing (``Posting``):
a fallback for a lost heads-up and for failures P sends as notifications. Transfers being written are
polled every ``busy_poll_max_s``."""


def _yield_core() -> None:
    """Let the threads waiting for a core run before this one goes on (``sched_yield``; a no-op elsewhere).

    Called right after the Register is handed to ZMQ: its I/O thread, not this one, puts it on the wire,
    and what this thread does next (D's unpack list) is off the path. On a host with no idle core that
    work would otherwise keep the I/O thread, and the Register, waiting; with an idle core it costs a
    system call.
    """
    sched_yield = getattr(os, "sched_yield", None)
    if sched_yield is not None:
        sched_yield()


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
        self.fencing = Fencing(
            len(self.layout.regions),
            config.leases.transfer_timeout_s,
            config.polling.peer_dead_s,
            config.leases.transfer_hard_cap_s,
            config.leases.quarantine_s,
            Allowed.parse(config.security.allowed_prefills),
            credit_every=config.polling.heartbeat_s,
        )
        # The P ranks said hello to at start (``prefill_peers``): a bad entry is a start-up error naming it.
        allowed = Allowed.parse(config.security.allowed_prefills)
        self._warm, skipped = warm_links(config.prefill_peers, rank, tp_size, self.layout.num_heads, allowed)
        for why in skipped:
            log.warning("%s: prefill_peers: %s", self.name, why)
        self._foreign_log = Throttle(LOG_EVERY_S)
        self._unverified_log = Throttle(LOG_EVERY_S)
        self.counters = self.fencing.counters
        self.conns: Conns  # made with the agent (``setup``), before any call reaches the thread
        self.unpacks: UnpackRunner  # likewise: the staging region comes with the agent
        self._next_timer = 0.0
        self._peer_blob = b""  # what lets a same-host P rank write this rank's KV (``setup``)
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
        self.call(lambda: self._do(self.fencing.abort(transfer_id, why, time.monotonic())))

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
        self.call(lambda: self._do(self.fencing.cancel(transfer_id, request_id, writers, why, now(), capability)))

    def fence(self, peer: PeerAddress, reason: str) -> None:
        """The operator declared P instance ``peer`` gone for good (``kvpush fence``): the writers of its ranks
        end now, fenced (quarantined blocks go back, waiting transfers fail), and their links are dropped."""
        ranks = {(peer.host, peer.port + r) for r in range(peer.tp_size)}
        self.call(lambda: self._fence(ranks, reason))

    def _fence(self, ranks: set[ConnKey], reason: str) -> None:
        before = self.fencing.quarantined_blocks()
        self._do(self.fencing.fenced_for_good(ranks, reason, time.monotonic()))
        for key in sorted(ranks):
            self.conns.fenced_for_good(key)
        self.refresh_gauges()  # before the Results reach vLLM: the next metrics say the blocks went back
        log.warning(
            "%s: %s: P ranks %s fenced for good; %d quarantined blocks given back",
            self.name,
            reason,
            ", ".join(f"{h}:{p}" for h, p in sorted(ranks)),
            before - self.fencing.quarantined_blocks(),
        )

    def stats(self) -> dict[str, Any]:
        return self.call_sync(
            lambda: {
                **self.counters,
                "pending": len(self.fencing),
                "connections": self.conns.ready(),
                "staging_slots_in_use": self._slots.slots_in_use,
                "quarantined_blocks": self.fencing.quarantined_blocks(),
            }
        )

    # -- engine thread -----------------------------------------------------
    def setup(self) -> None:
        keys = client_keys(self.cfg)  # before the agent: missing keys are a start-up error
        self.open_agent("d")
        self._peer_blob = self._export_peer()
        self.conns = Conns(
            self.name,
            self.cfg,
            self.engine_id,
            self.rank,
            fences=self.fencing,
            dialer=Dialer(self.ctx, self.poller, keys, self.cfg),
            hello=self._hello,
            unload=self.agent.remove_peer,
            bump=self.bump,
        )
        self.unpacks = UnpackRunner(
            self.name,
            self.cfg,
            self.layout,
            self.backend,
            self.copy,
            self._staging,
            self._slots,
            self.fencing,
            self.bump,
        )
        self.warm()

    def warm(self) -> None:
        """Say hello to the P ranks of ``prefill_peers`` now (called once the engine thread runs): their links
        are ready, NIXL metadata exchanged, before the first registration (``kvpush.decode.warm``)."""
        now = time.monotonic()
        for conn in self._warm:
            self.conns.open(conn, now)

    def _export_peer(self) -> bytes:
        """What lets a P rank on this host write this rank's KV (``kvpush.backends.peer``), when
        ``peer_copy`` is set and the backend can offer it; empty otherwise."""
        if not peer_copies_on(self.cfg, self.backend):
            return b""
        if not isinstance(self.backend, PeerCopy):
            if self.cfg.staging.peer_copy is True:
                log.warning("%s: peer_copy is set but backend %s cannot offer its KV", self.name, self.backend.name)
            return b""
        try:
            return self.backend.export_peer(self.layout) or b""
        except Exception:
            log.exception("%s: export_peer failed (P ranks write with NIXL)", self.name)
            return b""

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
            peer=self._peer_blob,
        )

    def teardown(self) -> None:
        self.conns.close()
        self.agent.close()

    def step(self, now: float) -> bool:
        for key, msg in self.conns.recv(now):
            self._on_control(key, msg, now)
        if self.fencing.listening() or self.conns.handshaking():
            for agent_name, data in self.agent.notifs(drain=self.fencing.drains()):
                self._on_notif(agent_name, data, now)
        self._do(self.fencing.poll_unpacks())
        if now >= self._next_timer:
            self._next_timer = now + TIMER_PERIOD_S
            self._do(self.conns.tick(now))
            self._do(self.fencing.expire(now))
            self.refresh_gauges()
        return self.fencing.busy()

    def idle_wait_s(self) -> float:
        """Registrations waiting for P to start writing: their notifications are polled every
        ``WARM_POLL_S``, not every ``busy_poll_max_s`` (each poll takes the GIL from D's decode loop)."""
        warm = len(self.fencing) > 0 or self.conns.handshaking()
        return min(self.idle_poll_max_s, WARM_POLL_S) if warm else self.idle_poll_max_s

    def refresh_gauges(self) -> None:
        self.gauges = {
            "pending_registrations": float(len(self.fencing)),
            "fencing": float(self.fencing.superseded_count()),
            "connections": float(self.conns.ready()),
            "quarantined_blocks": float(self.fencing.quarantined_blocks()),
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
        self._do(self.fencing.register(asked, writers, now, bystanders))

    def _bystanders(self, peer: PeerAddress) -> dict[int, ConnKey]:
        return bystander_channels(peer.host, peer.port, peer.tp_size, self.tp_size, self.layout.num_heads)

    def _writers(self, peer: PeerAddress) -> dict[int, ConnKey]:
        return writer_channels(peer.host, peer.port, peer.tp_size, self.rank, self.tp_size, self.layout.num_heads)

    def _on_control(self, key: ConnKey, msg: Any, now: float) -> None:
        if isinstance(msg, protocol.HelloReply):
            self._do(self.conns.hello_reply(key, msg, now))
        elif isinstance(msg, protocol.Posting):
            self._do(self.fencing.posting(msg.transfer_id, msg.rank, msg.attempt))
        elif isinstance(msg, protocol.Ack):
            self._do(self.fencing.acknowledged(msg))
        elif isinstance(msg, protocol.Failure):
            self._do(self.fencing.failure(msg, time.monotonic(), sender=key))
        elif isinstance(msg, protocol.Features):
            self.conns.features(key, msg)
        elif isinstance(msg, protocol.LinkKey):
            self.conns.link_key(key, msg)
        elif not isinstance(msg, protocol.Heartbeat):
            log.warning("%s: unexpected %s from P %s:%s", self.name, type(msg).__name__, *key)

    def _on_notif(self, agent_name: str, data: bytes, now: float) -> None:
        """A NIXL notification: acted on only if the seals of the link it names say so (``kvpush.decode.seals``);
        the name it carries is the sender's own word."""
        try:
            msg = protocol.decode(data, expected=(*NOTIFICATIONS, protocol.Sealed))
        except ProtocolError as exc:
            self.bump(Count.REJECTED_MESSAGES)
            log.warning("%s: rejected notification from %s: %s", self.name, agent_name, exc)
            return
        sender, verdict = self.conns.check(agent_name, msg)
        if isinstance(verdict, Unverified):
            self.bump(Count.UNVERIFIED_NOTIFICATIONS)
            self._unverified(agent_name, sender, verdict, now)
            return
        if isinstance(verdict, Malformed):
            self.bump(Count.REJECTED_MESSAGES)
            log.warning("%s: rejected sealed notification from %s: %s", self.name, agent_name, verdict.error)
            return
        if isinstance(verdict, Greeting):
            return  # P's greeting as it loaded this agent: it connects where loading does not (Agent.add_peer)
        msg = verdict.msg
        if verdict.sealed:
            self.bump(Count.SEALED_NOTIFICATIONS)
        self.conns.heard_from_agent(agent_name, now)
        if isinstance(msg, protocol.Heartbeat):
            return  # it says only that P lives (P's greeting, unsealed where the link takes that)
        if isinstance(msg, protocol.Failure):
            self._do(self.fencing.failure(msg, time.monotonic(), sender=sender))
        else:
            self._do(self.fencing.completion(msg, time.monotonic(), sender=sender))

    def _unverified(self, agent_name: str, sender: ConnKey, verdict: Unverified, now: float) -> None:
        """A notification D did not act on (counted already), logged once per interval per link (an agent name
        is the sender's choice: all those no link named share one line)."""
        held = self._unverified_log.note(sender, now)
        if held is None:
            return
        who = f"P {sender[0]}:{sender[1]}'s link" if sender != UNKNOWN_SENDER else "no link"
        more = f" ({held} more since the last line)" if held else ""
        log.warning(
            "%s: ignored a NIXL notification from agent %r (%s): %s%s",
            self.name,
            agent_name,
            who,
            verdict.describe(),
            more,
        )

    # -- actions --------------------------------------------------------------------
    def _do(self, actions: list[Action] | list[LinkNews]) -> None:
        """Carry out the machines' actions in order, feeding each answer (and what the links say) to ``Fencing``."""
        todo: list[Action | LinkNews] = list(actions)
        while todo:
            a = todo.pop(0)
            fed = self._act(a)
            todo[:0] = fed

    def _act(self, a: Action | LinkNews) -> list[Action]:
        now = time.monotonic()
        if isinstance(a, SendRegister):
            return self._send_register(a)
        if isinstance(a, SendAbort):
            link = self.conns.standing(a.conn)
            if link is not None and link.state in (LinkState.READY, LinkState.DEAD):
                # To a dead P too, best effort: if it is only slow, the abort reaches it before it posts.
                self.conns.send(a.conn, protocol.Abort(a.transfer_id, a.request_id, a.reason, a.attempt, a.capability))
            if link is None or link.state is not LinkState.READY:
                return self.fencing.unreachable(a.incoming, a.p_rank, a.reason, now)
        elif isinstance(a, Cancel):
            # Queued behind the Hello on a new connection: P reads them in order.
            self.conns.open(a.conn, now)
            self.conns.send(a.conn, protocol.Abort(a.transfer_id, a.request_id, a.reason, 0, a.capability))
        elif isinstance(a, HelloAgain):
            log.info("%s: %s", self.name, a.describe())
            self.conns.forgotten(a.conn)
        elif isinstance(a, SendCredit):
            self.conns.send(a.conn, protocol.Credit(a.transfer_id, a.attempt, a.parts))
        elif isinstance(a, StartUnpack):
            return self.unpacks.start(a)
        elif isinstance(a, AwaitUnpacks):
            return self.unpacks.await_(a)
        elif isinstance(a, WaitUnpacks):
            self.unpacks.wait(a)
        elif isinstance(a, FreeSlot):
            self._slots.free(a.offset)
        elif isinstance(a, Ready | Refused | Dead):
            return self.fencing.on_link(a, now)
        else:
            self._log(a, now)
        return []

    def _log(self, a: Action, now: float) -> None:
        """The actions that only say something: to the log, and a Report to the caller."""
        if isinstance(a, Foreign):
            held = self._foreign_log.note(a.sender, now)
            if held is not None:
                more = f" ({held} more since the last line)" if held else ""
                log.warning("%s: %s%s", self.name, a.describe(), more)
        elif isinstance(a, Overdue):
            log.warning("%s: %s; %s", self.name, a.describe(), fence_hint(a.conn, self.cfg.fence_port))
        elif isinstance(a, Stale):
            log.warning("%s: %s", self.name, a.describe())
        elif isinstance(a, Acknowledged):
            log.debug("%s: %s", self.name, a.describe())
        elif isinstance(a, Report):
            if not a.result.fenced:
                log.warning("%s: %s", self.name, a.describe())
            self.emit(a.result)

    def _send_register(self, a: SendRegister) -> list[Action]:
        """Say hello to the writer's P rank if need be; once its link is ready, send the registration."""
        now = time.monotonic()
        link = self.conns.open(a.conn, now)
        if link.state is LinkState.REFUSED and not link.busy:
            return self.fencing.refused(a.incoming, a.conn, link.reason, now)
        if link.state is not LinkState.READY:
            return []  # the hello reply brings ``Ready``, and ``conn_ready`` a new SendRegister
        assert link.layout is not None
        ask = a.asked
        try:
            blocks, want, pieces = unpack_choice(self.cfg, link.layout, self.layout, ask, link.peer_copies)
        except Exception as exc:
            why = Failed(Stage.REGISTER, Cause.BAD_REGISTRATION, f"bad registration: {exc}")
            return self.fencing.writer_failed(a.incoming, a.p_rank, why, now)
        grant = self.unpacks.grant(link.layout, ask, want, link.rounds)
        t_send = time.monotonic()  # before the send: P may read the message before this thread runs again
        msg = register_message(self.cfg, ask, a.attempt, self.engine_id, self.rank, grant)
        ok = self.conns.send(a.conn, msg)
        if ok:
            _yield_core()
        unpack, region_bytes = None, 0
        if grant is not None and ok:
            # After the send, while P pairs, plans and packs: this thread handles P's first part only later.
            # The checks above make this build infallible; if it fails anyway, the part fails the writer.
            try:
                if pieces is None:
                    pieces = unpack_pieces(link.layout, self.layout, blocks, ask.num_tokens, ask.start_token)
                unpack, region_bytes = pieces, int(pieces[:, 1].sum()) if pieces.size else 0
                self.unpacks.prepare(pieces, grant)
            except Exception:
                log.exception("%s: building the unpack list of %s failed", self.name, ask.transfer_id)
        return self.fencing.register_sent(a.incoming, a.p_rank, grant, unpack, region_bytes, ok, t_send)
