"""P's rules on whom it hears (sans-I/O): a D rank's hello judged, and each registration checked against what
its D rank said in it.

A D rank must say hello (compatible model and layout, loadable NIXL
metadata) before P takes its registrations; a registration is checked
against what that D rank said it has (block ids, groups, staging) before it
reaches the rendezvous.

A D rank's name (engine id, rank) belongs to the key that said hello with
it, so a hello under another D rank's name from a different key is refused:
it would otherwise drop that rank and its transfers. The same key saying
hello again under its name replaces the earlier session (the D rank
restarted: its old registrations point into memory of a previous session).
One connection says hello under one name. What each key may make P hold is
``kvpush.prefill.admission``'s.

Inputs in, a verdict out: ``judge_hello`` answers ``HelloOk`` or
``HelloRefused`` (with the kind of refusal, which decides how the shell logs
and answers it); ``judge_register`` answers None or the ``Failed`` the D
rank is told. Loading D's NIXL metadata, the replies and the peer records
stay with the shell (``kvpush.engine.peers``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.core import protocol
from kvpush.core.errors import LayoutError
from kvpush.core.interop import peer_problem
from kvpush.core.layout import KVLayout, MemKind, check_compatible
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.prefill.admission import Admission, block_ceiling, metadata_problem
from kvpush.prefill.push_job import DKey
from kvpush.prefill.seals import Sealer

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
    mapped: Any = None
    """P's backend's handle on this D rank's KV (``PeerCopy.open_peer``): its pushes are peer copies; None:
    NIXL WRITEs."""
    sealer: Sealer | None = None
    """The seals of this session's NIXL notifications (``kvpush.prefill.seals``); None: sent unsealed."""

    def seal(self, notif: bytes) -> bytes:
        """What to send this D rank for notification ``notif``: sealed where it checks seals, else as is."""
        return self.sealer.seal(notif) if self.sealer is not None else notif


@dataclass(frozen=True)
class Local:
    """This P rank, as a hello is judged against it: the model it serves (""; any), its KV layout, its NIXL
    version and backends, and how long a silent D rank keeps its name (``peer_dead_s``)."""

    model: str
    layout: KVLayout
    nixl_version: str
    nixl_backends: tuple[str, ...]
    peer_dead_s: float


class Refusal(enum.Enum):
    """Why a hello is refused, as far as the shell cares (how it logs and answers it)."""

    INCOMPATIBLE = "incompatible"  # what the hello declares cannot work with this P rank
    NAME = "name"  # the name is another key's, the connection has another name, or the key is at its limit
    BUSY = "busy"  # an earlier session of this D rank still has WRITEs in flight: say hello again shortly


@dataclass(frozen=True)
class HelloOk:
    """Take the hello (once D's NIXL metadata loads); ``replaces``: the same key's earlier session under this
    name is dropped first."""

    replaces: bool


@dataclass(frozen=True)
class HelloRefused:
    reason: str
    refusal: Refusal


HelloVerdict = HelloOk | HelloRefused


def declared_problem(local: Local, msg: protocol.Hello) -> str:
    """Why D's hello cannot be accepted on what it declares ("" when it can): a different model, a NIXL
    P's cannot write to, or a KV layout P cannot write into or that is malformed, would fail or corrupt
    every push, so it is refused up front; so is NIXL metadata that is not what NIXL makes for the
    buffers the hello declares (its KV regions and staging), which P would hold for as long as the
    D rank is known."""
    regions = len(msg.layout.regions) + len(msg.layout.states) + 1
    meta = metadata_problem(msg.agent_metadata, regions)
    if meta:
        return meta
    if local.model and msg.model and msg.model != local.model:
        return f"model differs: P serves {local.model!r}, D serves {msg.model!r}"
    nixl = peer_problem(local.nixl_version, local.nixl_backends, msg.nixl_version, msg.nixl_backends)
    if nixl:
        return nixl
    try:
        check_compatible(local.layout, msg.layout)
        msg.layout.validate()
    except LayoutError as exc:
        return str(exc)
    return ""


def name_problem(
    local: Local,
    dkey: DKey,
    key: str,
    held_by: str | None,
    said_as: DKey | None,
    admission: Admission,
    declared: int | None,
    holdings: Sequence[tuple[int, int]],
    metadata_bytes: int,
) -> str:
    """Why a hello of ``key`` under the D rank name ``dkey`` is refused ("" if it is not): the name belongs to
    another key (``held_by``); the connection said hello under another name (``said_as``); the key is known
    under as many names as it may be, or one more would put it over its bytes (``Admission.hello``, given
    the ranks its key set ``declared`` and the ``holdings`` of its names)."""
    if held_by is not None and held_by != key:
        # Another key claims a D rank's name: refused, or it could drop that rank and its transfers.
        return (
            f"D {dkey[0]} rank {dkey[1]} is connected under another D key; a D rank's name belongs to "
            f"the key that said hello with it until it is silent for peer_dead_s ({local.peer_dead_s:g} s)"
        )
    if said_as is not None and said_as != dkey:
        return f"this connection said hello as D {said_as[0]} rank {said_as[1]} already (one D rank each)"
    if key:
        return admission.hello(key, dkey, metadata_bytes, declared, holdings)
    return ""


def judge_hello(
    local: Local,
    msg: protocol.Hello,
    key: str,
    *,
    held_by: str | None,
    said_as: DKey | None,
    writing: bool,
    admission: Admission,
    declared: int | None,
    holdings: Sequence[tuple[int, int]],
) -> HelloVerdict:
    """A hello of ``key`` on a connection that said hello as ``said_as`` (None: not yet), under a name held by
    ``held_by`` (None: free), while WRITEs into that name are in flight or not (``writing``).

    Checked in this order: what the hello declares; whose the name is (and the key's limits); then no
    WRITE of the name may still fly, because a hello answered ok fences the D rank's earlier session (D
    releases blocks it quarantined), whether P still knows the rank or already forgot it.
    """
    reason = declared_problem(local, msg)
    if reason:
        return HelloRefused(reason, Refusal.INCOMPATIBLE)
    dkey = (msg.engine_id, msg.rank)
    reason = name_problem(local, dkey, key, held_by, said_as, admission, declared, holdings, len(msg.agent_metadata))
    if reason:
        return HelloRefused(reason, Refusal.NAME)
    if writing:
        reason = "an earlier session of this D rank still has WRITEs in flight; say hello again shortly"
        return HelloRefused(reason, Refusal.BUSY)
    return HelloOk(replaces=held_by is not None)


# -- registrations -------------------------------------------------------------------


def most_blocks(layout: KVLayout, d_layout: KVLayout) -> int:
    """The most block ids one group of a registration from a D rank of ``d_layout`` may list: what P's own
    cache can prefill (``admission.block_ceiling``), and no more than the blocks the D rank said it has."""
    ceiling = block_ceiling(layout.num_blocks, layout.block_size, d_layout.block_size)
    return min(d_layout.num_blocks, ceiling)


def block_cap(groups: int, d_layout: KVLayout) -> int:
    """The most block ids a D rank's open registrations may hold: every block of its cache, twice (a
    re-registration's new blocks while the earlier attempt's are still being written). Only a
    tightening: the D rank's claim can lower it, never raise what its key may make P hold
    (``peer_key_bytes``, which counts every block id)."""
    return 2 * groups * d_layout.num_blocks


def frame_fits(counts: Sequence[int], groups: int, most: int) -> bool:
    """Whether a registration frame listing ``counts`` block ids per group is worth decoding: no more groups
    than there are, no group over ``most`` (``most_blocks`` of its D rank, ``UNKNOWN_PEER_BLOCKS`` for a
    connection that said no hello). Decoded, each id is a Python int: a larger frame would cost hundreds
    of MB before it could be refused."""
    return len(counts) <= groups and max(counts, default=0) <= most


def registration_problem(
    layout: KVLayout, d_layout: KVLayout, d_staging: Any, reg: protocol.Register, groups: int = 0
) -> str:
    """What is wrong with D's registration given what D said it has ("" if nothing); ``groups``: the
    layout's KV-cache groups, when the caller knows them."""
    groups = groups or layout.num_groups
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


def judge_register(
    layout: KVLayout,
    groups: int,
    peer: Peer | None,
    reg: protocol.Register,
    admission: Admission,
    holdings: Sequence[tuple[int, int]],
) -> Failed | None:
    """Why this registration from the connection of ``peer`` (None: it said no hello) cannot be taken, or None.

    Refused before a hello under the registration's own name; a bad registration (``registration_problem``,
    or a group longer than ``most_blocks``); one that would put its D key over what a key may make P hold
    (``peer_key_bytes``, given the ``holdings`` of the key's names): counted as one more registration (a
    re-registration replaces one: it is counted so too, which errs on the side of P).
    """
    if peer is None or (peer.engine_id, peer.rank) != (reg.engine_id, reg.rank):
        # A handshake failure: D says hello again and registers once more (P forgot it, silent past
        # peer_dead_s, while D's link still looked live there); any other D fails the transfer.
        why = "registration before a successful hello from this D rank"
        return Failed(Stage.HANDSHAKE, Cause.REFUSED, why)
    problem = registration_problem(layout, peer.layout, peer.staging, reg, groups)
    if not problem:
        most = most_blocks(layout, peer.layout)
        longest = max((len(ids) for ids in reg.block_ids), default=0)
        if longest > most:
            problem = f"a group lists {longest} block ids; a prompt this P can prefill needs at most {most}"
    if problem:
        return Failed(Stage.REGISTER, Cause.BAD_REGISTRATION, problem)
    if not peer.key:
        return None
    why = admission.register(peer.key, holdings, sum(len(g) for g in reg.block_ids))
    return Failed(Stage.REGISTER, Cause.OVER_LIMIT, why) if why else None
