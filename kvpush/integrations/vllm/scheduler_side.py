"""Scheduler half of the connector: bookkeeping only, no I/O.

It turns vLLM's scheduler hooks into a per-step ``KVPushMetadata`` (the
``orders`` module's ``StepOrders``) for the workers and tracks which
requests still hold blocks for a transfer. It takes plain values (ids, block
lists, counts; ``scheduler_inputs`` reads them from vLLM's objects), so it is
tested without an engine.

Invariants:
- a P request whose prefill finished normally keeps its blocks until every
  worker reports it in ``finished_sending``;
- a D request aborted while its KV may still be written keeps its blocks
  until the workers report the transfer fenced (also via ``finished_sending``);
- a D request whose load failed while a P rank declared dead may still write
  its blocks reaches vLLM at once (vLLM fails or recomputes it), and those
  blocks stay out of vLLM's free queue, by a reference of this half's own,
  until every worker reports them fenced (``withheld.Withheld``);
- a request without kv_transfer_params is never touched;
- layer-wise mode: a P request whose *final* prefill chunk is scheduled in a
  step is announced to the workers in that step's orders (``layer_prefills``),
  so they push each layer as the forward writes it; from then on it keeps its
  blocks until the workers report it, even if it is aborted.

Chunked prefill, layer-wise: only the final chunk triggers pushes; layer ``i``
then carries *all* the prompt's tokens of that layer (earlier chunks wrote
theirs in earlier steps). Pushing earlier chunks as they complete would need
D's registration to be there before the prefill started and a part per
(chunk, layer); the final chunk alone already takes every layer but the last
off the critical path, and the last layer's write is what TTFT still pays.
Only requests that end after their prefill (``max_tokens == 1``, what the
router sends P) go layer-wise: a request that keeps decoding on P could be
preempted with its blocks freed while a layer is being written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvpush.core.outcome import PrefillState
from kvpush.core.plan import HOLE
from kvpush.core.recurrent import dropped_tokens, loaded_tokens
from kvpush.decode.fence import Target
from kvpush.integrations.vllm.orders import (
    AbortOrder,
    CancelOrder,
    FenceOrder,
    FinishedPrefill,
    PrefillStateOrder,
    Registration,
    StepOrders,
)
from kvpush.integrations.vllm.params import DecodeSide, PrefillAdvert, PrefillSide, parse, prefill_answer
from kvpush.integrations.vllm.scheduler_inputs import ScheduledChunk
from kvpush.integrations.vllm.withheld import Withheld

log = logging.getLogger(__name__)
TRUNCATED = "_kvpush_backed_off"
"""Set in a P request's ``kv_transfer_params`` once its last prompt token was dropped (``prefill_drop``)."""


@dataclass
class _Candidate:
    """A P request that may go layer-wise once its final chunk is scheduled."""

    transfer_id: str
    num_prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)


class SchedulerSide:
    def __init__(
        self,
        layerwise: bool = False,
        layerwise_min_tokens: int = 0,
        advert: PrefillAdvert | None = None,
        max_waiting_registrations: int = 0,
        backoff: int = 0,
    ) -> None:
        self.layerwise = layerwise
        self.backoff = backoff
        """Trailing prompt tokens P leaves to D (``core.recurrent``): 1 for models with recurrent-state layers."""
        self.max_waiting = max_waiting_registrations  # D: registrations waiting on one P (0: no bound)
        self._peer_of: dict[str, tuple[str, int]] = {}  # D request registered -> its P's side channel
        self._queued: dict[str, tuple[str, int]] = {}  # P request not yet scheduled -> (transfer id, tokens)
        self._running: dict[str, str] = {}  # P request scheduled -> transfer id
        self._told: dict[str, tuple[PrefillState, int]] = {}  # transfer id -> state last told the workers
        self.advert = advert  # P: what its answer tells D (None: P returns no kv_transfer_params)
        self.layerwise_min_tokens = layerwise_min_tokens
        self._candidates: dict[str, _Candidate] = {}  # P requests before their final chunk (layer-wise)
        self._layered: dict[str, str] = {}  # P requests announced layer-wise -> transfer id
        self._orders = StepOrders()
        self._waiting_kv: dict[str, str] = {}  # D request -> transfer id, registered, KV not yet in
        self._sending: dict[str, str] = {}  # P request -> transfer id, blocks held for the push
        self._fencing: dict[str, str] = {}  # D request aborted while KV may land
        self.counters: dict[str, int] = {}
        self.withheld = Withheld()
        """D: blocks of failed loads held for a P that may still write them (``withheld``)."""

    @property
    def null_block(self) -> int | None:
        """vLLM's placeholder block id (its block pool's null block): in a hybrid model, a sliding-window group
        lists it for the blocks its window no longer needs. Set by the connector when vLLM binds the pool."""
        return self.withheld.null_block

    @null_block.setter
    def null_block(self, value: int | None) -> None:
        self.withheld.null_block = value

    def skipped(self, block_ids: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        """Leading placeholder blocks of each group (``()`` when there are none): blocks D does not hold."""
        if self.null_block is None:
            return ()
        counts = []
        for g in block_ids:
            n = 0
            while n < len(g) and g[n] == self.null_block:
                n += 1
            counts.append(n)
        return tuple(counts) if any(counts) else ()

    def holes(self, block_ids: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        """P's block ids with its placeholders as ``plan.HOLE``: blocks P no longer holds are never read."""
        if self.null_block is None:
            return block_ids
        return tuple(tuple(HOLE if b == self.null_block else b for b in g) for g in block_ids)

    def _bump(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    # D side -----------------------------------------------------------------
    def matched_tokens(
        self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int, num_computed: int
    ) -> tuple[int, bool]:
        """Tokens P will push beyond D's local prefix hit (loaded asynchronously)."""
        role = parse(params, request_id)
        if not isinstance(role, DecodeSide) or request_id in self._waiting_kv:
            return 0, False
        count = loaded_tokens(num_prompt_tokens, self.backoff) - num_computed
        if count > 0 and self.max_waiting and self.waiting_on((role.peer.host, role.peer.port)) >= self.max_waiting:
            # Late registration: the request waits in vLLM's queue holding no blocks (None: ask again next
            # step) until one of the registrations waiting on that P ends, instead of pinning blocks behind
            # P's backlog.
            self._bump("deferred_registrations")
            return None, False
        return (count, True) if count > 0 else (0, False)

    def waiting_on(self, peer: tuple[str, int]) -> int:
        """D's registrations with P ``peer`` whose KV has not arrived."""
        return sum(1 for rid in self._waiting_kv if self._peer_of.get(rid) == peer)

    def after_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: tuple[list[int], ...] | list[list[int]],
        num_computed: int,
        num_external: int,
    ) -> None:
        """D allocated blocks: register them with P now, while P still computes."""
        role = parse(params, request_id)
        if not isinstance(role, DecodeSide) or num_external <= 0 or request_id in self._waiting_kv:
            return
        ids = tuple(tuple(g) for g in block_ids)
        reg = Registration(
            request_id,
            role.transfer_id,
            role.peer.host,
            role.peer.port,
            role.peer.tp_size,
            ids,
            num_computed + num_external,
            num_computed,
            self.skipped(ids) if len(ids) > 1 else (),
            role.capability,
        )
        self._orders.registrations.append(reg)
        self.withheld.registered(request_id, ids)
        log.debug("kvpush scheduler: register %s", reg)
        self._waiting_kv[request_id] = role.transfer_id
        self._peer_of[request_id] = (role.peer.host, role.peer.port)
        self._bump("registrations")
        if params is not None:
            # vLLM may ask again after the load; nothing more is remote then.
            params["do_remote_prefill"] = False

    # P side: where each prefill stands ---------------------------------------------
    def prefill_drop(
        self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int, whole: bool = False
    ) -> int:
        """Trailing prompt tokens P must not compute for this request (``kvpush.core.recurrent.dropped_tokens``).

        A P request (``do_remote_decode``) of a model with state layers drops
        its last prompt token once; the params remember it (``TRUNCATED``), so
        a preempted request that comes back is not shortened again. ``whole``:
        the request reads no prefix cache (prompt logprobs), so D loads none of
        it and P keeps its whole prompt (its answer then stays right).
        """
        if whole or not self.backoff or not isinstance(parse(params, request_id), PrefillSide):
            return 0
        assert params is not None
        drop = dropped_tokens(num_prompt_tokens, self.backoff, bool(params.get(TRUNCATED)))
        if drop:
            params[TRUNCATED] = True
            self._bump("prefill_backoffs")
        return drop

    def prefill_arrived(self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int) -> None:
        """vLLM's ``on_new_request``: a P request joins the waiting queue (in arrival order)."""
        role = parse(params, request_id)
        if isinstance(role, PrefillSide):
            self._queued[request_id] = (role.transfer_id, num_prompt_tokens)

    def step_states(self, scheduled: set[str]) -> None:
        """This step's scheduled requests: P requests among them run, the others queue behind the prompt
        tokens that arrived before them. Only changes are ordered (D acknowledges them)."""
        for rid in [r for r in self._queued if r in scheduled]:
            tid, _ = self._queued.pop(rid)
            self._running[rid] = tid
            self._tell(tid, PrefillState.RUNNING, 0)
        ahead = 0
        for tid, tokens in self._queued.values():
            self._tell(tid, PrefillState.QUEUED, ahead)
            ahead += tokens

    def _tell(self, tid: str, state: PrefillState, ahead: int) -> None:
        if self._told.get(tid) != (state, ahead):
            self._told[tid] = (state, ahead)
            self._orders.prefill_states.append(PrefillStateOrder(tid, state, ahead))

    def _forget(self, request_id: str) -> None:
        tid = self._running.pop(request_id, None)
        queued = self._queued.pop(request_id, None)
        tid = tid if queued is None else queued[0]
        if tid is not None:
            self._told.pop(tid, None)

    # P side, layer-wise ---------------------------------------------------------
    def prefill_admitted(
        self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int, max_tokens: int | None
    ) -> None:
        """A request was admitted (``update_state_after_alloc``); remember P requests that can go layer-wise."""
        if not self.layerwise or max_tokens != 1 or num_prompt_tokens < self.layerwise_min_tokens:
            return
        role = parse(params, request_id)
        if isinstance(role, PrefillSide) and request_id not in self._layered:
            self._candidates[request_id] = _Candidate(role.transfer_id, num_prompt_tokens)

    def scheduled(self, chunks: list[ScheduledChunk]) -> None:
        """This step's scheduled requests: announce candidates whose final prefill chunk runs now."""
        for c in chunks:
            cand = self._candidates.get(c.request_id)
            if cand is None:
                continue
            if c.block_ids is not None:
                if c.replace or not cand.block_ids:
                    cand.block_ids = [list(g) for g in c.block_ids]
                else:
                    for g, new in zip(cand.block_ids, c.block_ids, strict=False):
                        g.extend(new)
            if c.num_computed + c.num_scheduled < cand.num_prompt_tokens:
                continue
            del self._candidates[c.request_id]
            blocks = self.holes(tuple(tuple(g) for g in cand.block_ids))
            self._orders.layer_prefills.append(
                FinishedPrefill(c.request_id, cand.transfer_id, blocks, cand.num_prompt_tokens)
            )
            self._layered[c.request_id] = cand.transfer_id
            self._bump("layer_prefills")

    # both sides ---------------------------------------------------------------
    def finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        finished_normally: bool,
        block_ids: tuple[list[int], ...] | list[list[int]],
        num_prompt_tokens: int,
    ) -> bool:
        """vLLM's ``request_finished``: return True to keep the blocks for a transfer."""
        self._forget(request_id)
        self._peer_of.pop(request_id, None)
        if request_id in self._waiting_kv:
            # D request ended before its KV arrived (abort, timeout): fence.
            tid = self._waiting_kv.pop(request_id)
            self._fencing[request_id] = tid
            self._orders.aborts.append(AbortOrder(request_id, tid, "decode"))
            self._bump("decode_aborts")
            return True
        role = parse(params, request_id)
        if isinstance(role, DecodeSide):
            # Still marked remote: it never got blocks (aborted while waiting).
            # P may hold a finished prefill for it: say so now, not at P's lease.
            peer = role.peer
            cancel = CancelOrder(request_id, role.transfer_id, peer.host, peer.port, peer.tp_size, role.capability)
            self._orders.cancels.append(cancel)
            self._bump("decode_cancels")
            if params is not None:
                params["do_remote_prefill"] = False
            return False
        self._candidates.pop(request_id, None)
        tid = self._layered.pop(request_id, None)
        if tid is not None:
            # Announced layer-wise: the push thread may be writing a layer right
            # now, so the blocks stay until the workers report the transfer
            # released, whether it ended normally or not.
            if not finished_normally:
                self._orders.aborts.append(AbortOrder(request_id, tid, "prefill"))
                self._bump("prefill_aborts")
            else:
                self._bump("prefills")
            self._sending[request_id] = tid
            return True
        if not isinstance(role, PrefillSide):
            return False
        return self._prefill_finished(request_id, role.transfer_id, finished_normally, block_ids, num_prompt_tokens)

    def _prefill_finished(
        self,
        request_id: str,
        tid: str,
        finished_normally: bool,
        block_ids: tuple[list[int], ...] | list[list[int]],
        num_prompt_tokens: int,
    ) -> bool:
        """A P request announced at its end: a normal finish with blocks orders the push and keeps the blocks
        until the workers report it sent; an abnormal one orders the abort and frees them at once."""
        if not finished_normally:
            self._orders.aborts.append(AbortOrder(request_id, tid, "prefill"))
            self._bump("prefill_aborts")
            return False
        if not any(len(g) for g in block_ids):
            return False
        blocks = self.holes(tuple(tuple(g) for g in block_ids))
        self._orders.prefills.append(FinishedPrefill(request_id, tid, blocks, num_prompt_tokens))
        self._sending[request_id] = tid
        log.debug(
            "kvpush scheduler: prefill finished %s %s blocks=%s tokens=%d",
            request_id,
            tid,
            block_ids,
            num_prompt_tokens,
        )
        self._bump("prefills")
        return True

    def answer(self, request_id: str, params: dict[str, Any] | None, parked: bool) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a P request returns (vLLM's ``request_finished``), or ``None``.

        Only a prefill that finished normally and whose blocks wait for D
        (``parked``) answers: without them D would
        register for KV that never comes, while without an answer a
        sequential router sends D the plain request and D computes it.
        """
        if self.advert is None or not parked:
            return None
        role = parse(params, request_id)
        if not isinstance(role, PrefillSide):
            return None
        return prefill_answer(self.advert, role, request_id)

    def take_orders(self) -> StepOrders:
        orders, self._orders = self._orders, StepOrders()
        return orders

    def fence(self, targets: tuple[Target, ...], reason: str) -> None:
        """The operator fenced these P instances for good (D's fence listener): every worker is told next step."""
        for t in targets:
            self._orders.fences.append(FenceOrder(t.host, t.port, t.tp_size, reason))
        self._bump("fences")

    def on_output(
        self,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
        withheld: dict[str, int] | None = None,
        released: dict[str, int] | None = None,
    ) -> tuple[list[int], list[int]]:
        """One step's ended transfers; returns (blocks to hold, blocks to give back) for ``Withheld``."""
        for rid in finished_sending or ():
            self._sending.pop(rid, None)
            self._fencing.pop(rid, None)
            self.withheld.forget(rid)
        for rid in finished_recving or ():
            self._waiting_kv.pop(rid, None)
            self._peer_of.pop(rid, None)
            if self._fencing.pop(rid, None) is not None:
                # Ended (vLLM failed it, or it was aborted) in the step its transfer ended: vLLM frees its
                # blocks on this finished_recving, and the engine has nothing left to fence.
                self._orders.aborts = [a for a in self._orders.aborts if a.request_id != rid]
        return self.withheld.output(finished_recving or (), withheld or {}, released or {})

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while blocks are held for transfers."""
        o = self._orders
        return bool(
            self._sending
            or self._fencing
            or self.withheld.holding()
            or o.registrations
            or o.prefills
            or o.aborts
            or o.cancels
            or o.layer_prefills
            or o.fences
        )

    def pending(self) -> dict[str, int]:
        return {
            "sending": len(self._sending),
            "waiting_kv": len(self._waiting_kv),
            "fencing": len(self._fencing),
            "withheld_blocks": self.withheld.held_blocks(),
            "queued_prefills": len(self._queued),
            "running_prefills": len(self._running),
        }
