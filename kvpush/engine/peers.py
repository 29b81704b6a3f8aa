"""P's side of the side channel: which D ranks said hello, and what their messages may do.

The shell of ``kvpush.prefill.hello``, whose rules judge each hello and
registration: this table feeds them what it knows (the D ranks that said
hello, what their keys hold, whether a WRITE flies), then answers, logs,
loads or unloads D's NIXL metadata and hands accepted registrations to the
engine. A D rank silent for ``peer_dead_s`` (as this P rank watched:
``kvpush.prefill.liveness``) is forgotten, and so is one that
says hello again (it restarted: its old registrations point into memory of a
previous session). The transfer rules stay in the sender's machines; this
table only decides who is heard.

Who a peer is comes from the side channel's authentication: every message
carries the D key its connection proved (``kvpush.transport.auth``). A D
rank's name (engine id, rank) belongs to the key that said hello with it, so
a hello under another D rank's name from a different key is refused (it
would otherwise drop that rank and its transfers); registrations carry their
key to the rendezvous, which binds each transfer to it; an abort counts only
from the key that registered the transfer. Each hello answered ok gets a
fresh link key, given to that D rank on its connection (``LinkKey``), with
which this P rank seals its NIXL notifications to it once it says it checks
them (``kvpush.prefill.seals``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from kvpush.config import Config
from kvpush.core import peek, protocol, seal
from kvpush.core.counts import Count
from kvpush.core.layout import KVLayout
from kvpush.core.limits import Throttle
from kvpush.core.topology import targets_for
from kvpush.engine import by_index
from kvpush.engine.ports import PeerMaps, PeerPort
from kvpush.prefill.admission import Admission, KeyLimits
from kvpush.prefill.hello import (
    UNKNOWN_PEER_BLOCKS,
    HelloRefused,
    Local,
    Peer,
    Refusal,
    block_cap,
    frame_fits,
    judge_hello,
    judge_register,
    most_blocks,
)
from kvpush.prefill.liveness import Lookout, stall_bar
from kvpush.prefill.push_job import DKey
from kvpush.prefill.rendezvous import Rendezvous
from kvpush.prefill.seals import Sealer
from kvpush.transport.auth import LOG_EVERY_S
from kvpush.transport.key_set import short
from kvpush.transport.nixl_agent import Agent
from kvpush.transport.side_channel import Server

log = logging.getLogger(__name__)


class PeerTable:
    """The D ranks one P rank knows, keyed by (engine id, rank).

    Made with the engine's agent and side channel (``Sender.setup``): ``name``, ``engine_id``, ``rank``,
    ``tp_size``, ``layout``: this P rank's; ``server``: its side channel; ``agent``: its NIXL agent, which
    loads each D rank's; ``rendezvous``: the rendezvous, asked what a key holds and who may abort; ``port``: what the
    table tells the engine; ``declared_ranks``: the ranks a D key's key set declares.
    """

    def __init__(
        self,
        name: str,
        cfg: Config,
        engine_id: str,
        rank: int,
        tp_size: int,
        layout: KVLayout,
        server: Server,
        agent: Agent,
        rendezvous: Rendezvous,
        port: PeerPort,
        declared_ranks: Callable[[str], int | None] = lambda key: None,
        maps: PeerMaps | None = None,
    ) -> None:
        self.name, self.cfg, self.engine_id, self.rank, self.tp_size = name, cfg, engine_id, rank, tp_size
        self.server, self.agent, self.rendezvous, self.port = server, agent, rendezvous, port
        self.layout = layout
        self.groups = layout.num_groups
        """KV-cache groups of this P's layout (once: every registration is checked against it)."""
        self._peers: dict[DKey, Peer] = {}
        self._throttle = Throttle(LOG_EVERY_S)
        self.admission = Admission(KeyLimits(cfg.limits.peer_key_bytes, cfg.limits.peer_max_ranks))
        """What each D key makes this P rank hold, as a whole (``kvpush.prefill.admission``)."""
        self.declared = declared_ranks
        """The ranks a D key's key set declares (None: it declares none); ``kvpush.transport.auth``."""
        self.maps = maps
        """Maps a D rank's KV for peer copies from its hello, and lets it go when the rank is forgotten."""
        self.lookout = Lookout(stall_bar(cfg.polling.peer_dead_s))
        """This P rank's looks at its D ranks' silence (``check``)."""
        self.local = Local(cfg.model, layout, agent.nixl_version, tuple(agent.backends), cfg.polling.peer_dead_s)
        """This P rank, as a hello is judged against it (``kvpush.prefill.hello``)."""

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, key: DKey) -> Peer | None:
        return self._peers.get(key)

    def ident_of(self, key: DKey) -> bytes | None:
        peer = self._peers.get(key)
        return peer.ident if peer is not None else None

    def all_mapped(self) -> bool:
        """Whether every D rank this P rank knows takes peer copies (and it knows one): then nothing it pushes
        now is staged."""
        return bool(self._peers) and all(p.mapped is not None for p in self._peers.values())

    def writes_to(self, peer: Peer | None) -> bool:
        """Whether this P rank writes into any D rank of ``peer``'s instance (unknown peer: assume so)."""
        if peer is None:
            return True
        return bool(targets_for(self.rank, self.tp_size, peer.tp_size, self.layout.num_heads))

    def expected(self, reg: protocol.Register) -> int:
        """How many D ranks of the registering instance this P rank writes to."""
        peer = self._peers[(reg.engine_id, reg.rank)]
        return max(1, len(targets_for(self.rank, self.tp_size, peer.tp_size, self.layout.num_heads)))

    def on_message(self, ident: bytes, key: str, msg: Any, now: float) -> None:
        """One message from the connection ``ident``, which proved the D key ``key``."""
        if isinstance(msg, protocol.Hello):
            self._on_hello(ident, key, msg, now)
            return
        if isinstance(msg, protocol.TimeQuery):
            # Any authenticated peer may ask the time (``kvpush doctor --peer``): it reveals nothing else.
            self.server.send(ident, protocol.TimeReply(msg.seq, msg.sent_at, time.time()))
            return
        peer = self._of_ident(ident)
        if peer is not None:
            peer.last_seen = now
        if isinstance(msg, protocol.Heartbeat):
            # Only known peers get an answer: a D rank whose hello this P never
            # saw (P restarted) then sees P fall silent and says hello again.
            if peer is not None:
                self.server.send(ident, protocol.Heartbeat(self.engine_id, self.rank, msg.seq, time.time()))
        elif isinstance(msg, protocol.Register):
            self.port.bump(Count.REGISTRATIONS)
            holdings = self.holdings(peer.key) if peer is not None and peer.key else ()
            problem = judge_register(self.layout, self.groups, peer, msg, self.admission, holdings)
            if problem is not None:
                self.port.fail(ident, msg, problem)
            else:
                assert peer is not None
                self.port.on_register(ident, msg, now, peer.key, block_cap(self.groups, peer.layout))
        elif isinstance(msg, protocol.Abort):
            self._on_abort(peer, msg, now)
        elif isinstance(msg, protocol.Credit):
            if peer is not None:  # only the D rank that registered a push credits it: the job is found by its name
                self.port.on_credit((peer.engine_id, peer.rank), msg)
        elif isinstance(msg, protocol.SealsChecked):
            # The D rank of this connection checks its session's seals: its notifications are sealed from now.
            if peer is not None and peer.sealer is not None:
                peer.sealer.checks(msg.epoch)
        else:
            log.warning("%s: unexpected %s on the side channel", self.name, type(msg).__name__)

    def admits(self, ident: bytes, key: str, frame: memoryview) -> bool:
        """Whether to decode this frame: a registration listing more block ids than its D rank has blocks
        (or more groups than there are) is dropped unread, logged once per interval per peer. Decoded,
        each id is a Python int: such a frame would cost hundreds of MB before it could be refused."""
        counts = peek.block_id_counts(frame)
        if counts is None:
            return True
        peer = self._of_ident(ident)
        most = most_blocks(self.layout, peer.layout) if peer is not None else UNKNOWN_PEER_BLOCKS
        groups = self.groups
        if frame_fits(counts, groups, most):
            return True
        self.port.bump(Count.REJECTED_MESSAGES)
        held = self._throttle.note(("oversized", key), time.monotonic())
        if held is not None:
            who = f"D {peer.engine_id} rank {peer.rank}" if peer is not None else "a D rank that said no hello"
            who += f" (D key {short(key)})" if key else ""
            log.warning(
                "%s: dropped a registration from %s unread: %s block ids per group, at most %d per group "
                "(%d group%s)%s",
                self.name,
                who,
                list(counts),
                most,
                groups,
                "" if groups == 1 else "s",
                f" ({held} more since the last line)" if held else "",
            )
        return False

    def _of_ident(self, ident: bytes) -> Peer | None:
        """The D rank that said hello on the connection ``ident`` (None: none did)."""
        return next((p for p in self._peers.values() if p.ident == ident), None)

    def holdings(self, key: str) -> list[tuple[int, int]]:
        """(open registrations, block ids) of each D rank name of ``key``."""
        held = self.rendezvous.holdings.held
        return [held(dkey) for dkey, p in self._peers.items() if p.key == key]

    def _on_abort(self, peer: Peer | None, msg: protocol.Abort, now: float) -> None:
        """An abort counts only from the key that registered the transfer (``Rendezvous.may_abort``); others
        are counted, logged once per interval per peer, and leave nothing behind."""
        if peer is None:
            why = "from a connection that never said hello"
        else:
            why = self.rendezvous.may_abort(msg.transfer_id, peer.key, (peer.engine_id, peer.rank), msg.capability)
        if not why:
            assert peer is not None
            self.port.on_remote_abort(msg, (peer.engine_id, peer.rank), self.writes_to(peer))
            return
        self.port.bump(Count.ABORTS_IGNORED)
        who = f"D {peer.engine_id} rank {peer.rank}" if peer is not None else "an unknown D rank"
        held = self._throttle.note(("abort", peer.key if peer is not None else ""), now)
        if held is not None:
            more = f" ({held} more ignored since the last line)" if held else ""
            log.warning("%s: ignored an abort of %s from %s: %s%s", self.name, msg.transfer_id, who, why, more)

    def check(self, now: float) -> None:
        """Forget D ranks silent for ``peer_dead_s``, as this P rank watched (``kvpush.prefill.liveness``): the
        first look after its own stall blames nobody for it."""
        stall = self.lookout.look(now)
        if stall:
            self.port.bump(Count.STALLS)
        if stall and self._peers:
            log.warning(
                "%s: looked at its D ranks again after %.1fs (this P rank stalled): their silence is counted from now",
                self.name,
                stall,
            )
        for key, peer in list(self._peers.items()):
            silent = self.lookout.silence(peer.last_seen, now)
            if silent > self.cfg.polling.peer_dead_s:
                self.port.bump(Count.DEAD_PEERS)
                self._drop(key, f"silent for {silent:.1f}s: declared dead", now)

    def _drop(self, key: DKey, why: str, now: float) -> None:
        """Forget a D rank: abort the transfers it registered for and unload its NIXL agent."""
        peer = self._peers.pop(key)
        self.admission.remove(peer.key, key)
        log.warning("%s: D %s rank %d %s", self.name, key[0], key[1], why)
        self.port.drop_peer(key, f"D {key[0]} rank {key[1]} {why}", now)
        if not any(p.agent == peer.agent for p in self._peers.values()):
            self.agent.remove_peer(peer.agent, now)
        if self.maps is not None and peer.mapped is not None:
            self.maps.retire(peer.mapped)

    def _on_hello(self, ident: bytes, key: str, msg: protocol.Hello, now: float) -> None:
        """A hello judged (``kvpush.prefill.hello.judge_hello``), then carried out: a refusal answered (and
        logged, once per interval per key, unless busy), an ok one loads D's NIXL metadata first."""
        dkey = (msg.engine_id, msg.rank)
        known = self._peers.get(dkey)
        said = self._of_ident(ident)
        verdict = judge_hello(
            self.local,
            msg,
            key,
            held_by=known.key if known is not None else None,
            said_as=(said.engine_id, said.rank) if said is not None else None,
            writing=self.port.writing_to(dkey),
            admission=self.admission,
            declared=self.declared(key) if key else None,
            holdings=self.holdings(key) if key else (),
        )
        if isinstance(verdict, HelloRefused):
            self._log_refused(key, msg, verdict, now)
            busy = verdict.refusal is Refusal.BUSY
            self.server.send(ident, protocol.HelloReply(ok=False, reason=verdict.reason, epoch=msg.epoch, busy=busy))
            return
        if verdict.replaces:
            # The same D rank says hello again: it restarted (or declared this P
            # dead and came back). Its old registrations point into memory of a
            # previous session, and NIXL refuses to load an agent name twice.
            self._drop(dkey, "said hello again (restarted?)", now)
        try:
            greeting = protocol.encode(protocol.Heartbeat(self.engine_id, self.rank, 0, time.time()))
            agent_name = self.agent.add_peer(msg.agent_metadata, msg.agent_name, greeting)
        except Exception as exc:
            reason = f"cannot load D's NIXL metadata: {exc}"
            self.server.send(ident, protocol.HelloReply(ok=False, reason=reason, epoch=msg.epoch))
            return
        self.admission.add(key, dkey, len(msg.agent_metadata))
        mapped = self.maps.open(msg.peer, msg.layout) if self.maps is not None and msg.peer else None
        if mapped is None:  # NIXL WRITEs: D's prepared list for by-index posts, made once per load
            by_index.prepare_peer(self.agent, self.layout, agent_name, msg.layout)
        if mapped is not None:
            # No WRITE will connect to this D rank: the greeting starts the connection its first part's
            # notification needs (D ignores it), while the hello is answered.
            self.agent.send_notif(agent_name, greeting)
        link_key = secrets.token_bytes(seal.KEY_BYTES)  # this session's, so nothing of an earlier one verifies
        self._peers[dkey] = Peer(
            ident,
            key,
            msg.engine_id,
            msg.rank,
            msg.tp_size,
            agent_name,
            msg.layout,
            msg.staging,
            now,
            msg.staging_mem or msg.layout.mem,
            mapped,
            Sealer(link_key, msg.epoch),
        )
        # What this P rank speaks, before the answer that makes the link ready: D offers what it brings (a ring)
        # only to a P that said so; a D of an older protocol drops this one frame, saying why. Then the key of
        # this session's seals (``kvpush.prefill.seals``), which such a D drops likewise.
        self.server.send(ident, protocol.Features(protocol.PROTOCOL_VERSION, self.rank, msg.epoch))
        self.server.send(ident, protocol.LinkKey(link_key, msg.epoch))
        self.server.send(ident, self._welcome(msg.epoch, mapped is not None))

    def _log_refused(self, key: str, msg: protocol.Hello, verdict: HelloRefused, now: float) -> None:
        """A refused hello, logged once per interval per key and kind (a busy one is not: D says it again)."""
        if verdict.refusal is Refusal.BUSY:
            return
        held = self._throttle.note(("refused" if verdict.refusal is Refusal.INCOMPATIBLE else "hello", key), now)
        if held is None:
            return
        more = f" ({held} more since the last line)" if held else ""
        if verdict.refusal is Refusal.INCOMPATIBLE:
            who = f" (D key {short(key)})" if key else ""
            log.warning(
                "%s: refused D %s rank %d%s: %s%s", self.name, msg.engine_id, msg.rank, who, verdict.reason, more
            )
        else:
            log.warning("%s: refused a hello: %s%s", self.name, verdict.reason, more)

    def _welcome(self, epoch: int, peer_copies: bool) -> protocol.HelloReply:
        """The ok answer to a hello: who this P rank is, its NIXL agent, its KV layout and whether it writes
        this D rank with peer copies."""
        return protocol.HelloReply(
            ok=True,
            engine_id=self.engine_id,
            rank=self.rank,
            tp_size=self.tp_size,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            layout=self.layout,
            epoch=epoch,
            peer_copies=peer_copies,
        )
