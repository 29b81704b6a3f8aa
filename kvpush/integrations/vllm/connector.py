"""kvpush as a vLLM KV connector (vLLM 0.24 on, where its classes have what it needs: ``compat.check_vllm``).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.integrations.vllm.connector",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_connector_extra_config": {"side_channel_port": 5600}}'

This class only translates vLLM's hooks: the scheduler half is
``SchedulerSide`` (bookkeeping, reading vLLM's objects through
``scheduler_inputs``), the worker half is ``WorkerSide`` (hands work to the
engine threads), the step's orders between them are ``orders``, what is
decided at start from vLLM's config and platform is ``startup``, what the
backend is told about the KV cache comes from ``layout``. No protocol logic
lives here.

Data parallelism: P's engine of DP index ``k`` listens on
``side_channel_port + k * tp_size + tp_rank`` (vLLM's NIXL connector offsets
its side-channel port by the DP index the same way); pipeline parallelism is
refused at start. Sleep mode is not supported (``supports_sleep_mode``). It
registers the KV cache with NIXL (``kv_cache_access``).

What differs between vLLM versions is detected, never compared by number,
in ``compat``: this one class serves every supported version.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvpush.backends import CacheSpec, load_backend
from kvpush.config import Config
from kvpush.core.errors import BackendError, ConfigError
from kvpush.core.layout import KVLayout
from kvpush.core.recurrent import loaded_tokens, prefill_backoff
from kvpush.decode.fence import FenceRequest
from kvpush.integrations.vllm import compat
from kvpush.integrations.vllm import layout as vllm_layout
from kvpush.integrations.vllm.discovery import Announcer, start_announcer
from kvpush.integrations.vllm.metrics import KVPushConnectorStats, KVPushPromMetrics
from kvpush.integrations.vllm.orders import StepOrders
from kvpush.integrations.vllm.scheduler_inputs import drop_prompt_tail, scheduled_chunks, skips_external_kv
from kvpush.integrations.vllm.scheduler_side import SchedulerSide
from kvpush.integrations.vllm.startup import (
    apply_switch_interval,
    attention_backends,
    layerwise_on,
    platform_backend,
    prefill_advert,
    share_vllm_logging,
)
from kvpush.integrations.vllm.worker_side import WorkerSide
from kvpush.transport.fence_channel import FenceListener
from kvpush.transport.key_set import fence_server_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    orders: StepOrders = field(default_factory=StepOrders)


@dataclass
class KVPushWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler half each step (``withheld.Withheld``): per request, how many workers
    reported its failure while withholding its blocks, and how many released them (fenced)."""

    withheld: dict[str, int] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPushWorkerMetadata)
        out = KVPushWorkerMetadata(dict(self.withheld), dict(self.released))
        for rid, n in other.withheld.items():
            out.withheld[rid] = out.withheld.get(rid, 0) + n
        for rid, n in other.released.items():
            out.released[rid] = out.released.get(rid, 0) + n
        return out


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push-mode KV transfer: D registers its blocks, P writes into them."""

    _cache_hit_source = compat.p2p_cache_hit_source()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No: D's blocks stay registered with P across D's sleep, and P's registrations of its own KV would
        point at freed memory after a remap. vLLM that asks refuses sleep mode at start; where vLLM never asks,
        ``compat.check_start`` refuses it."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any = None) -> Any:
        """vLLM that asks (``compat.Features.kv_cache_access``): kvpush registers the KV cache with NIXL (UCX,
        LIBFABRIC), which needs each segment backed by one physical allocation (``REGISTERS``), and a P and a D
        on one host reach each other's over UCX's CUDA IPC (``EXPORTS_FABRIC``), as vLLM's NIXL connector
        declares. vLLM then allocates the KV cache so (or keeps its growable cache off where no IMEX channel
        exports it)."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    def unregister_kv_caches(self) -> None:
        """Never called while ``supports_sleep_mode`` is false; refuses rather than keep stale registrations."""
        raise ConfigError("KVPushConnector does not support sleep mode (supports_sleep_mode() is False)")

    def restore_kv_caches(self) -> None:
        """See ``unregister_kv_caches``."""
        raise ConfigError("KVPushConnector does not support sleep mode (supports_sleep_mode() is False)")

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        compat.start_on_vllm(vllm_config, kv_cache_config)
        self.features = compat.detect()
        vllm_layout.check_parallelism(vllm_config.parallel_config)
        ktc = vllm_config.kv_transfer_config
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        compat.check_start(
            self.features,
            consumer=bool(ktc.is_kv_consumer),
            num_kv_cache_groups=len(groups),
            sleep_mode=bool(getattr(vllm_config.model_config, "enable_sleep_mode", False)),
        )
        super().__init__(vllm_config, role, kv_cache_config)
        self._load_errors: set[int] = set()  # vLLM without failed_recving: blocks of failed pushes, this step
        share_vllm_logging()
        extra = dict(ktc.kv_connector_extra_config or {})
        try:
            cfg = Config.from_dict(extra)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config for KVPushConnector: {exc}") from None
        if not cfg.model:
            cfg = cfg.replace(model=str(vllm_config.model_config.model))
        # DP engine k's ranks listen from side_channel_port + k * tp_size (both roles: P's answers say so).
        parallel = vllm_config.parallel_config
        offset = vllm_layout.dp_port_offset(parallel, parallel.tensor_parallel_size)
        if offset and cfg.side_channel_port:
            cfg = cfg.replace(side_channel_port=cfg.side_channel_port + offset)
        self.cfg = cfg
        self.engine_id = str(ktc.engine_id)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._neuron: Any = None  # kvpush_neuron.vllm_neuron under the Neuron platform
        self.announcer: Announcer | None = None
        self._pool: Any = None  # vLLM's block pool (scheduler half): withheld blocks keep a reference in it
        self._fence_listener: FenceListener | None = None
        self._fences: queue.SimpleQueue[FenceRequest] = queue.SimpleQueue()  # from the listener's thread
        if role == KVConnectorRole.SCHEDULER:
            self._start_scheduler(vllm_config, kv_cache_config)
        else:
            self._start_worker(vllm_config)

    def _start_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        """The scheduler half: refuse caches kvpush cannot push, announce the instance, build ``SchedulerSide``."""
        cfg, ktc = self.cfg, vllm_config.kv_transfer_config
        if kv_cache_config is not None:
            vllm_layout.state_groups(kv_cache_config)  # refuses what kvpush cannot push, at start
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.announcer = start_announcer(cfg, ktc.is_kv_producer, tp)
        advert = prefill_advert(cfg, self.engine_id, vllm_config) if ktc.is_kv_producer else None
        self.sched = SchedulerSide(
            backoff=prefill_backoff(vllm_layout.has_state_layers(kv_cache_config)),
            layerwise=layerwise_on(cfg),
            layerwise_min_tokens=cfg.per_layer.layerwise_min_tokens,
            advert=advert,
            max_waiting_registrations=cfg.limits.max_waiting_registrations if ktc.is_kv_consumer else 0,
        )
        if ktc.is_kv_consumer and cfg.fence_port:
            # One listener per D engine (DP engine k on fence_port + k); its requests reach the workers as orders.
            port = cfg.fence_port + vllm_layout.dp_port_offset(vllm_config.parallel_config, 1)
            keys = fence_server_keys(cfg.security.auth, cfg.security.auth_keys_dir)
            self._fence_listener = FenceListener(cfg.side_channel_host, port, keys, self._fences.put)
            log.info("kvpush: fence listener on %s (%s)", self._fence_listener.address, "CURVE" if keys else "no auth")

    def _start_worker(self, vllm_config: VllmConfig) -> None:
        """The worker half: the platform's backend and a ``WorkerSide`` for this TP rank."""
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        ktc = vllm_config.kv_transfer_config
        apply_switch_interval(self.cfg)
        name, options, self._neuron = platform_backend(self.cfg)
        self.worker = WorkerSide(
            self.cfg,
            load_backend(name, **options),
            self.engine_id,
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size(),
            producer=ktc.is_kv_producer,
            consumer=ktc.is_kv_consumer,
            max_model_len=vllm_config.model_config.max_model_len,
            failures_by_request=self.features.failures_by_request,
            recompute=getattr(ktc, "kv_load_failure_policy", "fail") == "recompute",
        )

    # ---------------- scheduler hooks ----------------
    def on_new_request(self, request: Request) -> None:
        """A request joins the waiting queue: a P request of a state model drops its last prompt token first."""
        assert self.sched is not None
        drop = self.sched.prefill_drop(
            request.request_id,
            request.kv_transfer_params,
            request.num_prompt_tokens,
            whole=skips_external_kv(request),
        )
        if drop:
            drop_prompt_tail(
                request,
                drop,
                getattr(self._kv_cache_config, "hash_block_size", None),
                int(getattr(self._vllm_config, "num_hash_lookahead_tokens", 0) or 0),
            )
        self.sched.prefill_arrived(request.request_id, request.kv_transfer_params, request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.matched_tokens(
            request.request_id, request.kv_transfer_params, request.num_prompt_tokens, num_computed_tokens
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.sched is not None
        if num_external_tokens <= 0:
            self.sched.prefill_admitted(
                request.request_id,
                request.kv_transfer_params,
                request.num_prompt_tokens,
                getattr(request, "max_tokens", None),
            )
            return
        self.sched.after_alloc(
            request.request_id,
            request.kv_transfer_params,
            blocks.get_block_ids(),
            # request.num_computed_tokens is not updated yet at this hook: the
            # local prefix hit is whatever the remote part does not cover of
            # the tokens D loads (all but the backoff's, ``kvpush.core.recurrent``).
            loaded_tokens(request.num_prompt_tokens, self.sched.backoff) - num_external_tokens,
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.sched is not None
        while not self._fences.empty():
            fence = self._fences.get()
            self.sched.fence(fence.targets, fence.reason)
        if self.sched.layerwise:
            self.sched.scheduled(scheduled_chunks(scheduler_output))
        self.sched.step_states(set(scheduler_output.num_scheduled_tokens))
        return KVPushMetadata(self.sched.take_orders())

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self.sched is not None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        groups = block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) else [block_ids or []]
        params = request.kv_transfer_params
        delay = self.sched.finished(request.request_id, params, normal, groups, request.num_prompt_tokens)
        return delay, self.sched.answer(request.request_id, params, delay and normal)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request finished for every KV-cache group; each group's blocks are pushed."""
        return self.request_finished(request, block_ids)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Learn the block pool's placeholder id: a sliding-window group lists it for blocks it dropped."""
        self._pool = gpu_block_pool
        if self.sched is not None:
            self.sched.null_block = int(gpu_block_pool.null_block.block_id)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group: kvpush writes the request's own blocks of each group, not a hashed prefix."""
        config = self._kv_cache_config
        return tuple(config.transfer_group_ids) if config is not None else (0,)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Ended transfers; blocks of failed loads a dead P may still write take a reference of this half's own
        now, before vLLM frees them (this hook runs first), and give it back once fenced (``withheld``)."""
        assert self.sched is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        withheld = meta.withheld if isinstance(meta, KVPushWorkerMetadata) else None
        released = meta.released if isinstance(meta, KVPushWorkerMetadata) else None
        hold, give = self.sched.on_output(
            connector_output.finished_sending, connector_output.finished_recving, withheld, released
        )
        if (hold or give) and self._pool is None:
            log.error("kvpush: vLLM bound no block pool: %d withheld blocks cannot be kept out", len(hold))
            return
        if hold:
            self._pool.touch([self._pool.blocks[b] for b in hold])
        if give:
            self._pool.free_blocks([self._pool.blocks[b] for b in give])
            log.info("kvpush: %d withheld blocks given back to vLLM (their P was fenced)", len(give))

    def has_pending_push_work(self) -> bool:
        return self.sched is not None and (self.sched.has_pending_work() or not self._fences.empty())

    # ---------------- worker hooks ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's caches through the backend (the one source of layouts) and start the engines.

        A cache the backend cannot describe is refused here, at start, with
        its shape, strides, attention backend and what the backend supports.
        Recurrent-state layers (Mamba, GDN) join the layout as state regions.
        """
        assert self.worker is not None
        kv, spec = self.cache_spec(kv_caches)
        attention = self.attention_caches(kv)
        if not attention:
            raise ConfigError(
                f"KVPushConnector needs attention layers beside the recurrent-state layers {list(kv)[:4]}: a model "
                "of state layers alone is not supported; serve it without kvpush"
            )
        first = next(iter(attention.values()))
        log.info("kvpush: %d KV tensors, first %s stride %s -> %s", len(kv), tuple(first.shape), first.stride(), spec)
        try:
            self.worker.register_kv_caches(kv, spec, self.describe(kv, attention, spec))
        except BackendError as exc:
            raise vllm_layout.describe_error(exc, attention, spec, self.worker.backend.supported_layouts()) from None

    def attention_caches(self, kv: dict[str, Any]) -> dict[str, Any]:
        """The caches of ``kv`` that hold attention KV (all of them but recurrent-state layers')."""
        if self._neuron is not None or self._kv_cache_config is None:
            return kv
        state = set(vllm_layout.state_groups(self._kv_cache_config))
        groups = self._kv_cache_config.kv_cache_groups
        skip = {n for g in state for n in groups[g].layer_names}
        return {n: t for n, t in kv.items() if n not in skip}

    def describe(self, kv: dict[str, Any], attention: dict[str, Any], spec: CacheSpec) -> KVLayout:
        """The backend's layout of the attention caches, with the state layers' regions added."""
        assert self.worker is not None
        layout = self.worker.backend.describe(attention, spec)
        if len(attention) == len(kv):
            return layout
        return vllm_layout.with_states(layout, list(kv), list(attention), kv, self._kv_cache_config)

    def cache_spec(self, kv_caches: dict[str, Any]) -> tuple[dict[str, Any], CacheSpec]:
        """The caches in model order and what vLLM declares about their attention layers (Neuron: the Neuron
        backend's hook)."""
        assert self.worker is not None
        rank, tp = self.worker.rank, self.worker.tp_size
        kv = vllm_layout.in_model_order(kv_caches)
        if self._neuron is not None:
            return kv, self._neuron.vllm_cache_spec(self._vllm_config, rank, tp, self._kv_cache_config, list(kv))
        if self._kv_cache_config is None:
            raise ConfigError("vLLM gave the KVPushConnector worker no KV-cache config")
        names = list(self.attention_caches(kv))
        spec = vllm_layout.vllm_cache_spec(
            self._vllm_config,
            self._kv_cache_config,
            names,
            attention_backends(self._vllm_config, names),
            rank,
            tp,
            caches=kv,
        )
        return kv, spec

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self.worker.apply(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is None:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVPushMetadata):
            # vLLM may call start_load_kv only after the forward: start layer-wise pushes here.
            self.worker.ensure_layers_started(meta.orders)
        self.worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.forward_done()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM with ``failed_recving``: a failed push is reported by request id (also in ``finished_recving``)."""
        assert self.worker is not None
        sending, recving, failed = self.worker.results(set(finished_req_ids))
        self.worker.forget_loads(failed)
        return compat.transfer_results_class()(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM without ``get_transfer_results``: a failed push is in ``finished_recving`` and its blocks in
        this step's ``get_block_ids_with_load_errors`` (vLLM asks right after), so vLLM never decodes them."""
        assert self.worker is not None
        sending, recving, failed = self.worker.results(set(finished_req_ids))
        self._load_errors |= self.worker.load_error_blocks(failed, self._block_size())
        return sending, recving

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Requests whose blocks this worker withholds, or released, since the last step (``withheld``)."""
        said = self.worker.worker_meta() if self.worker is not None else None
        if said is None:
            return None
        withheld, released = said
        return KVPushWorkerMetadata(dict.fromkeys(withheld, 1), dict.fromkeys(released, 1))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of pushes that failed since the last call (``get_finished``); empty where vLLM reads
        ``failed_recving`` instead."""
        out, self._load_errors = self._load_errors, set()
        return out

    def _block_size(self) -> int:
        """vLLM's scheduler block size (of the single KV-cache group when there is a config)."""
        config = self._kv_cache_config
        if config is not None and config.kv_cache_groups:
            return int(config.kv_cache_groups[0].kv_cache_spec.block_size)
        return int(self._vllm_config.cache_config.block_size)

    def shutdown(self) -> None:
        if self._fence_listener is not None:
            self._fence_listener.close()
        if self.worker is not None:
            self.worker.close()
        if self.announcer is not None:
            self.announcer.close()

    # ---------------- metrics (kvpush.observability.metrics through vLLM's stats hooks) ----------------
    def get_kv_connector_stats(self) -> KVPushConnectorStats | None:
        stats = self.worker.take_stats() if self.worker is not None else None
        return None if stats is None else KVPushConnectorStats(data=stats.data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPushConnectorStats:
        return KVPushConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPushPromMetrics:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
