"""How a push starts, decided in one place (pure): which slot, which pack, which plan, which parts or rounds.

At pairing P knows the prefill, D's registration (its blocks and its staging: none, a slot for the whole
payload, or a ring), the D rank's hello (its layout, its staging region, whether P maps its KV for peer
copies) and its own state (its staging region and the rule of its slots, a pack list built at hand-over,
a slot packed at hand-over). ``start_push`` turns that into a ``Start``: the plan and everything the job
is given with it, so the engine only carries it out (hints to the backend, WRITEs built ahead, the job
made). The rules, in order:

* a registration asking for more tokens than the prefill computed is refused (``BadRegistration``);
* a D rank whose KV P maps (same host, ``kvpush.backends.peer``) is written with peer copies, no slot;
* otherwise, where both sides have staging and D granted some, P takes a slot of its own from its slot
  rule (``kvpush.prefill.slots``): the slot packed at hand-over when it holds this very pack, a free
  slot of D's size, or, for D's ring, a ring of P's own with as many slots as are free (one will do);
* the plan is ``kvpush.core.plan.build_plan``'s with those slots (the cost model; a ring makes a staged
  plan one in rounds); the slot rule then keeps or frees what the plan did not take;
* the job is cut as its plan says: one slot's parts (``push_parts``, ``min_part_bytes``, the cost model
  of parts), a ring's parts (``kvpush.core.rounds``), and the forward's layers (``PartSchedule``).

No clocks, no device, no NIXL: the engine passes in the values (addresses, bandwidths, capabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.config import Config
from kvpush.core.counts import Count
from kvpush.core.errors import KVPushError
from kvpush.core.layout import KVLayout, heads_overlap
from kvpush.core.outcome import PlanKind
from kvpush.core.parts import PartSchedule, costs_of
from kvpush.core.plan import Plan, build_plan, group_tokens
from kvpush.core.protocol import Register
from kvpush.core.rounds import slice_pieces
from kvpush.prefill.decisions import Prefill
from kvpush.prefill.job_plan import JobPlan, Prepacked
from kvpush.prefill.slots import Evicted, Grant, StagingSlots
from kvpush.prefill.transfer import Transfer

CHAINED = (PlanKind.STAGED, PlanKind.PEER, PlanKind.ROUNDS)
"""Plans whose device copies a backend that chains queues behind the KV's marker (no wait on P's thread)."""


class BadRegistration(KVPushError):
    """D asks for what P cannot write (more tokens than the prefill computed)."""


@dataclass(frozen=True)
class Local:
    """This P rank, as a push's start is decided against it: its settings and layout, its staging region
    (``(address, device)``; None: none), the layer ends of its schedule, and what its backend declares (pack
    bandwidth, packs chained on the device, asynchronous copies)."""

    cfg: Config
    layout: KVLayout
    staging: tuple[int, int] | None
    layer_ends: tuple[int, ...]
    pack_bw: float
    chains: bool
    asynchronous: bool


@dataclass(frozen=True)
class Remote:
    """The D rank, as its hello said: its layout, its staging region (``(base, device)``; None: none), and
    whether P maps its KV for peer copies."""

    layout: KVLayout
    staging: tuple[int, int] | None
    mapped: bool


@dataclass(frozen=True)
class Start:
    """How a push starts: its ``job_plan`` (the plan and its cut), P's ``slot`` (None: none), the slot packed
    at hand-over it takes (``prepacked``), and what to count (``counts``)."""

    job_plan: JobPlan
    slot: int | None
    prepacked: Prepacked | None
    counts: tuple[Count, ...]

    @property
    def plan(self) -> Plan:
        return self.job_plan.plan


def start_push(
    local: Local, slots: StagingSlots, prefill: Prefill, reg: Register, peer: Remote, rec: Transfer
) -> Start:
    """The ``Start`` of the push of ``prefill`` to the D rank that sent ``reg`` (see the module's rules).

    Raises ``BadRegistration`` for a registration P cannot write, and what ``build_plan`` raises (a layout P
    cannot write into); the slot rule then gives back what it granted.
    """
    if reg.num_tokens > prefill.num_tokens:
        raise BadRegistration(f"D asks for {reg.num_tokens} tokens, P computed {prefill.num_tokens}")
    cfg, layout = local.cfg, local.layout
    tid = prefill.transfer_id
    ahead = _pack_ahead(layout, prefill, reg, peer, rec)
    grant_d = reg.staging
    both = grant_d is not None and peer.staging is not None and local.staging is not None and not peer.mapped
    d_ring = (grant_d.slots, grant_d.part_bytes) if both and grant_d is not None and grant_d.ring else None
    counts: list[Count] = []
    grant = _grant(slots.pair(tid, grant_d.size if both and grant_d is not None else None, ahead, d_ring), counts)
    local_at = remote_at = ring = None
    if grant is not None:
        assert local.staging is not None and peer.staging is not None and grant_d is not None
        local_at = (local.staging[0] + grant.offset, local.staging[1])
        remote_at = (peer.staging[0] + grant_d.offset, grant_d.size, peer.staging[1])
        if d_ring is not None and grant.slots:
            ring = (d_ring[1], d_ring[0], grant.slots)
    src_blocks: Any = prefill.block_ids[layout.token_group]
    if ahead is not None and rec.pack_ahead is not None and rec.pack_ahead.blocks is not None:
        src_blocks = rec.pack_ahead.blocks
    try:
        plan = build_plan(
            cfg,
            layout,
            peer.layout,
            src_blocks,
            reg.block_ids[peer.layout.token_group],
            reg.num_tokens,
            reg.start_token,
            staging_local=local_at,
            staging_remote=remote_at,
            pack_bw=local.pack_bw,
            groups=group_tokens(prefill.block_ids, peer.layout, reg.block_ids, reg.start_token, reg.skip_blocks),
            pack=None if peer.mapped else ahead,
            peer=peer.mapped,
            ring=ring,
        )
    except Exception:
        slots.plan_failed(tid, grant.offset if grant is not None else None)
        raise
    kept = _grant(slots.planned(tid, grant.offset if grant is not None else None, plan.kind, plan.pack), counts)
    if plan.kind in (PlanKind.STAGED, PlanKind.ROUNDS) and ahead is not None:
        counts.append(Count.PACKS_AHEAD_USED)
    prepacked = None
    if kept is not None and kept.prepack is not None:
        counts.append(Count.PACKS_AT_HAND_OVER_USED)
        took = kept.prepack
        prepacked = Prepacked(took.marker if not took.reached else None, took.after)
    counts.append(Count.plan(plan.kind))
    return Start(_job_plan(local, plan), kept.offset if kept is not None else None, prepacked, tuple(counts))


def _job_plan(local: Local, plan: Plan) -> JobPlan:
    """How the job cuts its plan: the forward's layers, one slot's parts, a ring's ranges."""
    cfg = local.cfg
    sched = PartSchedule(
        local.layer_ends, plan.region_bytes, cfg.per_layer.layerwise_min_part_bytes, cfg.per_layer.layerwise_lead_layers
    )
    chain = plan.kind in CHAINED and local.chains
    costs = costs_of(cfg, local.pack_bw, local.asynchronous)
    slices = None
    if plan.ring is not None and plan.pack is not None:
        slices = {(q0, q1): slice_pieces(plan.pack, q0, q1) for q0, q1 in plan.ring.slices()}
    return JobPlan(plan, sched, cfg.staging.push_parts, chain, cfg.staging.min_part_bytes, costs, slices)


def _grant(actions: list[Any], counts: list[Count]) -> Grant | None:
    """The slot rule's answer at pairing: parked slots taken back are counted; the slot granted, if any."""
    grant = None
    for a in actions:
        if isinstance(a, Evicted):
            counts.append(Count.PACKS_AT_HAND_OVER_EVICTED)
        elif isinstance(a, Grant):
            grant = a
    return grant


def _pack_ahead(layout: KVLayout, prefill: Prefill, reg: Register, peer: Remote, rec: Transfer) -> np.ndarray | None:
    """The pack list built at hand-over when it fits this registration (its tokens, the heads both hold)."""
    if rec.pack_ahead is None:
        return None
    return rec.pack_ahead.fits(prefill, heads_overlap(layout, peer.layout), reg.num_tokens, reg.start_token)
