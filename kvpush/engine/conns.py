"""D's links to the P ranks that write to it: hello, heartbeats, and declaring a silent P rank dead.

One ZMQ DEALER per P rank, opened at the first registration that needs it.
A refused handshake is retried after ``REFUSED_RETRY_S`` (the refusal may
have been transient, or fixed by redeploying P); a P rank that stops
answering heartbeats for ``peer_dead_s`` is said hello to again (it
restarted and does not know this D) or, while writers wait on it, declared
dead, and its NIXL agent unloaded so nothing more of it is read.

Every hello carries the link's *epoch* (one more per hello) and P echoes it.
While writers of a P rank declared dead are quarantined, that rank is said
hello to again every ``heartbeat_s``: P answers ok only once nothing of
D's earlier session is in flight (until then it answers *busy*, which fails
nothing), and that answer fences them.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush import protocol
from kvpush.fencing_actions import UNKNOWN_SENDER
from kvpush.layout import KVLayout, Region
from kvpush.metrics import Count
from kvpush.topology import ConnKey
from kvpush.transport.side_channel import Client, peer_budgets

if TYPE_CHECKING:
    from kvpush.engine.receiver import Receiver

log = logging.getLogger(__name__)

REFUSED_RETRY_S = 5.0
"""A P rank that refused the handshake is asked again after this long, on the next registration."""


class ConnState(enum.StrEnum):
    HELLO_SENT = "hello_sent"
    READY = "ready"
    REFUSED = "refused"
    DEAD = "dead"


@dataclass
class Conn:
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
    epoch: int = 0
    busy: bool = False  # P answered "not yet" (an earlier session's WRITEs fly): hello again shortly
    fencing: bool = False  # a hello only to fence quarantined writers: nobody's registration waits on it


class Conns:
    """The P ranks one D rank talks to, keyed by their side channel's (host, port)."""

    def __init__(self, receiver: Receiver) -> None:
        self.r = receiver
        self._conns: dict[ConnKey, Conn] = {}
        self._by_agent: dict[str, ConnKey] = {}
        self._epochs: dict[ConnKey, int] = {}

    def get(self, key: ConnKey) -> Conn | None:
        return self._conns.get(key)

    def ready(self) -> int:
        return sum(c.state is ConnState.READY for c in self._conns.values())

    def handshaking(self) -> bool:
        """Whether a hello awaits its reply: P loads this rank's NIXL metadata meanwhile, which over
        LIBFABRIC's tcp provider completes only while this rank's agent is progressed."""
        return any(c.state is ConnState.HELLO_SENT for c in self._conns.values())

    def close(self) -> None:
        for c in self._conns.values():
            c.client.close()

    def recv(self, now: float) -> Iterator[tuple[ConnKey, Conn, Any]]:
        for key, conn in list(self._conns.items()):
            for msg in conn.client.recv():
                conn.last_seen = now
                yield key, conn, msg
            if conn.state is ConnState.HELLO_SENT and conn.client.refused:
                # The authentication failed (a P without the key this D trusts, or refusing this D's key):
                # a refused handshake, now and with its reason, not a P silent for peer_dead_s.
                yield key, conn, protocol.HelloReply(ok=False, reason=conn.client.failure)

    def key_of(self, agent_name: str) -> ConnKey:
        """The P rank whose hello reply named this NIXL agent (``UNKNOWN_SENDER``: none did)."""
        return self._by_agent.get(agent_name, UNKNOWN_SENDER)

    def heard_from_agent(self, agent_name: str, now: float) -> None:
        key = self._by_agent.get(agent_name)
        if key is not None and key in self._conns:
            self._conns[key].last_seen = now

    def open(self, key: ConnKey, now: float, again: bool = False) -> Conn:
        """The link to ``key``, saying hello first if there is none (or it is dead, stale, or long refused;
        ``again``: a fencing hello, whatever the link's state)."""
        conn = self._conns.get(key)
        stale = conn is not None and (
            again
            # a registration does not wait on a fencing hello sent long ago (perhaps to a frozen P): its own
            # hello's silence counts from now
            or (conn.state is ConnState.HELLO_SENT and conn.fencing)
            or (conn.state is ConnState.REFUSED and now - conn.since >= REFUSED_RETRY_S)
            # P stopped answering heartbeats (it restarted and does not know us): say hello again
            or (conn.state is ConnState.READY and now - conn.last_seen > self.r.cfg.peer_dead_s)
        )
        if conn is not None and conn.state is not ConnState.DEAD and not stale:
            return conn
        r = self.r
        if conn is not None:
            conn.client.close()
            r.poller.unregister(conn.client.sock)
        client = Client(r.ctx, *key, r.client_keys, peer_budgets(r.cfg))
        r.poller.register(client.sock, 1)
        epoch = self._epochs[key] = self._epochs.get(key, 0) + 1
        fencing = again and not r.book.writes_on(key)
        conn = Conn(client, ConnState.HELLO_SENT, now, now, epoch=epoch, fencing=fencing)
        self._conns[key] = conn
        staging = None
        if r._staging is not None:
            staging = Region(r._staging.addr, r._staging.size, r._staging.device_id)
        hello = protocol.Hello(
            engine_id=r.engine_id,
            rank=r.rank,
            tp_size=r.tp_size,
            agent_name=r.agent.name,
            agent_metadata=r.agent.metadata(),
            layout=r.layout,
            model=r.cfg.model,
            staging=staging,
            epoch=epoch,
            staging_mem=r._staging.mem if r._staging is not None else None,
            nixl_version=r.agent.nixl_version,
            nixl_backends=r.agent.backends,
        )
        client.send(hello)
        return conn

    def on_hello_reply(self, key: ConnKey, conn: Conn, msg: protocol.HelloReply, now: float) -> bool:
        """Take P's answer; False for an answer to an older hello (another epoch), which changes nothing."""
        if msg.epoch != conn.epoch or conn.state is not ConnState.HELLO_SENT:
            name, epoch = self.r.name, conn.epoch
            log.warning("%s: stale hello reply from P %s:%s (epoch %d, expected %d)", name, *key, msg.epoch, epoch)
            return False
        if not msg.ok or msg.layout is None:
            conn.state, conn.reason = ConnState.REFUSED, f"P {key[0]}:{key[1]} refused the handshake: {msg.reason}"
            conn.since, conn.busy = now, msg.busy
            (log.info if msg.busy else log.error)("%s: %s", self.r.name, conn.reason)
        else:
            conn.state, conn.p_rank, conn.agent, conn.layout = ConnState.READY, msg.rank, msg.agent_name, msg.layout
            self._by_agent[msg.agent_name] = key
        return True

    def tick(self, now: float) -> list[tuple[ConnKey, str, int]]:
        """Heartbeats out, fencing hellos; returns the links just declared dead, with why and their epoch."""
        dead: list[tuple[ConnKey, str, int]] = []
        cfg = self.r.cfg
        for key, conn in list(self._conns.items()):
            busy = conn.state is ConnState.REFUSED and conn.busy and self.r.book.writes_on(key)
            unanswered = conn.state is ConnState.HELLO_SENT and conn.fencing and now - conn.since >= cfg.peer_dead_s
            if unanswered or (
                conn.state in (ConnState.DEAD, ConnState.REFUSED)
                and now - conn.since >= cfg.heartbeat_s
                and (self.r.book.quarantined_on(key) or busy)
            ):
                conn = self.open(key, now, again=True)  # a fencing hello, or P said "not yet"
            if conn.state is ConnState.READY and now - conn.last_hb >= cfg.heartbeat_s:
                conn.last_hb = now
                conn.hb_seq += 1
                conn.client.send(protocol.Heartbeat(self.r.engine_id, self.r.rank, conn.hb_seq, time.time()))
            silent = now - conn.last_seen > cfg.peer_dead_s
            # A READY link nobody waits on is said hello to again at the next registration instead.
            waited_on = (conn.state is ConnState.HELLO_SENT and not conn.fencing) or (
                conn.state is ConnState.READY and self.r.book.writes_on(key)
            )
            if silent and waited_on:
                conn.state, conn.since = ConnState.DEAD, now
                conn.reason = f"P {key[0]}:{key[1]} silent for {now - conn.last_seen:.1f}s: declared dead"
                if conn.client.failure:
                    conn.reason += f" ({conn.client.failure})"
                log.error("%s: %s", self.r.name, conn.reason)
                self.r.bump(Count.DEAD_PEERS)
                if conn.agent:
                    self.r.agent.remove_peer(conn.agent)
                dead.append((key, conn.reason, conn.epoch))
        return dead
