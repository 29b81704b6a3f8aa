"""What the running vLLM offers the connector, found by feature detection: the one place versions differ.

kvpush's connector supports vLLM ``[0.24, 0.34)`` (``SUPPORTED_VLLM``,
checked at start). Within that range the connector interface changed; the
connector never compares version numbers for that, it asks ``detect()``:

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

Everything here reads vLLM's real classes; the rules (``check_start``,
``load_error_blocks``, ``in_supported_range``) take plain values.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

from kvpush.core.errors import ConfigError

SUPPORTED_VLLM = ((0, 24), (0, 34))
"""vLLM versions the connector supports, ``[0.24, 0.34)``: the one declaration, checked at start."""


def in_supported_range(version: str) -> bool:
    """Whether vLLM ``version`` (``"0.29.0"``, ``"0.33.0rc1"``...) lies in ``SUPPORTED_VLLM``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = SUPPORTED_VLLM
    return m is not None and lo <= (int(m[1]), int(m[2])) < hi


def check_vllm_version(version: str) -> None:
    """Raise ``ConfigError`` naming the supported range unless ``version`` is in it."""
    if not in_supported_range(version):
        (a, b), (c, d) = SUPPORTED_VLLM
        raise ConfigError(
            f"KVPushConnector supports vLLM >= {a}.{b} and < {c}.{d}; this is vLLM {version}: its connector "
            "interface or KV-cache layout may differ (install a supported vLLM, or a kvpush release for yours)"
        )


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

    @property
    def failures_by_request(self) -> bool:
        """Whether a failed push reaches vLLM by request id: it reads ``failed_recving``, which only
        ``get_transfer_results`` returns."""
        return self.transfer_results and self.failed_recving


@cache
def detect() -> Features:
    """The running vLLM's features, read from its classes (imports vLLM)."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput

    connector = base.KVConnectorBase_V1
    try:
        from vllm.v1.metrics import cache_hit_source  # noqa: F401

        hit_source = True
    except ImportError:
        hit_source = False
    allocate = inspect.signature(KVCacheManager.allocate_slots).parameters
    return Features(
        version=str(vllm.__version__),
        transfer_results=hasattr(connector, "get_transfer_results") and hasattr(base, "KVConnectorTransferResults"),
        failed_recving="failed_recving" in {f.name for f in fields(KVConnectorOutput)},
        cache_hit_source=hit_source,
        loaded_group_ids=hasattr(connector, "get_loaded_kv_cache_group_ids"),
        binds_kv_cache_manager=hasattr(connector, "bind_kv_cache_manager"),
        sleep_mode_hook=hasattr(connector, "supports_sleep_mode"),
        zeroes_loaded_blocks="skip_zeroing_group_ids" not in allocate,
    )


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
