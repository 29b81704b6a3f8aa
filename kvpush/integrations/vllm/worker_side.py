"""Worker half of the connector: hands orders to the kvpush engine, collects results.

Each worker (TP rank) owns a ``Sender`` (P role), a ``Receiver`` (D role) or
both. The engine threads do every transfer; this object only moves ids
between vLLM's hooks and the engine, so the forward loop never waits on I/O.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from kvpush.backends.base import Backend, CacheSpec
from kvpush.config import Config
from kvpush.core.layout import KVLayout
from kvpush.core.pieces import map_pieces
from kvpush.core.plan import staging_shortfall
from kvpush.decode.fence import hint
from kvpush.engine import PeerAddress, Receiver, Sender
from kvpush.integrations.vllm.compat import load_error_blocks
from kvpush.integrations.vllm.orders import Registration, StepOrders
from kvpush.integrations.vllm.withheld import reports_early
from kvpush.observability.metrics import TransferStats, layout_gauges, take_engine

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 1.0
"""Longest gap between two metric reports while vLLM steps; a step that ended a transfer reports at once."""
DEBUG_CHECKSUM = bool(os.environ.get("KVPUSH_DEBUG_CHECKSUM"))


def kv_checksum(layout: KVLayout, block_ids: tuple[int, ...], num_tokens: int, start: int = 0) -> str:
    """Hash of a request's KV bytes (debugging aid: compare P's and D's logs)."""
    import ctypes
    import hashlib

    pieces = map_pieces(layout, layout, block_ids, block_ids, num_tokens, start)
    h = hashlib.sha256()
    for r in layout.regions:
        for off, _, ln in pieces.tolist():
            h.update(ctypes.string_at(r.base + off, ln))
    return h.hexdigest()[:16]


class WorkerSide:
    def __init__(
        self,
        cfg: Config,
        backend: Backend,
        engine_id: str,
        rank: int,
        tp_size: int,
        producer: bool,
        consumer: bool,
        max_model_len: int = 0,
        failures_by_request: bool = True,
        recompute: bool = False,
    ) -> None:
        self.cfg = cfg
        self.failures_by_request = failures_by_request
        """vLLM reads failed loads by request id (``compat.Features.failures_by_request``)."""
        self.recompute = recompute
        """vLLM's ``kv_load_failure_policy`` is ``recompute`` (else ``fail``)."""
        self.max_model_len = max_model_len
        """vLLM's longest prompt plus output (0: unknown): what the staging region is checked against at start."""
        self.backend = backend
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.producer = producer
        self.consumer = consumer
        self.layout: KVLayout | None = None
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self._fencing: set[str] = set()  # D requests aborted: report in finished_sending once fenced
        self._done_sending: set[str] = set()  # pushed, waiting for vLLM to list them as finished
        self._finished_seen: set[str] = set()
        self._expect: set[str] = set()
        self._regs: dict[str, Any] = {}  # requests that will end in finished_sending
        self._loads: dict[str, Registration] = {}  # D requests registered, KV not yet in
        self._withheld: set[str] = set()  # D requests whose failure reached vLLM while their blocks are withheld
        self._meta_withheld: set[str] = set()  # this step's, for the scheduler half (``worker_meta``)
        self._meta_released: set[str] = set()  # withheld requests whose writers were fenced since the last step
        self._stats_at = -1e9  # monotonic time of the last metrics report
        # Layer-wise: each layer name's layer (kv_caches order, as the backend describes them), and this
        # step's layer-wise transfers with the layers the forward has written so far.
        self._layer_index: dict[str, int] = {}
        self._step_tids: list[str] = []
        self._layers_done: list[bool] = []
        self._layers_reported = 0
        self._layers_started_for: StepOrders | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any], spec: CacheSpec, layout: KVLayout | None = None) -> None:
        """Start the engines on ``layout`` (default: the backend's description of ``kv_caches``)."""
        self.layout = self.backend.describe(kv_caches, spec) if layout is None else layout
        # Backends number layers in kv_caches order (``Region.layer``).
        if len(kv_caches) == self.layout.num_layers:
            self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        log.info(
            "kvpush worker %s rank %d: %d regions, %d blocks of %d tokens, %s, %s",
            self.engine_id,
            self.rank,
            len(self.layout.regions),
            self.layout.num_blocks,
            self.layout.block_size,
            self.layout.order.value,
            self.layout.mem.value,
        )
        region = self.cfg.staging.staging_bytes
        region = self.backend.staging_bytes if region is None else region
        short = staging_shortfall(self.cfg, self.layout, self.max_model_len, region)
        if short is not None:
            log.warning(
                "kvpush worker %s rank %d: staging_bytes %d holds pushes of up to %d tokens of this KV and no "
                "ring to stage longer ones in rounds; a longer prompt whose blocks are fragmented is pushed direct, "
                "one descriptor per block and layer (slow: docs/operability.md, kvpush_staging_too_small_total). "
                "Set staging_bytes to %d or more on P and D to stage prompts up to max_model_len %d (any "
                "length in rounds from 128 KiB)",
                self.engine_id,
                self.rank,
                region,
                short[0],
                short[1],
                self.max_model_len,
            )
        if self.producer:
            self.sender = Sender(self.cfg, self.backend, self.layout, self.engine_id, self.rank, self.tp_size)
        if self.consumer:
            self.receiver = Receiver(self.cfg, self.backend, self.layout, self.engine_id, self.rank, self.tp_size)

    def apply(self, orders: StepOrders) -> None:
        """Hand this step's orders to the engine threads (non-blocking)."""
        if orders.prefill_states and self.sender is not None:
            self.sender.prefill_states([(o.transfer_id, o.state, o.tokens_ahead) for o in orders.prefill_states])
        if orders.prefills:
            assert self.sender is not None, "prefill orders on a worker without the producer role"
            ready = self.backend.record_ready()
            for p in orders.prefills:
                self._expect.add(p.request_id)
                if DEBUG_CHECKSUM and self.layout is not None:
                    log.info(
                        "kvpush P %s kv sha %s", p.transfer_id, kv_checksum(self.layout, p.block_ids[0], p.num_tokens)
                    )
                self.sender.prefill_finished(p.transfer_id, p.request_id, p.block_ids, p.num_tokens, ready)
        if orders.layer_prefills and orders is not self._layers_started_for:
            self.start_layers(orders)
        for r in orders.registrations:
            assert self.receiver is not None, "registration orders on a worker without the consumer role"
            self._loads[r.request_id] = r
            if DEBUG_CHECKSUM:
                self._regs[r.request_id] = r
            self.receiver.register(
                r.transfer_id,
                r.request_id,
                PeerAddress(r.host, r.port, r.tp_size),
                r.block_ids,
                r.num_tokens,
                r.start_token,
                r.skip_blocks,
                r.capability,
            )
        for a in orders.aborts:
            if a.side == "decode" and self.receiver is not None:
                self._fencing.add(a.request_id)
                self._expect.add(a.request_id)
                self.receiver.abort(a.transfer_id, "request aborted on D")
            elif a.side == "prefill" and self.sender is not None:
                self.sender.abort(a.transfer_id, "request aborted on P before its prefill finished")
        for f in orders.fences:
            if self.receiver is not None:
                self.receiver.fence(PeerAddress(f.host, f.port, f.tp_size), f"fenced by an operator: {f.reason}")
        for c in orders.cancels:
            if self.receiver is not None:
                peer = PeerAddress(c.host, c.port, c.tp_size)
                why = "request aborted on D before it got blocks"
                self.receiver.cancel(c.transfer_id, c.request_id, peer, why, c.capability)

    def start_layers(self, orders: StepOrders) -> None:
        """Announce this step's layer-wise prefills before its forward writes their first layer.

        Some vLLM versions call ``start_load_kv`` before the forward, others
        *after* it when no load is synchronous, so the connector also calls
        this from the first ``save_kv_layer`` of the step; whichever comes
        first starts them and the other skips them.
        """
        assert self.sender is not None, "prefill orders on a worker without the producer role"
        self._layers_started_for = orders
        for p in orders.layer_prefills:
            self._expect.add(p.request_id)
            self.sender.prefill_started(p.transfer_id, p.request_id, p.block_ids, p.num_tokens)
        self._step_tids = [p.transfer_id for p in orders.layer_prefills]
        self._layers_done = [False] * len(self._layer_index)
        self._layers_reported = 0

    def ensure_layers_started(self, orders: StepOrders) -> None:
        """From ``save_kv_layer``: start this step's layer-wise prefills if ``apply`` has not yet."""
        if orders.layer_prefills and orders is not self._layers_started_for:
            self.start_layers(orders)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: this step's forward wrote ``layer_name``; push what is complete.

        Called on the forward path, so it only records a marker and hands ids
        to the push thread. Layers are reported as the longest computed prefix
        (in ``kv_caches`` order), whatever order the hooks come in.
        """
        if not self._step_tids or self.sender is None:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        self._layers_done[i] = True
        done = self._layers_reported
        while done < len(self._layers_done) and self._layers_done[done]:
            done += 1
        if done > self._layers_reported:
            self._layers_reported = done
            self.sender.layer_written(self._step_tids, done - 1, self.backend.record_ready())

    def forward_done(self) -> None:
        """vLLM's ``wait_for_save`` (end of the forward): every layer is written, report what the hooks missed."""
        if not self._step_tids or self.sender is None:
            return
        if self._layers_reported < len(self._layers_done) or not self._layers_done:
            self.sender.forward_done(self._step_tids, self.backend.record_ready())
        self._step_tids = []

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for vLLM.

        A D transfer reaches vLLM only with its fenced Result (no writer can
        still write its blocks), once: a failure reported before P is fenced
        (``Result.fenced`` False, a quarantined writer) is logged and held, as
        vLLM would otherwise reuse the blocks at once."""
        self._finished_seen |= finished_req_ids & self._expect
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.sender is not None:
            for res in self.sender.poll():
                if not res.ok:
                    log.warning(
                        "kvpush: transfer %s (request %s) released unpushed: %s",
                        res.transfer_id,
                        res.request_id,
                        res.reason,
                    )
                self._done_sending.add(res.request_id)
        if self.receiver is not None:
            self._take_received(recving, failed)
        # vLLM accepts a finished_sending id only once it has listed the request as finished.
        ready = self._done_sending & self._finished_seen
        self._done_sending -= ready
        self._finished_seen -= ready
        self._expect -= ready
        sending |= ready
        if sending or recving or failed:
            log.debug("kvpush worker: finished_sending=%s finished_recving=%s failed=%s", sending, recving, failed)
        return sending, recving, failed

    def _take_received(self, recving: set[str], failed: set[str]) -> None:
        """D's Results into ``recving`` (and ``failed``), each request once. A failure whose blocks a P declared
        dead may still write (``Result.fenced`` False) reaches vLLM now where ``reports_early`` allows (vLLM
        fails the request or recomputes it into fresh blocks; the scheduler half keeps the old ones out until
        this rank's fenced Result, ``worker_meta``), else it is held until that Result."""
        assert self.receiver is not None
        for res in self.receiver.poll():
            rid = res.request_id
            if not res.fenced:
                self._early_failure(res, recving, failed)
                continue
            if rid in self._withheld:
                # Its failure reached vLLM already (which freed the request, if it was aborted since: never
                # report it in finished_sending): its blocks may go back now.
                self._withheld.discard(rid)
                self._fencing.discard(rid)
                self._expect.discard(rid)
                self._meta_released.add(rid)
                log.info("kvpush: the blocks of request %s (transfer %s) are fenced: given back", rid, res.transfer_id)
                continue
            if rid in self._fencing:
                self._fencing.discard(rid)
                self._loads.pop(rid, None)
                self._done_sending.add(rid)
                continue
            recving.add(rid)
            if res.ok:
                self._loads.pop(rid, None)
            r = self._regs.pop(rid, None)
            if DEBUG_CHECKSUM and r is not None and self.layout is not None:
                sha = kv_checksum(self.layout, r.block_ids[0], r.num_tokens, r.start_token)
                log.info("kvpush D %s kv sha %s ok=%s", r.transfer_id, sha, res.ok)
            if not res.ok:
                log.error(
                    "kvpush: KV for request %s (transfer %s) did not arrive: %s", rid, res.transfer_id, res.reason
                )
                failed.add(rid)

    def _early_failure(self, res: Any, recving: set[str], failed: set[str]) -> None:
        """A failure reported while a writer declared dead may still write the request's blocks."""
        rid = res.request_id
        reg = self._loads.get(rid)
        if (
            rid in self._fencing
            or reg is None
            or not reports_early(self.failures_by_request, self.recompute, reg.start_token)
        ):
            # Aborted (its blocks go back through finished_sending once fenced), or a vLLM that would recompute
            # into these very blocks: vLLM hears of it with the fenced Result.
            why = (
                ""
                if rid in self._fencing or reg is None
                else (
                    "; this vLLM would recompute after the local prefix hit into these very blocks, so the request "
                    "waits for the fence"
                )
            )
            log.warning(
                "kvpush: KV for request %s (transfer %s) failed (%s); its blocks are held until P is fenced%s",
                rid,
                res.transfer_id,
                res.reason,
                why,
            )
            return
        self._withheld.add(rid)
        self._meta_withheld.add(rid)
        self._regs.pop(rid, None)
        recving.add(rid)
        failed.add(rid)
        log.error(
            "kvpush: KV for request %s (transfer %s) did not arrive: %s; vLLM %s it now, and its %d blocks stay "
            "withheld from vLLM until that P is fenced (%s)",
            rid,
            res.transfer_id,
            res.reason,
            "recomputes" if self.recompute else "fails",
            sum(len(g) for g in reg.block_ids),
            hint((reg.host, reg.port), self.cfg.fence_port),
        )

    def worker_meta(self) -> tuple[set[str], set[str]] | None:
        """(requests whose blocks this rank withholds since the last call, requests whose withheld blocks it
        released), for the scheduler half; None when there is nothing to say."""
        if not self._meta_withheld and not self._meta_released:
            return None
        out = (self._meta_withheld, self._meta_released)
        self._meta_withheld, self._meta_released = set(), set()
        return out

    def load_error_blocks(self, failed: set[str], block_size: int) -> set[int]:
        """Block ids (group 0) the failed receives ``failed`` were to fill, for vLLM's
        ``get_block_ids_with_load_errors`` (``compat.load_error_blocks``); forgets those requests."""
        out: set[int] = set()
        for rid in failed:
            r = self._loads.pop(rid, None)
            if r is not None and r.block_ids:
                out |= load_error_blocks(r.block_ids[0], r.start_token, r.num_tokens, block_size)
        return out

    def forget_loads(self, request_ids: set[str]) -> None:
        """Drop the registrations of requests whose failure vLLM learns by id (``failed_recving``)."""
        for rid in request_ids:
            self._loads.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sender is not None:
            out["sender"] = self.sender.stats()
        if self.receiver is not None:
            out["receiver"] = self.receiver.stats()
        return out

    def take_stats(self, now: float | None = None) -> TransferStats | None:
        """Metrics since the last report, for vLLM's ``get_kv_connector_stats`` (called every step).

        ``None`` (nothing to send) unless a transfer ended since the last report
        or ``STATS_INTERVAL_S`` passed, so idle steps ship no payload.
        """
        engines = [e for e in (self.sender, self.receiver) if e is not None]
        if not engines or self.layout is None:
            return None
        now = time.monotonic() if now is None else now
        pending = any(e.recorder.results_pending for e in engines)
        if not pending and now - self._stats_at < STATS_INTERVAL_S:
            return None
        self._stats_at = now
        out = TransferStats()
        extra = layout_gauges(self.layout)
        for e in engines:
            out.aggregate(take_engine(e, self.rank, extra))
        return out

    def close(self) -> None:
        for e in (self.sender, self.receiver):
            if e is not None:
                e.close()
        self.sender = self.receiver = None
