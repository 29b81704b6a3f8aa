"""The hooks the kvpush vLLM connector needs to run under the vLLM-Neuron platform.

The connector stays device-agnostic: under this platform it asks
``is_neuron_platform(current_platform)``, loads the backend with
``kvpush.backends.load_backend("neuron", **backend_options(...))``, and takes
the layout of NxDI's caches from ``vllm_cache_spec(vllm_config, ...)``. Nothing here imports vLLM,
torch or the Neuron SDK, so it is tested here and behaves the same on a trn host.

Facts relied on (vllm-project/vllm-neuron ``platform.py``): ``NeuronPlatform``
reports ``device_type == "cpu"`` (tensors handed to vLLM are CPU-typed),
``get_device_name() == "neuron"``, ``ray_device_key == "neuron_cores"`` and
``device_control_env_var == "NEURON_RT_VISIBLE_CORES"``; so "is this Neuron"
cannot be read from ``device_type`` and is read from the other three.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvpush.backends.base import CacheSpec
from kvpush_neuron.backend import ENV_MEM, ENV_MODE, Mode
from kvpush_neuron.layout import nxdi_bhsd_spec, nxdi_block_spec

NEURON_DEVICE_TYPE = "cpu"  # what vLLM-Neuron's platform reports as device_type


def is_neuron_platform(platform: Any) -> bool:
    """Whether ``platform`` (a vLLM platform object or its name) is vLLM-Neuron's."""
    if isinstance(platform, str):
        return platform.strip().lower() in ("neuron", "neuronplatform")
    if getattr(platform, "device_control_env_var", None) == "NEURON_RT_VISIBLE_CORES":
        return True
    if getattr(platform, "ray_device_key", None) == "neuron_cores":
        return True
    get_name = getattr(platform, "get_device_name", None)
    try:
        return callable(get_name) and str(get_name()).lower() == "neuron"
    except Exception:
        return False


def select_backend(platform: Any) -> str:
    """kvpush backend name for a platform: ``neuron`` on Neuron, ``cuda`` on CUDA, else ``host``."""
    if is_neuron_platform(platform):
        return "neuron"
    name = platform if isinstance(platform, str) else getattr(platform, "device_type", "")
    return "cuda" if str(name).lower() in ("cuda", "rocm") else "host"


def default_mode(nixl_backends: Sequence[str]) -> Mode:
    """Direct device registration needs NIXL's LIBFABRIC backend (EFA, FI_HMEM_NEURON); UCX cannot register HBM."""
    return Mode.DIRECT if "LIBFABRIC" in nixl_backends else Mode.HOST_STAGING


def backend_options(nixl_backends: Sequence[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """Options for ``load_backend("neuron", **options)``; ``KVPUSH_NEURON_MODE/MEM`` override the defaults."""
    env = dict(os.environ) if env is None else env
    mode = Mode(env.get(ENV_MODE) or default_mode(nixl_backends))
    mem = env.get(ENV_MEM) or nixl_memory_type(mode)
    return {"mode": mode.value, "mem": mem}


def nixl_memory_type(mode: Mode | str) -> str:
    """Equivalent of vLLM's ``Platform.get_nixl_memory_type``: what kvpush registers with NIXL."""
    return "VRAM" if Mode(mode) is Mode.DIRECT else "DRAM"


def nixl_supported_devices() -> dict[str, tuple[str, ...]]:
    """Equivalent of ``Platform.get_nixl_supported_devices``: ``{device_type: KV buffer devices}``.

    Under vLLM-Neuron (device_type ``cpu``) kvpush pushes from the device
    (``neuron``, direct mode) or from a host buffer (``cpu``, host staging).
    """
    return {NEURON_DEVICE_TYPE: ("neuron", "cpu")}


def cache_spec(
    *,
    is_block_kv_layout: bool,
    block_size: int,
    max_seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> CacheSpec:
    """The ``CacheSpec`` of an NxDI model's caches, from its neuron_config values.

    With the block KV layout the cache is paged (``pa_block_size`` tokens a
    block); without it, one block is one sequence slot of ``max_seq_len``
    tokens and the connector passes the request's slot as its block id.
    """
    if is_block_kv_layout:
        return nxdi_block_spec(block_size, num_kv_heads, head_dim, dtype, tp_rank, tp_size)
    return nxdi_bhsd_spec(max_seq_len, num_kv_heads, head_dim, dtype, tp_rank, tp_size)


def vllm_cache_spec(vllm_config: Any, tp_rank: int = 0, tp_size: int = 1) -> CacheSpec:
    """The ``CacheSpec`` of NxDI's caches under vLLM-Neuron, from vLLM's config (read duck-typed).

    vLLM-Neuron keeps NxDI's per-sequence cache unless prefix caching or
    chunked prefill asks for the block layout; for the per-sequence cache it
    sets ``block_size`` to the model length (``NeuronPlatform.
    check_and_update_config``), so a block size below the model length means
    the block layout.
    """
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    return cache_spec(
        is_block_kv_layout=int(cc.block_size) != int(mc.max_model_len),
        block_size=int(cc.block_size),
        max_seq_len=int(mc.max_model_len),
        num_kv_heads=int(mc.get_total_num_kv_heads()),
        head_dim=int(mc.get_head_size()),
        dtype=str(mc.dtype).removeprefix("torch."),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
