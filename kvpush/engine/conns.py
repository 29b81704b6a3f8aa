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

The links know nothing of the receiver that owns them: it hands them narrow
ports (``Conns``' arguments), so they can be read and tested alone.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.layout import KVLayout
from kvpush.core.topology import ConnKey
from kvpush.decode.fencing_actions import UNKNOWN_SENDER
from kvpush.engine.ports import Fences
from kvpush.observability.metrics import Count
from kvpush.transport.auth import ClientKeys
from kvpush.transport.side_channel import Client, peer_budgets

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


@dataclass(frozen=True)
class Dialer:
    """Sockets to P ranks, each registered with the engine's poller (its thread sleeps on them)."""

    ctx: zmq.Context
    poller: zmq.Poller
    keys: ClientKeys | None
    cfg: Config

    def dial(self, key: ConnKey) -> Client:
        client = Client(self.ctx, *key, self.keys, peer_budgets(self.cfg))
        self.poller.register(client.sock, 1)
        return client

    def hang_up(self, client: Client) -> None:
        client.close()
        self.poller.unregister(client.sock)


class Conns:
    """The P ranks one D rank talks to, keyed by their side channel's (host, port).

    ``name``: the engine's, for logs; ``engine_id``, ``rank``: this D rank's, in heartbeats; ``fences``: D's
    fencing, asked who waits on a link; ``dialer``: its sockets; ``hello``: this D rank's hello of an epoch;
    ``unload``: forget a P rank's NIXL agent (declared dead); ``bump``: count an event.
    """

    def __init__(
        self,
        name: str,
        cfg: Config,
        engine_id: str,
        rank: int,
        fences: Fences,
        dialer: Dialer,
        hello: Callable[[int], protocol.Hello],
        unload: Callable[[str], None],
        bump: Callable[[Count], None],
    ) -> None:
        self.name, self.cfg, self.engine_id, self.rank = name, cfg, engine_id, rank
        self.fences, self.dialer, self.hello, self.unload, self.bump = fences, dialer, hello, unload, bump
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
            or (conn.state is ConnState.READY and now - conn.last_seen > self.cfg.polling.peer_dead_s)
        )
        if conn is not None and conn.state is not ConnState.DEAD and not stale:
            return conn
        if conn is not None:
            self.dialer.hang_up(conn.client)
        client = self.dialer.dial(key)
        epoch = self._epochs[key] = self._epochs.get(key, 0) + 1
        fencing = again and not self.fences.writes_on(key)
        conn = Conn(client, ConnState.HELLO_SENT, now, now, epoch=epoch, fencing=fencing)
        self._conns[key] = conn
        client.send(self.hello(epoch))
        return conn

    def on_hello_reply(self, key: ConnKey, conn: Conn, msg: protocol.HelloReply, now: float) -> bool:
        """Take P's answer; False for an answer to an older hello (another epoch), which changes nothing."""
        if msg.epoch != conn.epoch or conn.state is not ConnState.HELLO_SENT:
            name, epoch = self.name, conn.epoch
            log.warning("%s: stale hello reply from P %s:%s (epoch %d, expected %d)", name, *key, msg.epoch, epoch)
            return False
        if not msg.ok or msg.layout is None:
            conn.state, conn.reason = ConnState.REFUSED, f"P {key[0]}:{key[1]} refused the handshake: {msg.reason}"
            conn.since, conn.busy = now, msg.busy
            (log.info if msg.busy else log.error)("%s: %s", self.name, conn.reason)
        else:
            conn.state, conn.p_rank, conn.agent, conn.layout = ConnState.READY, msg.rank, msg.agent_name, msg.layout
            self._by_agent[msg.agent_name] = key
        return True

    def tick(self, now: float) -> list[tuple[ConnKey, str, int]]:
        """Heartbeats out, fencing hellos; returns the links just declared dead, with why and their epoch."""
        dead: list[tuple[ConnKey, str, int]] = []
        cfg = self.cfg
        for key, conn in list(self._conns.items()):
            busy = conn.state is ConnState.REFUSED and conn.busy and self.fences.writes_on(key)
            unanswered = (
                conn.state is ConnState.HELLO_SENT and conn.fencing and now - conn.since >= cfg.polling.peer_dead_s
            )
            if unanswered or (
                conn.state in (ConnState.DEAD, ConnState.REFUSED)
                and now - conn.since >= cfg.polling.heartbeat_s
                and (self.fences.quarantined_on(key) or busy)
            ):
                conn = self.open(key, now, again=True)  # a fencing hello, or P said "not yet"
            if conn.state is ConnState.READY and now - conn.last_hb >= cfg.polling.heartbeat_s:
                conn.last_hb = now
                conn.hb_seq += 1
                conn.client.send(protocol.Heartbeat(self.engine_id, self.rank, conn.hb_seq, time.time()))
            silent = now - conn.last_seen > cfg.polling.peer_dead_s
            # A READY link nobody waits on is said hello to again at the next registration instead.
            waited_on = (conn.state is ConnState.HELLO_SENT and not conn.fencing) or (
                conn.state is ConnState.READY and self.fences.writes_on(key)
            )
            if silent and waited_on:
                conn.state, conn.since = ConnState.DEAD, now
                conn.reason = f"P {key[0]}:{key[1]} silent for {now - conn.last_seen:.1f}s: declared dead"
                if conn.client.failure:
                    conn.reason += f" ({conn.client.failure})"
                log.error("%s: %s", self.name, conn.reason)
                self.bump(Count.DEAD_PEERS)
                if conn.agent:
                    self.unload(conn.agent)
                dead.append((key, conn.reason, conn.epoch))
        return dead
