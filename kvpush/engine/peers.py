"""P's side of the side channel: which D ranks said hello, and what their messages may do.

A D rank must say hello (compatible model and layout, loadable NIXL
metadata) before P takes its registrations; a registration is checked
against what that D rank said it has (block ids, groups, staging) before it
reaches the rendezvous. A D rank silent for ``peer_dead_s`` is forgotten,
and so is one that says hello again (it restarted: its old registrations
point into memory of a previous session). The transfer rules stay in the
sender's machines; this table only decides who is heard.

Who a peer is comes from the side channel's authentication: every message
carries the D key its connection proved (``kvpush.transport.auth``). A D
rank's name (engine id, rank) belongs to the key that said hello with it, so
a hello under another D rank's name from a different key is refused (it
would otherwise drop that rank and its transfers); registrations carry their
key to the rendezvous, which binds each transfer to it; an abort counts only
from the key that registered the transfer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.config import Config
from kvpush.core import peek, protocol
from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, MemKind, check_compatible
from kvpush.core.limits import Throttle
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.topology import targets_for
from kvpush.engine.ports import PeerPort
from kvpush.observability.metrics import Count
from kvpush.prefill.admission import Admission, KeyLimits, block_ceiling, metadata_problem
from kvpush.prefill.push_job import DKey
from kvpush.prefill.rendezvous import Rendezvous
from kvpush.transport.auth import LOG_EVERY_S, short
from kvpush.transport.interop import peer_problem
from kvpush.transport.nixl_agent import Agent
from kvpush.transport.side_channel import Server

log = logging.getLogger(__name__)

UNKNOWN_PEER_BLOCKS = 4096
"""Block ids per group a registration from a connection that said no hello may list and still be decoded
(to be answered with a refusal naming why); larger ones are dropped unread."""


@dataclass
class Peer:
    """A D rank that said hello."""

    ident: bytes
    key: str  # the D key this rank's connection proved ("" with auth none)
    engine_id: str
    rank: int
    tp_size: int
    agent: str
    layout: KVLayout
    staging: Any
    last_seen: float
    staging_mem: MemKind = MemKind.DRAM
    """Memory kind of ``staging``: what NIXL is told for the remote side of a staged WRITE."""


class PeerTable:
    """The D ranks one P rank knows, keyed by (engine id, rank).

    Made with the engine's agent and side channel (``Sender.setup``): ``name``, ``engine_id``, ``rank``,
    ``tp_size``, ``layout``: this P rank's; ``server``: its side channel; ``agent``: its NIXL agent, which
    loads each D rank's; ``rdv``: the rendezvous, asked what a key holds and who may abort; ``port``: what the
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
        rdv: Rendezvous,
        port: PeerPort,
        declared_ranks: Callable[[str], int | None] = lambda key: None,
    ) -> None:
        self.name, self.cfg, self.engine_id, self.rank, self.tp_size = name, cfg, engine_id, rank, tp_size
        self.server, self.agent, self.rdv, self.port = server, agent, rdv, port
        self.layout = layout
        self.groups = 1 + max(r.group for r in layout.regions)
        """KV-cache groups of this P's layout (once: every registration is checked against it)."""
        self._peers: dict[DKey, Peer] = {}
        self._throttle = Throttle(LOG_EVERY_S)
        self.admission = Admission(KeyLimits(cfg.peer_key_bytes, cfg.peer_max_ranks))
        """What each D key makes this P rank hold, as a whole (``kvpush.prefill.admission``)."""
        self.declared = declared_ranks
        """The ranks a D key's key set declares (None: it declares none); ``kvpush.transport.auth``."""

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, key: DKey) -> Peer | None:
        return self._peers.get(key)

    def ident_of(self, key: DKey) -> bytes | None:
        peer = self._peers.get(key)
        return peer.ident if peer is not None else None

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
        peer = next((p for p in self._peers.values() if p.ident == ident), None)
        if peer is not None:
            peer.last_seen = now
        if isinstance(msg, protocol.Heartbeat):
            # Only known peers get an answer: a D rank whose hello this P never
            # saw (P restarted) then sees P fall silent and says hello again.
            if peer is not None:
                self.server.send(ident, protocol.Heartbeat(self.engine_id, self.rank, msg.seq, time.time()))
        elif isinstance(msg, protocol.Register):
            self.port.bump(Count.REGISTRATIONS)
            problem = self._check_register(peer, msg) or self._over_budget(peer, msg)
            if problem is not None:
                self.port.fail(ident, msg, problem)
            else:
                assert peer is not None
                self.port.on_register(ident, msg, now, peer.key, self.block_cap(peer))
        elif isinstance(msg, protocol.Abort):
            self._on_abort(peer, msg, now)
        else:
            log.warning("%s: unexpected %s on the side channel", self.name, type(msg).__name__)

    def admits(self, ident: bytes, key: str, frame: memoryview) -> bool:
        """Whether to decode this frame: a registration listing more block ids than its D rank has blocks
        (or more groups than there are) is dropped unread, logged once per interval per peer. Decoded,
        each id is a Python int: such a frame would cost hundreds of MB before it could be refused."""
        counts = peek.block_id_counts(frame)
        if counts is None:
            return True
        peer = next((p for p in self._peers.values() if p.ident == ident), None)
        most = self.most_blocks(peer) if peer is not None else UNKNOWN_PEER_BLOCKS
        groups = self.groups
        if len(counts) <= groups and max(counts, default=0) <= most:
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

    def most_blocks(self, peer: Peer) -> int:
        """The most block ids one group of a registration from ``peer`` may list: what P's own cache can
        prefill (``admission.block_ceiling``), and no more than the blocks the D rank said it has."""
        ceiling = block_ceiling(self.layout.num_blocks, self.layout.block_size, peer.layout.block_size)
        return min(peer.layout.num_blocks, ceiling)

    def block_cap(self, peer: Peer) -> int:
        """The most block ids a D rank's open registrations may hold: every block of its cache, twice (a
        re-registration's new blocks while the earlier attempt's are still being written). Only a
        tightening: the D rank's claim can lower it, never raise what its key may make P hold
        (``peer_key_bytes``, which counts every block id)."""
        return 2 * self.groups * peer.layout.num_blocks

    def holdings(self, key: str) -> list[tuple[int, int]]:
        """(open registrations, block ids) of each D rank name of ``key``."""
        held = self.rdv.holdings.held
        return [held(dkey) for dkey, p in self._peers.items() if p.key == key]

    def _on_abort(self, peer: Peer | None, msg: protocol.Abort, now: float) -> None:
        """An abort counts only from the key that registered the transfer (``Rendezvous.may_abort``); others
        are counted, logged once per interval per peer, and leave nothing behind."""
        if peer is None:
            why = "from a connection that never said hello"
        else:
            why = self.rdv.may_abort(msg.transfer_id, peer.key, (peer.engine_id, peer.rank), msg.capability)
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
        """Forget D ranks silent for ``peer_dead_s``."""
        for key, peer in list(self._peers.items()):
            if now - peer.last_seen > self.cfg.peer_dead_s:
                self.port.bump(Count.DEAD_PEERS)
                self._drop(key, f"silent for {now - peer.last_seen:.1f}s: declared dead", now)

    def _drop(self, key: DKey, why: str, now: float) -> None:
        """Forget a D rank: abort the transfers it registered for and unload its NIXL agent."""
        peer = self._peers.pop(key)
        self.admission.remove(peer.key, key)
        log.warning("%s: D %s rank %d %s", self.name, key[0], key[1], why)
        self.port.drop_peer(key, f"D {key[0]} rank {key[1]} {why}", now)
        if not any(p.agent == peer.agent for p in self._peers.values()):
            self.agent.remove_peer(peer.agent)

    def _on_hello(self, ident: bytes, key: str, msg: protocol.Hello, now: float) -> None:
        reason = self._hello_problem(msg)
        if reason:
            held = self._throttle.note(("refused", key), now)
            if held is not None:
                more = f" ({held} more since the last line)" if held else ""
                who = f" (D key {short(key)})" if key else ""
                log.warning("%s: refused D %s rank %d%s: %s%s", self.name, msg.engine_id, msg.rank, who, reason, more)
            self.server.send(ident, protocol.HelloReply(ok=False, reason=reason, epoch=msg.epoch))
            return
        dkey = (msg.engine_id, msg.rank)
        known = self._peers.get(dkey)
        reason = self._name_problem(ident, key, dkey, known, msg.agent_metadata)
        if reason:
            held = self._throttle.note(("hello", key), now)
            if held is not None:
                more = f" ({held} more since the last line)" if held else ""
                log.warning("%s: refused a hello: %s%s", self.name, reason, more)
            self.server.send(ident, protocol.HelloReply(ok=False, reason=reason, epoch=msg.epoch))
            return
        # A hello answered ok fences the D rank's earlier session (D releases blocks it quarantined): so no
        # WRITE of it may still fly, whether P still knows the rank or already forgot it.
        if self.port.writing_to(dkey):
            reason = "an earlier session of this D rank still has WRITEs in flight; say hello again shortly"
            self.server.send(ident, protocol.HelloReply(ok=False, reason=reason, epoch=msg.epoch, busy=True))
            return
        if known is not None:
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
        )
        self.server.send(ident, self._welcome(msg.epoch))

    def _hello_problem(self, msg: protocol.Hello) -> str:
        """Why D's hello cannot be accepted on what it declares ("" when it can): a different model, a NIXL
        P's cannot write to, or a KV layout P cannot write into or that is malformed, would fail or corrupt
        every push, so it is refused up front; so is NIXL metadata that is not what NIXL makes for the
        buffers the hello declares (its KV regions and staging), which P would hold for as long as the
        D rank is known."""
        regions = len(msg.layout.regions) + len(msg.layout.states) + 1
        meta = metadata_problem(msg.agent_metadata, regions)
        if meta:
            return meta
        model = self.cfg.model
        if model and msg.model and msg.model != model:
            return f"model differs: P serves {model!r}, D serves {msg.model!r}"
        agent = self.agent
        nixl = peer_problem(agent.nixl_version, agent.backends, msg.nixl_version, msg.nixl_backends)
        if nixl:
            return nixl
        try:
            check_compatible(self.layout, msg.layout)
            msg.layout.validate()
        except LayoutError as exc:
            return str(exc)
        return ""

    def _welcome(self, epoch: int) -> protocol.HelloReply:
        """The ok answer to a hello: who this P rank is, its NIXL agent and its KV layout."""
        return protocol.HelloReply(
            ok=True,
            engine_id=self.engine_id,
            rank=self.rank,
            tp_size=self.tp_size,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            layout=self.layout,
            epoch=epoch,
        )

    def _name_problem(self, ident: bytes, key: str, dkey: DKey, known: Peer | None, meta: bytes) -> str:
        """Why a hello under the D rank name ``dkey`` is refused ("" if it is not): the name belongs to another
        key; the connection said hello under another name; the key is known under as many names as it may be,
        or one more would put it over its bytes (``kvpush.prefill.admission``)."""
        if known is not None and known.key != key:
            # Another key claims a D rank's name: refused, or it could drop that rank and its transfers.
            return (
                f"D {dkey[0]} rank {dkey[1]} is connected under another D key; a D rank's name belongs to "
                f"the key that said hello with it until it is silent for peer_dead_s ({self.cfg.peer_dead_s:g} s)"
            )
        other = next((p for p in self._peers.values() if p.ident == ident), None)
        if other is not None and (other.engine_id, other.rank) != dkey:
            return f"this connection said hello as D {other.engine_id} rank {other.rank} already (one D rank each)"
        if key:
            return self.admission.hello(key, dkey, len(meta), self.declared(key), self.holdings(key))
        return ""

    def _check_register(self, peer: Peer | None, reg: protocol.Register) -> Failed | None:
        """Why this registration cannot be taken, or None."""
        if peer is None or (peer.engine_id, peer.rank) != (reg.engine_id, reg.rank):
            why = "registration before a successful hello from this D rank"
            return Failed(Stage.REGISTER, Cause.REFUSED, why)
        problem = registration_problem(self.layout, peer.layout, peer.staging, reg, self.groups)
        if not problem:
            most = self.most_blocks(peer)
            longest = max((len(ids) for ids in reg.block_ids), default=0)
            if longest > most:
                problem = f"a group lists {longest} block ids; a prompt this P can prefill needs at most {most}"
        return Failed(Stage.REGISTER, Cause.BAD_REGISTRATION, problem) if problem else None

    def _over_budget(self, peer: Peer | None, reg: protocol.Register) -> Failed | None:
        """Would this registration put its D key over what a key may make P hold (``peer_key_bytes``)?
        Counted as one more registration (a re-registration replaces one: it is counted so too, which errs
        on the side of P)."""
        if peer is None or not peer.key:
            return None
        why = self.admission.register(peer.key, self.holdings(peer.key), sum(len(g) for g in reg.block_ids))
        return Failed(Stage.REGISTER, Cause.OVER_LIMIT, why) if why else None


def registration_problem(
    layout: KVLayout, d_layout: KVLayout, d_staging: Any, reg: protocol.Register, groups: int = 0
) -> str:
    """What is wrong with D's registration given what D said it has ("" if nothing); ``groups``: the
    layout's KV-cache groups, when the caller knows them."""
    groups = groups or 1 + max(r.group for r in layout.regions)
    if len(reg.block_ids) != groups:
        return f"registration has {len(reg.block_ids)} block groups, layout has {groups}"
    need = -(-reg.num_tokens // d_layout.block_size)
    for g, ids in enumerate(reg.block_ids):
        want = 1 if d_layout.state_of(g) is not None else need  # a state group: one running-state block
        if len(ids) < want:
            return f"group {g} has {len(ids)} blocks, {want} needed for {reg.num_tokens} tokens"
        # Every id, not only those the tokens need: a registration is held by P (a lease), and one D
        # rank's blocks are what it may make P hold.
        if len(ids) > d_layout.num_blocks:
            return f"group {g} lists {len(ids)} block ids, D has {d_layout.num_blocks} blocks"
        top = int(np.max(ids)) if len(ids) else 0
        if top >= d_layout.num_blocks:
            return f"group {g} block id {top} out of range (D has {d_layout.num_blocks} blocks)"
    if reg.staging is not None:
        cap = d_staging.size if d_staging is not None else 0
        if reg.staging.offset + reg.staging.size > cap:
            grant = f"[{reg.staging.offset}, +{reg.staging.size})"
            return f"staging grant {grant} outside D's staging region ({cap} bytes)"
    return ""
