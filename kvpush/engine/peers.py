"""P's side of the side channel: which D ranks said hello, and what their messages may do.

A D rank must say hello (compatible model and layout, loadable NIXL
metadata) before P takes its registrations; a registration is checked
against what that D rank said it has (block ids, groups, staging) before it
reaches the rendezvous. A D rank silent for ``peer_dead_s`` is forgotten,
and so is one that says hello again (it restarted: its old registrations
point into memory of a previous session). The transfer rules stay in the
sender's machines; this table only decides who is heard.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush import protocol
from kvpush.errors import LayoutError
from kvpush.layout import KVLayout, MemKind, check_compatible
from kvpush.metrics import Count
from kvpush.outcome import Cause, Failed, Stage
from kvpush.push_job import DKey
from kvpush.topology import targets_for

if TYPE_CHECKING:
    from kvpush.engine.sender import Sender

log = logging.getLogger(__name__)


@dataclass
class Peer:
    """A D rank that said hello."""

    ident: bytes
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
    """The D ranks one P rank knows, keyed by (engine id, rank)."""

    def __init__(self, sender: Sender, layout: KVLayout) -> None:
        self.sender = sender
        self.layout = layout
        self._peers: dict[DKey, Peer] = {}

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
        s = self.sender
        return bool(targets_for(s.rank, s.tp_size, peer.tp_size, self.layout.num_heads))

    def expected(self, reg: protocol.Register) -> int:
        """How many D ranks of the registering instance this P rank writes to."""
        peer = self._peers[(reg.engine_id, reg.rank)]
        s = self.sender
        return max(1, len(targets_for(s.rank, s.tp_size, peer.tp_size, self.layout.num_heads)))

    def on_message(self, ident: bytes, msg: Any, now: float) -> None:
        s = self.sender
        if isinstance(msg, protocol.Hello):
            self._on_hello(ident, msg, now)
            return
        if isinstance(msg, protocol.TimeQuery):
            # Anyone may ask the time (``kvpush doctor --peer``): it reveals nothing else.
            s.server.send(ident, protocol.TimeReply(msg.seq, msg.sent_at, time.time()))
            return
        peer = next((p for p in self._peers.values() if p.ident == ident), None)
        if peer is not None:
            peer.last_seen = now
        if isinstance(msg, protocol.Heartbeat):
            # Only known peers get an answer: a D rank whose hello this P never
            # saw (P restarted) then sees P fall silent and says hello again.
            if peer is not None:
                s.server.send(ident, protocol.Heartbeat(s.engine_id, s.rank, msg.seq, time.time()))
        elif isinstance(msg, protocol.Register):
            s.bump(Count.REGISTRATIONS)
            problem = self._check_register(peer, msg)
            if problem is not None:
                s.fail(ident, msg, problem)
            else:
                s.on_register(ident, msg, now)
        elif isinstance(msg, protocol.Abort):
            s.on_remote_abort(msg, self.writes_to(peer))
        else:
            log.warning("%s: unexpected %s on the side channel", s.name, type(msg).__name__)

    def check(self, now: float) -> None:
        """Forget D ranks silent for ``peer_dead_s``."""
        for key, peer in list(self._peers.items()):
            if now - peer.last_seen > self.sender.cfg.peer_dead_s:
                self.sender.bump(Count.DEAD_PEERS)
                self._drop(key, f"silent for {now - peer.last_seen:.1f}s: declared dead", now)

    def _drop(self, key: DKey, why: str, now: float) -> None:
        """Forget a D rank: abort the transfers it registered for and unload its NIXL agent."""
        peer = self._peers.pop(key)
        log.warning("%s: D %s rank %d %s", self.sender.name, key[0], key[1], why)
        self.sender.drop_peer(key, f"D {key[0]} rank {key[1]} {why}", now)
        if not any(p.agent == peer.agent for p in self._peers.values()):
            self.sender.agent.remove_peer(peer.agent)

    def _on_hello(self, ident: bytes, msg: protocol.Hello, now: float) -> None:
        s = self.sender
        reason = ""
        if s.cfg.model and msg.model and msg.model != s.cfg.model:
            reason = f"model differs: P serves {s.cfg.model!r}, D serves {msg.model!r}"
        else:
            try:
                check_compatible(self.layout, msg.layout)
                msg.layout.validate()
            except LayoutError as exc:
                reason = str(exc)
        if reason:
            log.warning("%s: refused D %s rank %d: %s", s.name, msg.engine_id, msg.rank, reason)
            s.server.send(ident, protocol.HelloReply(ok=False, reason=reason))
            return
        key = (msg.engine_id, msg.rank)
        if key in self._peers:
            # The same D rank says hello again: it restarted (or declared this P
            # dead and came back). Its old registrations point into memory of a
            # previous session, and NIXL refuses to load an agent name twice.
            if s.writing_to(key):
                reason = "an earlier session of this D rank still has WRITEs in flight; say hello again shortly"
                s.server.send(ident, protocol.HelloReply(ok=False, reason=reason))
                return
            self._drop(key, "said hello again (restarted?)", now)
        try:
            agent_name = s.agent.add_peer(msg.agent_metadata)
        except Exception as exc:
            s.server.send(ident, protocol.HelloReply(ok=False, reason=f"cannot load D's NIXL metadata: {exc}"))
            return
        self._peers[key] = Peer(
            ident,
            msg.engine_id,
            msg.rank,
            msg.tp_size,
            agent_name,
            msg.layout,
            msg.staging,
            now,
            msg.staging_mem or msg.layout.mem,
        )
        reply = protocol.HelloReply(
            ok=True,
            engine_id=s.engine_id,
            rank=s.rank,
            tp_size=s.tp_size,
            agent_name=s.agent.name,
            agent_metadata=s.agent.metadata(),
            layout=self.layout,
        )
        s.server.send(ident, reply)

    def _check_register(self, peer: Peer | None, reg: protocol.Register) -> Failed | None:
        """Why this registration cannot be taken, or None."""
        if peer is None or (peer.engine_id, peer.rank) != (reg.engine_id, reg.rank):
            why = "registration before a successful hello from this D rank"
            return Failed(Stage.REGISTER, Cause.REFUSED, why)
        problem = registration_problem(self.layout, peer.layout, peer.staging, reg)
        return Failed(Stage.REGISTER, Cause.BAD_REGISTRATION, problem) if problem else None


def registration_problem(layout: KVLayout, d_layout: KVLayout, d_staging: Any, reg: protocol.Register) -> str:
    """What is wrong with D's registration given what D said it has ("" if nothing)."""
    groups = 1 + max(r.group for r in layout.regions)
    if len(reg.block_ids) != groups:
        return f"registration has {len(reg.block_ids)} block groups, layout has {groups}"
    need = -(-reg.num_tokens // d_layout.block_size)
    for g, ids in enumerate(reg.block_ids):
        if len(ids) < need:
            return f"group {g} has {len(ids)} blocks, {need} needed for {reg.num_tokens} tokens"
        if ids and max(ids[:need], default=0) >= d_layout.num_blocks:
            return f"group {g} block id {max(ids[:need])} out of range (D has {d_layout.num_blocks} blocks)"
    if reg.staging is not None:
        cap = d_staging.size if d_staging is not None else 0
        if reg.staging.offset + reg.staging.size > cap:
            grant = f"[{reg.staging.offset}, +{reg.staging.size})"
            return f"staging grant {grant} outside D's staging region ({cap} bytes)"
    return ""
