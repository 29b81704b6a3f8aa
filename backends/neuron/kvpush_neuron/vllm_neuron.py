"""The hooks the kvpush vLLM connector calls under the vLLM-Neuron platform.

The connector stays device-agnostic: it asks ``is_neuron_platform(current_platform)``,
loads the backend with ``kvpush.backends.load_backend("neuron", **backend_options(...))``
and takes the layout of vLLM-Neuron's caches from ``vllm_cache_spec(vllm_config, ...)``.
Nothing here imports vLLM, torch or the Neuron SDK (configs are read duck-typed),
so it is tested here and behaves the same on a trn host.

What vLLM-Neuron does, read in its source (``docs/neuron.md`` names the files
and the commit; the plugin pins vLLM 0.24.0 and NIXL 1.3.2):

* ``NeuronPlatform`` reports ``device_type == "neuron"`` (``"cpu"`` under
  ``VLLM_NEURON_CPU_MODE``), ``get_device_name() == "neuron:<id>"``,
  ``ray_device_key == "neuron_cores"`` and ``device_control_env_var ==
  "NEURON_VISIBLE_DEVICES"``. The older NxDI-based plugin reported
  ``device_type == "cpu"`` and ``NEURON_RT_VISIBLE_CORES``; both are recognised.
* ``NeuronModelRunner.initialize_kv_cache`` gives each layer one tensor
  ``[2, num_blocks, kv_heads, block_size, head_dim]`` on the worker's
  ``neuron:<local_rank>`` device and hands ``{layer: tensor}`` to the
  connector's ``register_kv_caches``; layers of different KV-cache groups
  (sliding-window beside full attention) may share one allocation.
* ``block_size`` is ``cache_config.block_size``: 32 unless the user set one.
* vLLM's NIXL connector there registers each layer's K and V halves as
  ``VRAM`` (``kv_buffer_device`` ``"cuda"``, which the platform maps to its
  device; no ``get_nixl_memory_type`` override), with the tensor's device
  index and no host buffer, over NIXL's ``LIBFABRIC`` backend.
* Decode context parallelism (DCP) works only through vLLM-Neuron's own
  ``NeuronNixlConnector``: the platform refuses ``decode_context_parallel_size
  > 1`` with any other connector, and kvpush does not split a head's tokens
  over ranks, so the hook refuses it too.
* The platform injects ``kv_connector_module_path`` only when ``kv_connector``
  is one of its own names and no path is set: naming ``KVPushConnector`` with
  ``kv_connector_module_path: kvpush.integrations.vllm.connector`` is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.backends.base import CacheSpec
from kvpush.core.errors import ConfigError
from kvpush_neuron.backend import ENV_MEM, ENV_MODE, Mode
from kvpush_neuron.layout import nxdi_bhsd_spec, nxdi_block_spec, paged_spec

NEURON_DEVICE_TYPE = "neuron"  # vLLM-Neuron's device_type (and torch device type of its KV caches)
NEURON_ENV_VARS = ("NEURON_VISIBLE_DEVICES", "NEURON_RT_VISIBLE_CORES")  # plugin, older NxDI plugin

# vLLM ``cache_dtype`` strings to the element type of vLLM-Neuron's caches.
_CACHE_DTYPES = {
    "bfloat16": "bfloat16",
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def is_neuron_platform(platform: Any) -> bool:
    """Whether ``platform`` (a vLLM platform object or its name) is vLLM-Neuron's.

    ``device_type`` alone cannot tell: the NxDI-based plugin and CPU mode report
    ``"cpu"``; the device-control variable, Ray's resource key and the device
    name are Neuron's in every variant.
    """
    if isinstance(platform, str):
        return platform.strip().lower() in ("neuron", "neuronplatform")
    if getattr(platform, "device_type", None) == NEURON_DEVICE_TYPE:
        return True
    if getattr(platform, "device_control_env_var", None) in NEURON_ENV_VARS:
        return True
    if getattr(platform, "ray_device_key", None) == "neuron_cores":
        return True
    get_name = getattr(platform, "get_device_name", None)
    try:
        return callable(get_name) and str(get_name()).lower().split(":")[0] == "neuron"
    except Exception:
        return False


def select_backend(platform: Any) -> str:
    """kvpush backend name for a platform: ``neuron`` on Neuron, ``cuda`` on CUDA, else ``host``."""
    if is_neuron_platform(platform):
        return "neuron"
    name = platform if isinstance(platform, str) else getattr(platform, "device_type", "")
    return "cuda" if str(name).lower() in ("cuda", "rocm") else "host"


def backend_options(nixl_backends: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Options for ``load_backend("neuron", **options)`` under vLLM-Neuron.

    vLLM-Neuron's caches are torch tensors on the Neuron device, which kvpush
    moves only by registering that memory with NIXL (``direct``, ``VRAM``),
    exactly as vLLM-Neuron's own connector does: that needs NIXL's LIBFABRIC
    backend, so without it the connector refuses to start rather than fail at
    the first registration. ``KVPUSH_NEURON_MODE``/``KVPUSH_NEURON_MEM`` override
    (the stand-in runtime registers its "device" memory as ``DRAM`` over UCX).
    """
    env = dict(os.environ) if env is None else dict(env)
    if env.get(ENV_MODE) or env.get(ENV_MEM):
        mode = Mode(env.get(ENV_MODE) or Mode.DIRECT)
        return {"mode": mode.value, "mem": env.get(ENV_MEM) or nixl_memory_type(mode)}
    if "LIBFABRIC" not in nixl_backends:
        raise ConfigError(
            f"kvpush under vLLM-Neuron needs NIXL's LIBFABRIC backend (nixl_backends is {list(nixl_backends)}): "
            "vLLM-Neuron's KV caches are torch tensors on the Neuron device, which only LIBFABRIC can register "
            '(FI_HMEM_NEURON over EFA); set "nixl_backends": ["LIBFABRIC"] in kv_connector_extra_config'
        )
    return {"mode": Mode.DIRECT.value, "mem": nixl_memory_type(Mode.DIRECT)}


def nixl_memory_type(mode: Mode | str) -> str:
    """What kvpush registers with NIXL: ``VRAM`` (the device, as vLLM's NIXL connector does here) or ``DRAM``."""
    return "VRAM" if Mode(mode) is Mode.DIRECT else "DRAM"


def nixl_supported_devices() -> dict[str, tuple[str, ...]]:
    """vLLM-Neuron's ``get_nixl_supported_devices``: ``kv_buffer_device`` ``cuda`` (meaning its device) on ``neuron``.

    kvpush does not read ``kv_buffer_device``; its ``mode`` decides what is registered.
    """
    return {NEURON_DEVICE_TYPE: ("cuda",)}


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
    """The ``CacheSpec`` of a standalone NxDI model's caches, from its neuron_config values.

    With the block KV layout the cache is paged (``pa_block_size`` tokens a
    block); without it, one block is one sequence slot of ``max_seq_len``
    tokens and the caller passes the request's slot as its block id.
    """
    if is_block_kv_layout:
        return nxdi_block_spec(block_size, num_kv_heads, head_dim, dtype, tp_rank, tp_size)
    return nxdi_bhsd_spec(max_seq_len, num_kv_heads, head_dim, dtype, tp_rank, tp_size)


def kv_cache_dtype(vllm_config: Any) -> str:
    """Element type of vLLM-Neuron's caches: the model dtype for ``cache_dtype`` ``auto``, else the named one."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    name = str(getattr(cc, "cache_dtype", "auto") or "auto")
    if name == "auto":
        return str(mc.dtype).removeprefix("torch.")
    if name not in _CACHE_DTYPES:
        raise ConfigError(f"cache_dtype {name!r} is not one kvpush knows for vLLM-Neuron ({sorted(_CACHE_DTYPES)})")
    return _CACHE_DTYPES[name]


def check_supported(vllm_config: Any) -> None:
    """Refuse, at registration, the vLLM-Neuron settings whose caches kvpush cannot move correctly.

    * ``decode_context_parallel_size > 1``: each DCP rank holds every other
      block of a request (its own block table), which only vLLM-Neuron's
      ``NeuronNixlConnector`` maps; the platform itself refuses DCP with any
      other connector.
    * ``neuron_config.fp8_packed_kv`` with an FP8 cache: K blocks are stored
      as ``[kv_heads, block_size // 2, head_dim, 2]`` (token pairs interleaved),
      so token ranges do not map onto another rank's blocks.
    """
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if dcp > 1:
        raise ConfigError(
            f"decode_context_parallel_size={dcp}: under vLLM-Neuron, decode context parallelism is served only by "
            "its NeuronNixlConnector (the platform refuses DCP with any other connector, and kvpush does not split "
            "a request's blocks over DCP ranks); run kvpush with decode_context_parallel_size 1"
        )
    additional = getattr(vllm_config, "additional_config", None) or {}
    neuron_config = additional.get("neuron_config", {}) if isinstance(additional, Mapping) else {}
    if neuron_config.get("fp8_packed_kv") and kv_cache_dtype(vllm_config) == "float8_e4m3fn":
        raise ConfigError(
            "neuron_config.fp8_packed_kv: vLLM-Neuron stores K with token pairs interleaved "
            "([kv_heads, block_size // 2, head_dim, 2] a block), which kvpush cannot map token by token; "
            "turn fp8_packed_kv off to push this cache with kvpush"
        )


def layer_groups(kv_cache_config: Any, layer_names: Sequence[str]) -> tuple[int, ...]:
    """The KV-cache group of each layer in ``layer_names`` (as vLLM's ``kv_cache_groups`` list them)."""
    group_of: dict[str, int] = {}
    for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        for name in group.layer_names:
            group_of[name] = g
    missing = [n for n in layer_names if n not in group_of]
    if missing:
        raise ConfigError(f"KV caches {missing[:4]} belong to no KV-cache group of vLLM's KV-cache config")
    return tuple(group_of[n] for n in layer_names)


def vllm_cache_spec(
    vllm_config: Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    kv_cache_config: Any = None,
    layer_names: Sequence[str] = (),
) -> CacheSpec:
    """The ``CacheSpec`` of vLLM-Neuron's caches (``paged_spec``), from vLLM's config (read duck-typed).

    Heads are the model's KV heads (each rank holds ``max(1, heads // tp)``,
    head ``rank * heads // tp`` first, which is also how vLLM-Neuron's NIXL
    connector counts KV-head ranks). With ``kv_cache_config`` and the layers'
    names in the order of the caches, each layer carries its KV-cache group;
    several groups occur with vLLM's hybrid KV-cache manager (sliding-window
    models), where a request has separate block ids per group.
    """
    check_supported(vllm_config)
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    groups: tuple[int, ...] = ()
    if kv_cache_config is not None and layer_names:
        groups = layer_groups(kv_cache_config, layer_names)
        if set(groups) == {0}:
            groups = ()
    return paged_spec(
        int(cc.block_size),
        int(mc.get_total_num_kv_heads()),
        int(mc.get_head_size()),
        kv_cache_dtype(vllm_config),
        tp_rank,
        tp_size,
        layer_groups=groups,
    )
