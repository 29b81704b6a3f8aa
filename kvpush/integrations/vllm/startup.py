"""What the connector derives at start from vLLM's configuration and platform.

Rule: each function reads vLLM's config or platform once, when the connector
is built or its caches are registered, and returns plain values (the kvpush
backend and its options, P's advert, the layers' attention backends) or sets
up logging. Reason: the connector class only translates vLLM's hooks; these
decisions are tested on their own (the Neuron platform's, for one) without
building a connector.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from kvpush.config import Config
from kvpush.core.capability import derive_key
from kvpush.integrations.vllm.params import PrefillAdvert
from kvpush.transport import key_set

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


def share_vllm_logging() -> None:
    """Make kvpush's log records appear in the server log.

    By default they go through vLLM's handlers (same format and level);
    ``KVPUSH_LOG_LEVEL=DEBUG`` gives kvpush its own handler at that level, so
    the per-transfer lines show without turning on vLLM's debug output.
    """
    ours, theirs = logging.getLogger("kvpush"), logging.getLogger("vllm")
    if ours.handlers:
        return
    level = os.environ.get("KVPUSH_LOG_LEVEL")
    if level:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(level.upper())
    else:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def apply_switch_interval(cfg: Config) -> float | None:
    """Set Python's switch interval in this (the engine's) process to ``polling.switch_interval_ms``, if set;
    returns the interval now in force, in seconds (None: left as it was). A worker thread woken for a push's
    next step waits for the GIL while the engine loop holds it, up to this interval each time."""
    interval_ms = cfg.polling.switch_interval_ms
    if interval_ms is None:
        return None
    sys.setswitchinterval(interval_ms / 1e3)
    log.info("kvpush: Python's switch interval set to %g ms in this engine process", interval_ms)
    return sys.getswitchinterval()


def platform_backend(cfg: Config) -> tuple[str, dict[str, Any], Any]:
    """The kvpush backend (and its options) for vLLM's platform, and the Neuron hooks when on Neuron.

    ``backend: "auto"`` follows the platform. vLLM-Neuron reports
    ``device_type == "cpu"``, so Neuron is recognised by the Neuron backend's
    own test of the platform object when it is installed; under Neuron the
    backend's options and the cache layout come from its hooks
    (``kvpush_neuron.vllm_neuron``, the third value).
    """
    from vllm.platforms import current_platform

    try:
        from kvpush_neuron import vllm_neuron
    except ImportError:
        vllm_neuron = None
    neuron = vllm_neuron is not None and vllm_neuron.is_neuron_platform(current_platform)
    name = cfg.backend
    if name == "auto":
        name = "neuron" if neuron else "cuda" if current_platform.is_cuda_alike() else "host"
    if name == "neuron" and vllm_neuron is not None:
        return name, dict(vllm_neuron.backend_options(cfg.nixl_backends)), vllm_neuron
    return name, {}, None


def layerwise_on(cfg: Config) -> bool:
    """Whether P pushes layer by layer (``per_layer.layerwise``): as set, or with "auto" where the KV is on a
    GPU (the backend ``platform_backend`` picks is ``cuda``)."""
    setting = cfg.per_layer.layerwise
    if setting == "auto":
        return platform_backend(cfg)[0] == "cuda"
    return bool(setting)


def attention_backends(vllm_config: VllmConfig, names: list[str]) -> dict[str, str]:
    """Each KV-cache layer's attention backend name (``CPU_ATTN``, ``FLASH_ATTN``...), from vLLM's layers."""
    context = vllm_config.compilation_config.static_forward_context
    out: dict[str, str] = {}
    for n in names:
        layer = context.get(n)
        get = getattr(layer, "get_attn_backend", None)
        if get is not None:
            out[n] = str(get().get_name())
    return out


def prefill_advert(cfg: Config, engine_id: str, vllm_config: VllmConfig) -> PrefillAdvert | None:
    """What P's answers tell D (its side channel and TP size); ``None`` when the port is not fixed.

    With ``side_channel_port`` 0 each rank binds a free port the scheduler
    cannot know, so P returns no ``kv_transfer_params`` and only a router
    that knows P's address (``kvpush router --prefill-kv``) can pair it.
    """
    if cfg.side_channel_port == 0:
        log.warning(
            "kvpush: side_channel_port is 0 (a free port per rank): P cannot tell D where it listens, so "
            "routers that pass P's kv_transfer_params on to D (vllm-router) will not work; set a fixed port"
        )
        return None
    tp = vllm_config.parallel_config.tensor_parallel_size
    keys = key_set.server_keys(cfg.security.auth, cfg.security.auth_keys_dir)
    key = derive_key(keys.secret) if keys is not None else None
    return PrefillAdvert(engine_id, cfg.side_channel_host, cfg.side_channel_port, tp, key)
