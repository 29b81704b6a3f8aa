"""What the running vLLM offers the connector, found by feature detection: the one place versions differ.

kvpush's connector was tested with vLLM ``TESTED_VLLM`` (0.24 to 0.34) and
starts on any vLLM from 0.24 on whose classes have what it needs
(``NEEDS``, checked at start by ``check_vllm``, the rule in
``kvpush.core.surface``): a newer vLLM starts with one warning naming the
tested range, and one whose hook, field or KV-cache layout kvpush needs is
missing or changed is refused, naming it. Within what it supports the
connector interface changed; the connector never compares version numbers
for that, it asks ``detect()``:

- ``transfer_results``: workers collect results with ``get_transfer_results``
  (returning ``KVConnectorTransferResults``); before, with ``get_finished``.
  The connector implements both; the missing class is replaced by
  ``TransferResults`` of the same fields.
- ``failed_recving``: a failed receive is reported by request id. Without it
  the only report vLLM reads is ``get_block_ids_with_load_errors`` (block ids
  of group 0 of a single KV-cache group, see ``load_error_blocks``).
- ``cache_hit_source``: ``CacheHitSource`` exists (metrics by source).
- ``loaded_group_ids``/``binds_kv_cache_manager``: vLLM asks
  ``get_loaded_kv_cache_group_ids``/calls ``bind_kv_cache_manager``; older
  vLLM never does (it loads group 0 of a single-group model only).
- ``sleep_mode_hook``: vLLM asks ``supports_sleep_mode`` and refuses sleep
  mode itself; before, it never asks, so ``check_start`` refuses it.
- ``zeroes_loaded_blocks``: vLLM zeroes every freshly allocated block of a
  model that needs it (recurrent state, mixed precision), including blocks a
  connector is about to load (see ``check_start``); newer vLLM skips the groups
  ``get_loaded_kv_cache_group_ids`` names (``allocate_slots``'s
  ``skip_zeroing_group_ids``).
- ``kv_cache_access``: vLLM asks the connector how it reaches the KV cache
  (``KVCacheAccess``) before allocating it; the connector answers that it
  registers it with NIXL, so that each segment is one physical allocation.

What vLLM's scheduler objects look like across versions (a resumed request
among the cached ones or re-sent as new; which request flag says it reads no
external KV) is read in ``scheduler_inputs``.

Everything here reads vLLM's real classes (``read_surface``, ``read_layouts``);
the rules (``features``, ``check_start``, ``layout_problem``,
``load_error_blocks``) take plain values.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.surface import Need, Surface, Verdict, Versions, read_class, start_verdict, unmet

log = logging.getLogger(__name__)

TESTED_VLLM = Versions("vLLM", (0, 24), (0, 34))
"""The vLLM minors kvpush's connector was tested with (docs/compat.md says how far each); 0.24 is also the
oldest it starts on."""

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
SOURCES: dict[str, tuple[str, bool]] = {
    "KVConnectorBase_V1": (_BASE, True),
    "SupportsHMA": (_BASE, False),
    "KVConnectorRole": (_BASE, False),
    "KVConnectorTransferResults": (_BASE, False),
    "KVConnectorStats": ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", False),
    "KVConnectorPromMetrics": ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", True),
    "KVConnectorOutput": ("vllm.v1.outputs", False),
    "Request": ("vllm.v1.request", True),
    "RequestStatus": ("vllm.v1.request", False),
    "SchedulerOutput": ("vllm.v1.core.sched.output", False),
    "NewRequestData": ("vllm.v1.core.sched.output", False),
    "CachedRequestData": ("vllm.v1.core.sched.output", False),
    "KVCacheBlocks": ("vllm.v1.core.kv_cache_manager", False),
    "KVCacheManager": ("vllm.v1.core.kv_cache_manager", False),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", False),
    "KVCacheGroupSpec": ("vllm.v1.kv_cache_interface", False),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface", False),
    "MambaSpec": ("vllm.v1.kv_cache_interface", False),
    "KVCacheLayout": ("vllm.v1.kv_cache_layout", False),
    "CacheHitSource": ("vllm.v1.metrics.cache_hit_source", False),
    "BlockPool": ("vllm.v1.core.block_pool", True),
}
"""Where each vLLM class the connector touches lives, and whether the attributes its ``__init__`` assigns are
read too (instance attributes the connector reads)."""

_B, _R = "KVConnectorBase_V1", "Request"


def _hook(name: str, *params: str, why: str, optional: bool = False, names: tuple[str, ...] = ()) -> Need:
    return Need(_B, names or (name,), "hook", why, params=params, optional=optional)


def _fields(owner: str, *names: str, why: str) -> list[Need]:
    return [Need(owner, (n,), "field", why) for n in names]


NEEDS: tuple[Need, ...] = (
    _hook("__init__", "vllm_config", "role", "kv_cache_config", why="is built by vLLM and builds its base alike"),
    _hook("get_num_new_matched_tokens", "request", "num_computed_tokens", why="tells D's scheduler what P pushes"),
    _hook("update_state_after_alloc", "request", "blocks", "num_external_tokens", why="registers D's blocks"),
    _hook("build_connector_meta", "scheduler_output", why="hands each step's orders to the workers"),
    _hook("request_finished", "request", "block_ids", why="holds P's blocks until they are pushed"),
    _hook("update_connector_output", "connector_output", why="learns which pushes ended"),
    _hook("on_new_request", "request", why="queues P's requests and drops a state model's last prompt token"),
    _hook("has_pending_push_work", why="keeps P's engine stepping while pushes fly"),
    _hook("bind_gpu_block_pool", "gpu_block_pool", why="learns the null block of sliding-window groups"),
    _hook("register_kv_caches", "kv_caches", why="describes and registers the KV cache"),
    _hook("start_load_kv", "forward_context", "**kwargs", why="applies each step's orders on the workers"),
    _hook("wait_for_layer_load", "layer_name", why="is told each layer's load"),
    _hook("save_kv_layer", "layer_name", "kv_layer", "attn_metadata", "**kwargs", why="pushes layer by layer"),
    _hook("wait_for_save", why="hands P's finished forward to the push"),
    _hook(
        "get_transfer_results",
        "finished_req_ids",
        names=("get_transfer_results", "get_finished"),
        why="reports finished and failed transfers",
    ),
    _hook("get_block_ids_with_load_errors", why="reports a failed push's blocks"),
    _hook("build_connector_worker_meta", why="tells its scheduler half which failed loads' blocks stay withheld"),
    _hook("shutdown", why="stops its threads"),
    _hook("get_kv_connector_stats", why="reports its metrics"),
    _hook("build_kv_connector_stats", "data", why="rebuilds its metrics in the API server"),
    _hook(
        "build_prom_metrics",
        "vllm_config",
        "metric_types",
        "labelnames",
        "per_engine_labelvalues",
        why="registers its Prometheus metrics",
    ),
    _hook("get_loaded_kv_cache_group_ids", "request", optional=True, why="names the groups it writes"),
    _hook("supports_sleep_mode", "kv_transfer_config", optional=True, why="declines sleep mode"),
    _hook("kv_cache_access", "kv_transfer_config", optional=True, why="declares that it registers the KV cache"),
    _hook("unregister_kv_caches", optional=True, why="refuses to drop its registrations"),
    _hook("restore_kv_caches", optional=True, why="refuses to drop its registrations"),
    Need(_B, ("_get_connector_metadata",), "call", "reads each step's orders on the workers"),
    *_fields(_B, "_kv_cache_config", "_vllm_config", why="reads the KV-cache config and config its base keeps"),
    Need(
        "SupportsHMA", ("request_finished_all_groups",), "hook", "pushes every KV-cache group", ("request", "block_ids")
    ),
    *_fields("KVConnectorRole", "SCHEDULER", "WORKER", why="starts its scheduler or worker half"),
    *_fields("KVConnectorOutput", "finished_sending", "finished_recving", why="learns which pushes ended"),
    *_fields("KVConnectorOutput", "kv_connector_worker_meta", why="learns which failed loads' blocks stay withheld"),
    Need(
        "BlockPool", ("touch",), "call", "keeps a failed load's withheld blocks out of vLLM's free queue", ("blocks",)
    ),
    Need("BlockPool", ("free_blocks",), "call", "gives withheld blocks back once fenced", ("ordered_blocks",)),
    *_fields("BlockPool", "blocks", "null_block", why="finds a block by its id"),
    *_fields(
        _R,
        "request_id",
        "kv_transfer_params",
        "num_prompt_tokens",
        "prompt_token_ids",
        "prompt_embeds",
        "_all_token_ids",
        "max_tokens",
        "status",
        why="reads a request's transfer and shortens a state model's prompt on P",
    ),
    Need(
        _R,
        ("skip_reading_external_kv", "skip_reading_prefix_cache"),
        "field",
        "keeps the whole prompt of a request that loads no external KV",
    ),
    Need(
        _R,
        ("truncate_block_hashes",),
        "call",
        "drops the hashes of the prompt tokens it removes",
        ("hash_block_size", "num_hash_lookahead_tokens"),
        optional=True,
    ),
    Need("KVCacheConfig", ("hash_block_size",), "field", "truncates block hashes", when=f"{_R}.truncate_block_hashes"),
    *_fields("RequestStatus", "FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", why="tells a finished request"),
    *_fields(
        "SchedulerOutput",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        why="follows P's scheduled chunks for layer-wise pushes",
    ),
    *_fields("NewRequestData", "req_id", "block_ids", "num_computed_tokens", why="reads new requests' blocks"),
    *_fields("CachedRequestData", "req_ids", "new_block_ids", "num_computed_tokens", why="reads running requests"),
    Need("KVCacheBlocks", ("get_block_ids",), "call", "reads D's allocated blocks"),
    Need("KVCacheConfig", ("kv_cache_groups",), "field", "reads the KV-cache groups"),
    Need(
        "KVCacheConfig",
        ("transfer_group_ids",),
        "field",
        "names the groups it writes",
        when=f"{_B}.get_loaded_kv_cache_group_ids",
    ),
    *_fields("KVCacheGroupSpec", "layer_names", "kv_cache_spec", why="reads each group's layers and spec"),
    *_fields("FullAttentionSpec", "block_size", "num_kv_heads", "head_size", "dtype", why="reads the KV geometry"),
    *_fields("MambaSpec", "shapes", "dtypes", "mamba_cache_mode", why="describes recurrent state"),
    *_fields("KVConnectorStats", "data", why="carries its metrics"),
    Need(
        "KVConnectorPromMetrics",
        ("__init__",),
        "call",
        "registers its Prometheus metrics",
        ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
    ),
    *_fields(
        "KVConnectorPromMetrics",
        "_gauge_cls",
        "_counter_cls",
        "_histogram_cls",
        "per_engine_labelvalues",
        why="makes its Prometheus metrics with vLLM's classes",
    ),
)
"""What the connector needs of vLLM's classes: hooks vLLM calls on it (their parameters must be the ones its
overrides take), methods it calls, fields it reads. ``test_vllm_compat`` checks the hooks against
``KVPushConnector``'s own signatures."""

KNOWN_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM's ``KVCacheLayout`` members kvpush's describers were checked against (``test_describe_vllm``): the
physical order of the logical axes ``[L, B, H, N, C]``. The four of dense blocks are described, the other two
refused by the backend with the cache's shape and strides."""


def layout_problem(name: str, offered: Mapping[str, tuple[int, ...]] | None) -> str:
    """Why vLLM's KV-cache layout ``name`` (the one it chose) is one kvpush does not know ("" if it knows it):
    a name kvpush never saw, or a known name whose axis order vLLM changed."""
    if name not in KNOWN_LAYOUTS:
        return (
            f"vLLM's KV-cache layout {name} is none kvpush knows ({', '.join(KNOWN_LAYOUTS)}): kvpush would not "
            "know which bytes a block holds"
        )
    order = (offered or {}).get(name)
    if order is not None and tuple(order) != KNOWN_LAYOUTS[name]:
        return (
            f"vLLM's KV-cache layout {name} changed: its axis order is {tuple(order)}, kvpush knows "
            f"{KNOWN_LAYOUTS[name]}"
        )
    return ""


def unknown_layouts(offered: Mapping[str, tuple[int, ...]] | None) -> list[str]:
    """The layouts vLLM offers that ``layout_problem`` would refuse were vLLM to choose them."""
    return [n for n in offered or {} if layout_problem(n, offered)]


def check_vllm(
    version: str,
    surface: Surface,
    layouts: Mapping[str, tuple[int, ...]] | None = None,
    layout_in_use: str | None = None,
) -> Verdict:
    """Whether the connector starts on this vLLM (``kvpush.core.surface.start_verdict``): every need of
    ``NEEDS`` met, the layout vLLM chose (where it says, before the caches exist) one kvpush knows."""
    problems = unmet(surface, NEEDS)
    if layout_in_use:
        problem = layout_problem(layout_in_use, layouts)
        if problem:
            problems.append(problem)
    return start_verdict(TESTED_VLLM, version, problems, who="KVPushConnector")


@cache
def read_surface() -> dict[str, dict[str, Any]]:
    """The running vLLM's ``Surface``: every class of ``SOURCES`` it has (imports vLLM)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (module, instance) in SOURCES.items():
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        out[name] = read_class(cls, instance=instance)
    return out


@cache
def read_layouts() -> dict[str, tuple[int, ...]] | None:
    """vLLM's ``KVCacheLayout`` members and their axis orders; None where vLLM has none (before 0.29, each layer
    is allocated in its attention backend's shape, read from the tensors at registration)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return None
    return {m.name: tuple(m.value) for m in KVCacheLayout}


@cache
def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process says it (the connector starts in the
    scheduler and in every worker; one process says a newer vLLM once)."""
    log.warning("%s", message)


def start_on_vllm(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse (``ConfigError``) or warn once as ``check_vllm`` says for the running vLLM; the layout in use is
    the one vLLM's KV-cache config (or cache config) names, where it names one."""
    import vllm

    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        getattr(vllm_config, "cache_config", None), "kv_cache_layout", None
    )
    verdict = check_vllm(str(vllm.__version__), read_surface(), read_layouts(), layout)
    if verdict.refusal:
        raise ConfigError(verdict.refusal)
    if verdict.warning:
        warn_once(verdict.warning)


@dataclass(frozen=True)
class Features:
    """What the running vLLM's connector interface offers (see the module docstring)."""

    version: str
    transfer_results: bool
    failed_recving: bool
    cache_hit_source: bool
    loaded_group_ids: bool
    binds_kv_cache_manager: bool
    sleep_mode_hook: bool
    zeroes_loaded_blocks: bool
    kv_cache_access: bool

    @property
    def failures_by_request(self) -> bool:
        """Whether a failed push reaches vLLM by request id: it reads ``failed_recving``, which only
        ``get_transfer_results`` returns."""
        return self.transfer_results and self.failed_recving


def features(version: str, surface: Surface) -> Features:
    """The features of a vLLM of this ``Surface`` (see the module docstring)."""
    base = surface.get(_B, {})
    allocate = surface.get("KVCacheManager", {}).get("allocate_slots") or ()
    return Features(
        version=version,
        transfer_results="get_transfer_results" in base and "KVConnectorTransferResults" in surface,
        failed_recving="failed_recving" in surface.get("KVConnectorOutput", {}),
        cache_hit_source="CacheHitSource" in surface,
        loaded_group_ids="get_loaded_kv_cache_group_ids" in base,
        binds_kv_cache_manager="bind_kv_cache_manager" in base,
        sleep_mode_hook="supports_sleep_mode" in base,
        zeroes_loaded_blocks=not any(p.rstrip("=") == "skip_zeroing_group_ids" for p in allocate),
        kv_cache_access="kv_cache_access" in base,
    )


@cache
def detect() -> Features:
    """The running vLLM's features, read from its classes (imports vLLM)."""
    import vllm

    return features(str(vllm.__version__), read_surface())


@dataclass
class TransferResults:
    """``KVConnectorTransferResults``'s fields, for vLLM without that class (never handed to such a vLLM)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def transfer_results_class() -> type:
    """vLLM's ``KVConnectorTransferResults`` where it exists, else ``TransferResults``."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return getattr(base, "KVConnectorTransferResults", TransferResults)


def p2p_cache_hit_source() -> Any:
    """``CacheHitSource.P2P`` (a peer's KV) where vLLM has it, else ``None`` (no per-source metrics)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource.P2P


def check_start(features: Features, *, consumer: bool, num_kv_cache_groups: int, sleep_mode: bool) -> None:
    """Refuse at start what this vLLM cannot run safely with kvpush, saying why.

    - Sleep mode when vLLM never asks ``supports_sleep_mode``: D's blocks
      stay registered with P across a sleep and P's registrations of its own
      KV would point at freed memory after the remap.
    - A consumer (D, or ``kv_both``) of a model with several KV-cache groups
      (hybrid: sliding window, recurrent state) when vLLM does not read
      failures by request (``failures_by_request``): a failed push could then be reported only as block
      ids, which such vLLM maps to requests through group 0 alone (its
      ``_update_requests_with_invalid_blocks`` unpacks one group and raises
      on more), so a failure would either stop the engine or, unreported,
      decode unloaded KV. Serving P alone is safe: P receives nothing.

    The same refusal keeps vLLM's zeroing of fresh blocks away from P's
    WRITEs where vLLM also zeroes blocks a connector loads
    (``zeroes_loaded_blocks``): it zeroes only for models with recurrent-state
    layers (which kvpush serves only beside attention layers) or with caches
    of mixed precision, both several KV-cache groups, and D of those is
    refused here. (The zeroing is issued in the worker's state update, before
    ``start_load_kv`` sends D's registration; on the host it is done by then,
    on a device stream it might not be.)
    """
    if sleep_mode and not features.sleep_mode_hook:
        raise ConfigError(
            f"KVPushConnector does not support sleep mode, and vLLM {features.version} does not ask connectors "
            "(supports_sleep_mode): start this server without --enable-sleep-mode"
        )
    if consumer and num_kv_cache_groups > 1 and not features.failures_by_request:
        raise ConfigError(
            f"KVPushConnector cannot receive KV for a model with {num_kv_cache_groups} KV-cache groups on vLLM "
            f"{features.version}: this vLLM reports a failed load only by block ids of a single group, so a failed "
            "push could not be recomputed or failed safely; serve this model as D on a vLLM with "
            "KVConnectorTransferResults.failed_recving (0.32 or later), or run this server as P only (kv_producer)"
        )


def load_error_blocks(block_ids: tuple[int, ...], start_token: int, num_tokens: int, block_size: int) -> set[int]:
    """The blocks to report through ``get_block_ids_with_load_errors`` when a push into ``block_ids`` failed.

    The blocks that were to receive tokens ``[start_token, num_tokens)``
    (the ones before hold D's local prefix hit and stay valid). vLLM then
    sets the request's computed tokens back to the first of them and, with
    ``kv_load_failure_policy`` ``"recompute"``, computes the rest itself, or
    with ``"fail"`` (vLLM's default) ends the request with an error. It must
    be reported in the same step as the request's ``finished_recving``: vLLM
    schedules the request from the next step on.
    """
    if num_tokens <= start_token:
        return set()
    first, end = start_token // block_size, -(-num_tokens // block_size)
    return set(block_ids[first:end])
