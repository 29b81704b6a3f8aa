"""A vLLM 0.32 Qwen3-Next-shaped KV cache built by vLLM's own code, and vLLM's own views of it.

Three GDN layers (``MambaSpec``: a conv state and an ssm state per request,
packed at the start of a block's page, the page padded to the attention
page size) and one full-attention layer, each its own KV-cache group over
one shared pool, as vLLM lays out the tiny ``qwen3_next`` model here:
``allocate_kv_cache`` gives the dict vLLM hands the connector, and the GDN
layer's ``bind_kv_cache`` (``MambaBase``) gives the conv/ssm views its
kernel reads. The reference of the state tests reads and writes through
those views, never through kvpush's offsets.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

BS = 32  # attention block size: 2 heads x 32 tokens x (64 + 64) bf16 = 16 KiB pages
NUM_BLOCKS = 24
CONV, SSM = (3, 64), (2, 16, 16)  # per rank: conv (kernel - 1, channels) bf16, ssm (heads, k, v) fp32
PAGE = 2 * BS * 128 * 2
LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)] + ["model.layers.3.self_attn.attn"]


def state_spec(dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32)) -> MambaSpec:
    return MambaSpec(
        block_size=4096,
        shapes=(CONV, SSM),
        dtypes=dtypes,
        page_size_padded=PAGE,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="none",
    )


ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def kv_cache_config(state: MambaSpec | None = None) -> KVCacheConfig:
    """Four groups (three GDN layers, one attention layer) over one pool of ``NUM_BLOCKS`` pages."""
    size = NUM_BLOCKS * PAGE
    specs = [state or state_spec()] * 3 + [ATTN]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size, [n], size, PAGE) for n in LAYERS],
        kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in zip(LAYERS, specs, strict=True)],
    )


def caches(config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """What vLLM hands ``register_kv_caches`` on this CPU (its ``LBHNC`` layout)."""
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)


def pool(kv: dict[str, torch.Tensor]) -> torch.Tensor:
    """The shared backing bytes of every layer."""
    t = kv[LAYERS[3]]
    return torch.empty(0, dtype=torch.int8).set_(t.untyped_storage()).view(torch.uint8)


def state_views(raw_page_view: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """The GDN layer's (conv, ssm) views, by vLLM's own ``MambaBase.bind_kv_cache``."""
    layer = SimpleNamespace(get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes)
    MambaBase.bind_kv_cache(layer, raw_page_view)
    return layer.kv_cache


def views_over(buf: torch.Tensor, config: KVCacheConfig) -> dict[str, Any]:
    """vLLM's views of every layer over ``buf`` (a copy of a pool): GDN layers as (conv, ssm), attention
    as its ``[B, H, N, C]`` view."""
    kv = {}
    for t in config.kv_cache_tensors:
        g = next(g for g in config.kv_cache_groups if t.layers[0] in g.layer_names)
        from vllm.v1.kv_cache_interface import create_kv_cache_views

        (view,) = create_kv_cache_views(buf.view(torch.int8), g.kv_cache_spec, NUM_BLOCKS, KVCacheLayout.LBHNC, t)
        kv[t.layers[0]] = state_views(view, g.kv_cache_spec) if isinstance(g.kv_cache_spec, MambaSpec) else view
    return kv


def connector_layout(kv: dict[str, torch.Tensor], config: KVCacheConfig, backend: Any) -> Any:
    """The layout the connector gives the engine for these caches (its own ``cache_spec`` and ``describe``)."""
    from kvpush.integrations.vllm.connector import KVPushConnector

    c = KVPushConnector.__new__(KVPushConnector)
    attention = SimpleNamespace(get_attn_backend=lambda: SimpleNamespace(get_name=lambda: "CPU_ATTN"))
    c.worker = SimpleNamespace(backend=backend, rank=0, tp_size=1)
    c._neuron = None
    c._kv_cache_config = config
    c._vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
        compilation_config=SimpleNamespace(static_forward_context={LAYERS[3]: attention}),
    )
    ordered, spec = c.cache_spec(kv)
    return c.describe(ordered, c.attention_caches(ordered), spec)
