"""D's links to the P ranks that write to it, the I/O half: one ZMQ DEALER per P rank, opened on demand.

The rule of each link (when to say hello, staleness, refusals, heartbeats,
declaring a silent P rank dead, fencing hellos, epochs) is
``kvpush.decode.link.Links``'; ``Conns`` is its shell: it feeds the links
what arrives and the time, and carries out what they ask (dial, hang up,
send a hello or a heartbeat, unload a dead P rank's NIXL agent, log and
count). What concerns D's fencing (``LinkNews``: ``Ready``, ``Refused``,
``Dead``) it hands back to the receiver, which feeds it to ``Fencing.on_link``.

The links know nothing of the receiver that owns them: it hands them narrow
ports (``Conns``' arguments), so they can be read and tested alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.counts import Count
from kvpush.core.topology import ConnKey
from kvpush.decode.link import (
    Dead,
    Fences,
    HangUp,
    Heartbeat,
    Hello,
    LinkAction,
    LinkNews,
    Links,
    LinkState,
    Refused,
    SealsChecked,
    StaleReply,
    Standing,
)
from kvpush.decode.seals import Verdict
from kvpush.transport.key_set import ClientKeys
from kvpush.transport.side_channel import Client, peer_budgets

log = logging.getLogger(__name__)


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
        self.name, self.engine_id, self.rank = name, engine_id, rank
        self.dialer, self.hello, self.unload, self.bump = dialer, hello, unload, bump
        self.links = Links(cfg.polling.peer_dead_s, cfg.polling.heartbeat_s, fences)
        self._clients: dict[ConnKey, Client] = {}

    # -- queries -------------------------------------------------------------------
    def standing(self, key: ConnKey) -> Standing | None:
        return self.links.standing(key)

    def ready(self) -> int:
        return self.links.ready()

    def handshaking(self) -> bool:
        """Whether a hello awaits its reply: P loads this rank's NIXL metadata meanwhile, which over
        LIBFABRIC's tcp provider completes only while this rank's agent is progressed."""
        return self.links.handshaking()

    def key_of(self, agent_name: str) -> ConnKey:
        """The P rank whose hello reply named this NIXL agent (``UNKNOWN_SENDER``: none did)."""
        return self.links.key_of(agent_name)

    def check(self, agent_name: str, msg: Any) -> tuple[ConnKey, Verdict]:
        """The link a NIXL notification names by its sender's agent name, and whether D acts on it (its seals:
        ``Links.check``)."""
        return self.links.check(agent_name, msg)

    # -- I/O -----------------------------------------------------------------------
    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def recv(self, now: float) -> Iterator[tuple[ConnKey, Any]]:
        for key, client in list(self._clients.items()):
            for msg in client.recv():
                self.links.heard(key, now)
                yield key, msg
            link = self.links.standing(key)
            if link is not None and link.state is LinkState.HELLO_SENT and client.refused:
                # The authentication failed (a P without the key this D trusts, or refusing this D's key):
                # a refused handshake, now and with its reason, not a P silent for peer_dead_s: the answer to
                # the hello this link waits on (its epoch), as P's own refusal would be.
                yield key, protocol.HelloReply(ok=False, reason=client.failure, epoch=link.epoch)

    def send(self, key: ConnKey, msg: Any) -> bool:
        """Send on ``key``'s link (False: there is none, or the send failed)."""
        client = self._clients.get(key)
        return client is not None and client.send(msg)

    def heard_from_agent(self, agent_name: str, now: float) -> None:
        self.links.heard_from_agent(agent_name, now)

    # -- events, fed to the links ----------------------------------------------------
    def forgotten(self, key: ConnKey) -> None:
        """P rank ``key`` no longer knows this D rank: the next registration on its link says hello first."""
        self.links.forgotten(key)

    def open(self, key: ConnKey, now: float) -> Standing:
        """The link to ``key``, saying hello first if need be (a Hello queued before anything sent on it)."""
        self._apply(self.links.open(key, now))
        link = self.links.standing(key)
        assert link is not None
        return link

    def features(self, key: ConnKey, msg: protocol.Features) -> None:
        """What P speaks, said before its hello reply (``Links.features``)."""
        self.links.features(key, msg)

    def link_key(self, key: ConnKey, msg: protocol.LinkKey) -> None:
        """The key of P's seals for the session the waiting hello opens, said before its reply (``Links.link_key``)."""
        self.links.link_key(key, msg)

    def fenced_for_good(self, key: ConnKey) -> None:
        """The operator fenced P rank ``key`` for good: its link is dropped (``Links.fenced_for_good``)."""
        self._apply(self.links.fenced_for_good(key))

    def hello_reply(self, key: ConnKey, msg: protocol.HelloReply, now: float) -> list[LinkNews]:
        """P's answer to a hello; what it means for D's fencing."""
        return self._apply(self.links.hello_reply(key, msg, now))

    def tick(self, now: float) -> list[LinkNews]:
        """Heartbeats out, fencing hellos, silent P ranks declared dead (what that means for D's fencing)."""
        failures = {key: c.failure for key, c in self._clients.items() if c.failure}
        return self._apply(self.links.tick(now, failures))

    def _apply(self, actions: list[LinkAction]) -> list[LinkNews]:
        """Carry out the links' actions; hand back those for D's fencing."""
        news: list[LinkNews] = []
        for a in actions:
            if isinstance(a, Hello):
                old = self._clients.pop(a.key, None)
                if old is not None:
                    self.dialer.hang_up(old)
                client = self._clients[a.key] = self.dialer.dial(a.key)
                client.send(self.hello(a.epoch))
            elif isinstance(a, Heartbeat):
                self.send(a.key, protocol.Heartbeat(self.engine_id, self.rank, a.seq, time.time()))
            elif isinstance(a, SealsChecked):
                self.send(a.key, protocol.SealsChecked(a.epoch))
            elif isinstance(a, HangUp):
                old = self._clients.pop(a.key, None)
                if old is not None:
                    self.dialer.hang_up(old)
                if a.agent:
                    self.unload(a.agent)
            elif isinstance(a, StaleReply):
                log.warning(
                    "%s: stale hello reply from P %s:%s (epoch %d, expected %d)", self.name, *a.key, a.epoch, a.expected
                )
            else:
                if isinstance(a, Refused):
                    (log.info if a.busy else log.error)("%s: %s", self.name, a.reason)
                elif isinstance(a, Dead):
                    log.error("%s: %s", self.name, a.reason)
                    self.bump(Count.DEAD_PEERS)
                    if a.agent:
                        self.unload(a.agent)
                news.append(a)
        return news
