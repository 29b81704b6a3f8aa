"""The orders the scheduler half hands the workers each step (``StepOrders``), as plain values.

Rule: one step's orders are built by ``scheduler_side.SchedulerSide`` in
vLLM's scheduler process and read by ``worker_side.WorkerSide`` in each
worker; this module holds only the values they share. Reason: both halves
import it without importing each other, and it imports neither vLLM nor the
engine, so the orders pickle with vLLM's metadata and are tested as data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.core.outcome import PrefillState


@dataclass(frozen=True)
class Registration:
    request_id: str
    transfer_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    start_token: int
    skip_blocks: tuple[int, ...] = ()  # per KV-cache group: leading blocks D does not hold (a sliding window's)
    capability: str = field(default="", repr=False)  # the transfer's (never logged)


@dataclass(frozen=True)
class FinishedPrefill:
    request_id: str
    transfer_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


@dataclass(frozen=True)
class AbortOrder:
    request_id: str
    transfer_id: str
    side: str  # "prefill" or "decode"


@dataclass(frozen=True)
class CancelOrder:
    """A D request that ended before it got blocks: P's ranks are told, so a parked prefill is freed now."""

    request_id: str
    transfer_id: str
    host: str
    port: int
    tp_size: int
    capability: str = field(default="", repr=False)


@dataclass(frozen=True)
class PrefillStateOrder:
    """Where P's scheduler holds a prefill: queued behind ``tokens_ahead`` prompt tokens, or running."""

    transfer_id: str
    state: PrefillState
    tokens_ahead: int


@dataclass(frozen=True)
class FenceOrder:
    """The operator declared the P instance whose ranks listen from ``host:port`` (``tp_size`` ranks) gone for
    good (``kvpush fence``): every worker ends its writers on those ranks (``Receiver.fence``)."""

    host: str
    port: int
    tp_size: int
    reason: str


@dataclass
class StepOrders:
    """What the scheduler tells the workers this step (wrapped in vLLM's metadata type)."""

    registrations: list[Registration] = field(default_factory=list)
    prefills: list[FinishedPrefill] = field(default_factory=list)
    aborts: list[AbortOrder] = field(default_factory=list)
    cancels: list[CancelOrder] = field(default_factory=list)
    """D requests that never registered (aborted while waiting for blocks): tell P to drop the prefill."""
    layer_prefills: list[FinishedPrefill] = field(default_factory=list)
    """Prefills whose final chunk runs in this step's forward: pushed layer by layer as it goes."""
    prefill_states: list[PrefillStateOrder] = field(default_factory=list)
    """P: prefills whose place in P's scheduler changed (D's registrations are acknowledged with it)."""
    fences: list[FenceOrder] = field(default_factory=list)
    """D: P instances the operator fenced for good since the last step (``kvpush.decode.fence``)."""
