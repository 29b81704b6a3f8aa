"""D's link to each P rank that writes to it (sans-I/O): hello, heartbeats, refusals, death and fencing hellos.

``Links`` holds the rule of every link one D rank has, keyed by the P rank's
side channel (``ConnKey``); the receiver's ``Conns`` (``kvpush.engine.conns``)
is its shell: it dials, hangs up, sends and receives, and carries out the
actions these events answer with. Time is passed in.

A link says hello at the first registration that needs it (``open``). A
refused handshake is retried after ``refused_retry_s`` (the refusal may have
been transient, or fixed by redeploying P); a P rank that stops answering
heartbeats for ``peer_dead_s`` is said hello to again (it restarted and does
not know this D) or, while writers wait on it, declared dead (``Dead``: its
NIXL agent is unloaded so nothing more of it is read, and D's fencing
quarantines its writers).

Every hello carries the link's *epoch* (one more per hello) and P echoes it;
an answer to an older hello changes nothing (``StaleReply``). While writers
of a P rank declared dead are quarantined, that rank is said hello to again
every ``heartbeat_s`` (a *fencing hello*): P answers ok only once nothing of
D's earlier session is in flight (until then it answers *busy*, which fails
nothing), and that answer (``Ready``) fences them.

Each link also keeps the seals of its sessions (``kvpush.decode.seals``): the
key P gives with its answer's session (``LinkKey``), kept only for the hello
waiting for it; P told that D checks them before the link is ready
(``SealsChecked``); and ``check``, which NIXL notifications of the link D acts
on.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvpush.core import protocol
from kvpush.core.layout import KVLayout
from kvpush.core.topology import ConnKey
from kvpush.decode.fencing_actions import UNKNOWN_SENDER
from kvpush.decode.seals import LinkSeals, Verdict, unlinked

REFUSED_RETRY_S = 5.0
"""A P rank that refused the handshake is asked again after this long, on the next registration."""


class LinkState(enum.StrEnum):
    HELLO_SENT = "hello_sent"
    READY = "ready"
    REFUSED = "refused"
    DEAD = "dead"


class Fences(Protocol):
    """What the links ask of D's fencing (``kvpush.decode.fencing.Fencing``)."""

    def writes_on(self, conn: ConnKey) -> bool:
        """Some writer on ``conn`` is waited for."""
        ...

    def quarantined_on(self, conn: ConnKey) -> bool:
        """Some writer on ``conn`` is quarantined: a fencing hello would release it."""
        ...


@dataclass
class Link:
    """This D rank's link to one P rank (the machine's own record)."""

    state: LinkState
    since: float
    last_seen: float
    epoch: int
    fencing: bool = False  # a hello only to fence quarantined writers: nobody's registration waits on it
    last_hb: float = 0.0
    hb_seq: int = 0
    reason: str = ""
    p_rank: int = 0
    agent: str = ""
    layout: KVLayout | None = None
    busy: bool = False  # P answered "not yet" (an earlier session's WRITEs fly): hello again shortly
    peer_copies: bool = False  # P writes this rank with peer copies (its hello reply said so)
    version: int = protocol.OLDEST_PROTOCOL_VERSION  # the protocol P speaks (its ``Features`` before the reply)
    forgotten: bool = False  # P said it no longer knows this D rank: the next registration says hello first


@dataclass(frozen=True)
class Standing:
    """Where a link stands, for the receiver: may it register (``READY``, with P's ``layout``), must it fail
    its writers (``REFUSED`` and not ``busy``, with the ``reason``), or wait for the hello's answer;
    ``peer_copies``: P writes this rank with peer copies (no staging, no unpack list); ``rounds``: P takes
    pushes in rounds (a ring grant, ``kvpush.core.rounds``)."""

    state: LinkState
    epoch: int
    reason: str
    busy: bool
    layout: KVLayout | None
    peer_copies: bool = False
    rounds: bool = False


# -- actions ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """Dial ``key`` afresh (hang up its old socket, if any) and say hello of ``epoch`` on it."""

    key: ConnKey
    epoch: int


@dataclass(frozen=True)
class Heartbeat:
    """Send heartbeat number ``seq`` on ``key``'s link."""

    key: ConnKey
    seq: int


@dataclass(frozen=True)
class SealsChecked:
    """Tell P rank ``key`` that this D rank checks the seals of the session of hello ``epoch`` (before anything is
    registered on it: P seals every notification of that session it sends here)."""

    key: ConnKey
    epoch: int


@dataclass(frozen=True)
class Ready:
    """P rank ``key`` answered the hello of ``epoch`` ok: its writers may register, and quarantined writers of
    an earlier epoch are fenced (``Fencing.fenced``, then ``Fencing.conn_ready``)."""

    key: ConnKey
    epoch: int


@dataclass(frozen=True)
class Refused:
    """P rank ``key`` refused the handshake: log it; unless ``busy`` (an earlier session still writes: hello
    again shortly), the writers waiting on it fail (``Fencing.conn_refused``)."""

    key: ConnKey
    reason: str
    busy: bool


@dataclass(frozen=True)
class Dead:
    """P rank ``key`` was silent for ``peer_dead_s`` while writers waited on it: log and count it, unload its
    NIXL agent (``agent``, "" if none), and quarantine its writers (``Fencing.conn_dead`` with ``epoch``)."""

    key: ConnKey
    reason: str
    epoch: int
    agent: str


@dataclass(frozen=True)
class HangUp:
    """The operator fenced P rank ``key`` for good: close its socket and unload its NIXL agent (``agent``, ""
    if none); a later registration to that address dials afresh (a new P there answers a new hello)."""

    key: ConnKey
    agent: str


@dataclass(frozen=True)
class StaleReply:
    """A hello reply of ``epoch`` while the link expects ``expected`` (or none): ignored; log it."""

    key: ConnKey
    epoch: int
    expected: int


LinkNews = Ready | Refused | Dead
"""What the links tell D's fencing (``Fencing.on_link``), through the shell."""

LinkAction = Hello | Heartbeat | SealsChecked | Ready | Refused | Dead | StaleReply | HangUp
"""What the links ask of their shell (``Hello``, ``Heartbeat``, ``SealsChecked``, ``HangUp``, and the logging and
unloading of the others) and, through it, of D's fencing (``Ready``, ``Refused``, ``Dead``)."""


class Links:
    """Every link of one D rank, keyed by the P rank's side channel.

    ``fences``: D's fencing, asked whether writers wait on a link or are
    quarantined on it (a link nobody waits on is never declared dead).
    """

    def __init__(
        self, peer_dead_s: float, heartbeat_s: float, fences: Fences, refused_retry_s: float = REFUSED_RETRY_S
    ) -> None:
        self.peer_dead_s, self.heartbeat_s, self.refused_retry_s = peer_dead_s, heartbeat_s, refused_retry_s
        self.fences = fences
        self._links: dict[ConnKey, Link] = {}
        self._by_agent: dict[str, ConnKey] = {}
        self._epochs: dict[ConnKey, int] = {}
        self._seals: dict[ConnKey, LinkSeals] = {}  # kept across hellos: only an ok answer changes what is required

    # -- queries -------------------------------------------------------------------
    def standing(self, key: ConnKey) -> Standing | None:
        """Where the link to ``key`` stands (None: D never said hello to it)."""
        link = self._links.get(key)
        if link is None:
            return None
        rounds = link.version >= protocol.ROUNDS_VERSION
        return Standing(link.state, link.epoch, link.reason, link.busy, link.layout, link.peer_copies, rounds)

    def ready(self) -> int:
        return sum(c.state is LinkState.READY for c in self._links.values())

    def handshaking(self) -> bool:
        """Whether a hello awaits its reply."""
        return any(c.state is LinkState.HELLO_SENT for c in self._links.values())

    def key_of(self, agent_name: str) -> ConnKey:
        """The P rank whose hello reply named this NIXL agent (``UNKNOWN_SENDER``: none did)."""
        return self._by_agent.get(agent_name, UNKNOWN_SENDER)

    def check(self, agent_name: str, msg: object) -> tuple[ConnKey, Verdict]:
        """The link a NIXL notification names by its sender's agent name, and whether D acts on it
        (``kvpush.decode.seals``): only what that link's seals say; a notification of an agent no link named
        goes on to D's fencing as it is (a sealed one cannot be verified)."""
        key = self._by_agent.get(agent_name, UNKNOWN_SENDER)
        seals = self._seals.get(key)
        return key, (seals.check(msg) if seals is not None else unlinked(msg))

    def sealed(self, key: ConnKey) -> bool:
        """Whether the link to ``key`` acts only on sealed notifications."""
        seals = self._seals.get(key)
        return seals is not None and seals.required

    # -- events --------------------------------------------------------------------
    def heard(self, key: ConnKey, now: float) -> None:
        """A message arrived on ``key``'s link: P lives."""
        link = self._links.get(key)
        if link is not None:
            link.last_seen = now

    def heard_from_agent(self, agent_name: str, now: float) -> None:
        """A NIXL notification arrived from this agent: its P rank lives."""
        key = self._by_agent.get(agent_name)
        if key is not None:
            self.heard(key, now)

    def forgotten(self, key: ConnKey) -> None:
        """P rank ``key`` refused a registration for want of a hello: it forgot this D rank (silent past its
        ``peer_dead_s``) while the link still looked live here. A ready link says hello again at the next
        registration (``open``); any other is saying it already, or will."""
        link = self._links.get(key)
        if link is not None and link.state is LinkState.READY:
            link.forgotten = True

    def open(self, key: ConnKey, now: float, again: bool = False) -> list[LinkAction]:
        """The link to ``key``, saying hello first if there is none (or it is dead, stale, or long refused;
        ``again``: a fencing hello, whatever the link's state)."""
        link = self._links.get(key)
        if link is not None and link.state is not LinkState.DEAD and not (again or self._stale(link, now)):
            return []
        epoch = self._epochs[key] = self._epochs.get(key, 0) + 1
        fencing = again and not self.fences.writes_on(key)
        self._links[key] = Link(LinkState.HELLO_SENT, now, now, epoch, fencing)
        return [Hello(key, epoch)]

    def features(self, key: ConnKey, msg: protocol.Features) -> None:
        """P says which protocol it speaks, just before its answer to the hello of ``msg.epoch``: kept with the
        link that hello opened (one of another epoch, or after the answer, changes nothing)."""
        link = self._links.get(key)
        if link is not None and msg.epoch == link.epoch and link.state is LinkState.HELLO_SENT:
            link.version = min(msg.version, protocol.PROTOCOL_VERSION)

    def link_key(self, key: ConnKey, msg: protocol.LinkKey) -> None:
        """P gives the key of its seals for the session of the hello of ``msg.epoch``, just before its answer: kept
        for that hello's answer (one of another epoch, or after the answer, changes nothing)."""
        link = self._links.get(key)
        if link is not None and msg.epoch == link.epoch and link.state is LinkState.HELLO_SENT:
            self._seals.setdefault(key, LinkSeals()).offer(msg.epoch, msg.key)

    def hello_reply(self, key: ConnKey, msg: protocol.HelloReply, now: float) -> list[LinkAction]:
        """P's answer to a hello; one to an older hello (another epoch) changes nothing. An ok one begins the
        session's seals (``kvpush.decode.seals``): P is told D checks them before anything is registered."""
        link = self._links.get(key)
        if link is None or msg.epoch != link.epoch or link.state is not LinkState.HELLO_SENT:
            return [StaleReply(key, msg.epoch, link.epoch if link is not None else 0)]
        seals = self._seals.setdefault(key, LinkSeals())
        if not msg.ok or msg.layout is None:
            seals.refused()
            link.state, link.reason = LinkState.REFUSED, f"P {key[0]}:{key[1]} refused the handshake: {msg.reason}"
            link.since, link.busy = now, msg.busy
            return [Refused(key, link.reason, msg.busy)]
        link.state, link.p_rank, link.agent, link.layout = LinkState.READY, msg.rank, msg.agent_name, msg.layout
        link.peer_copies = msg.peer_copies
        self._by_agent[msg.agent_name] = key
        checks = [SealsChecked(key, link.epoch)] if seals.answered(link.epoch, link.version) else []
        return [*checks, Ready(key, link.epoch)]

    def fenced_for_good(self, key: ConnKey) -> list[LinkAction]:
        """The operator declared P rank ``key`` gone for good (``Fencing.fenced_for_good`` ended its writers):
        the link is forgotten, so no heartbeat nor fencing hello goes to it and the next registration naming
        that address says hello afresh; its epoch count stays, so a late answer of the old session is stale."""
        link = self._links.pop(key, None)
        if link is None:
            return []
        if link.agent and self._by_agent.get(link.agent) == key:
            del self._by_agent[link.agent]
        return [HangUp(key, link.agent)]

    def tick(self, now: float, failures: Mapping[ConnKey, str] | None = None) -> list[LinkAction]:
        """Time passes: fencing hellos, heartbeats out, links declared dead. ``failures``: what the shell's
        sockets last failed with (a handshake that did not go through), said with a death."""
        out: list[LinkAction] = []
        for key in list(self._links):
            out += self._tick_one(key, now, (failures or {}).get(key, ""))
        return out

    # -- internals -----------------------------------------------------------------
    def _stale(self, link: Link, now: float) -> bool:
        """A link that must say hello again before a registration may use it."""
        return (
            # a registration does not wait on a fencing hello sent long ago (perhaps to a frozen P): its own
            # hello's silence counts from now
            (link.state is LinkState.HELLO_SENT and link.fencing)
            or (link.state is LinkState.REFUSED and now - link.since >= self.refused_retry_s)
            # P stopped answering heartbeats (it restarted and does not know us), or said it forgot us
            or (link.state is LinkState.READY and (link.forgotten or now - link.last_seen > self.peer_dead_s))
        )

    def _tick_one(self, key: ConnKey, now: float, failure: str) -> list[LinkAction]:
        out: list[LinkAction] = []
        link = self._links[key]
        busy = link.state is LinkState.REFUSED and link.busy and self.fences.writes_on(key)
        unanswered = link.state is LinkState.HELLO_SENT and link.fencing and now - link.since >= self.peer_dead_s
        if unanswered or (
            link.state in (LinkState.DEAD, LinkState.REFUSED)
            and now - link.since >= self.heartbeat_s
            and (self.fences.quarantined_on(key) or busy)
        ):
            out += self.open(key, now, again=True)  # a fencing hello, or P said "not yet"
            link = self._links[key]
        if link.state is LinkState.READY and now - link.last_hb >= self.heartbeat_s:
            link.last_hb = now
            link.hb_seq += 1
            out.append(Heartbeat(key, link.hb_seq))
        silent = now - link.last_seen > self.peer_dead_s
        # A READY link nobody waits on is said hello to again at the next registration instead.
        waited_on = (link.state is LinkState.HELLO_SENT and not link.fencing) or (
            link.state is LinkState.READY and self.fences.writes_on(key)
        )
        if silent and waited_on:
            link.state, link.since = LinkState.DEAD, now
            link.reason = f"P {key[0]}:{key[1]} silent for {now - link.last_seen:.1f}s: declared dead"
            if failure:
                link.reason += f" ({failure})"
            out.append(Dead(key, link.reason, link.epoch, link.agent))
        return out
