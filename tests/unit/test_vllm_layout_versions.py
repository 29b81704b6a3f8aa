"""The KV caches the running vLLM builds, described as the connector describes them, checked address by address.

Every lane runs this file against its own vLLM, and the caches are built by
that vLLM's own code, chosen by what it has (as the connector chooses, never
by version number):
- vLLM 0.29 and later: ``vllm.v1.worker.utils.allocate_kv_cache`` gives
  every layer a ``[blocks, heads, tokens, K|V]`` view of one buffer, strided
  by a ``KVCacheLayout``.
- earlier vLLM (0.24): ``vllm.v1.worker.gpu.attn_utils._reshape_kv_cache``
  (what the GPU and CPU model runners do with their per-layer allocations)
  views each layer in its attention backend's ``get_kv_cache_shape`` and
  memory order ``get_kv_cache_stride_order``, using the real backend classes
  (CPU attention, FlashAttention, Triton attention, Triton MLA), under vLLM's
  own NHD/HND switch (``set_kv_cache_layout``); Mamba/GDN layers become a
  list of per-state tensors. FlashInfer's class imports ``flashinfer``,
  which this CPU machine lacks: its shape is the one in vLLM 0.24's
  ``v1/attention/backends/flashinfer.py`` (``[nb, 2, bs, h, d]``, stride
  order identity for NHD, ``(0, 1, 3, 2, 4)`` for HND), in ``FlashInferShape``.
The reference is where each attention backend reads an element: its own
split of the cache (``unbind(1)`` for FlashAttention, FlashInfer and Triton;
CPU attention's ``[blocks, heads, 2 * tokens, head]`` view chunked in two;
MLA's ``[blocks, tokens]`` row; the views' ``transpose(1, 2).split``), never
kvpush's arithmetic. The spec comes from ``vllm_cache_spec(..., caches=)``
and the layout from the backends' shared describer.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
)

from kvpush.backends.base import CacheSpec  # noqa: E402
from kvpush.backends.host import HostBackend  # noqa: E402
from kvpush.backends.tensors import describe_strided  # noqa: E402
from kvpush.core.errors import BackendError  # noqa: E402
from kvpush.core.layout import KVLayout, MemKind, TokenOrder  # noqa: E402
from kvpush.integrations.vllm import layout as vl  # noqa: E402

try:
    from vllm.v1.worker.utils import allocate_kv_cache
except ImportError:  # vLLM before 0.29 allocates per layer
    allocate_kv_cache = None

VIEWS = allocate_kv_cache is not None
"""Whether this vLLM hands views of one buffer (else: each layer in its attention backend's shape)."""

NB, BS, HEADS, TP, RANK, D, MLA_D = 6, 16, 4, 2, 1, 32, 64
LOCAL = HEADS // TP
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
VLLM_CONFIG = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS))

BACKENDS = {
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
}


class FlashInferShape:
    """FlashInfer's cache shape and memory order as vLLM 0.24's ``flashinfer.py`` declares them (its class
    imports ``flashinfer``, absent here)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, **_: Any) -> tuple:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return (0, 1, 2, 3, 4) if get_kv_cache_layout() == "NHD" else (0, 1, 3, 2, 4)


def backend_class(name: str) -> Any:
    module, cls = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError:
        if name == "FLASHINFER":
            return FlashInferShape
        raise


def attention_spec(mla: bool) -> Any:
    if mla:
        return MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=MLA_D, dtype=torch.bfloat16)
    return FullAttentionSpec(block_size=BS, num_kv_heads=LOCAL, head_size=D, dtype=torch.bfloat16)


def groups_config(groups: list[tuple[Any, list[str]]], page: int) -> KVCacheConfig:
    """vLLM's KV-cache config of ``groups`` (spec, layers), each layer its own tensor of ``NB`` pages."""
    names = [n for _, ns in groups for n in ns]
    if VIEWS:
        tensors = [KVCacheTensor(NB * page, [n], NB * page, page) for n in names]
    else:
        tensors = [KVCacheTensor(NB * page, [n]) for n in names]
    return KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(ns, s) for s, ns in groups]
    )


def per_layer_caches(config: KVCacheConfig, backends: list[Any]) -> dict[str, Any]:
    """What vLLM before 0.29 hands the connector: ``_reshape_kv_cache`` over one int8 allocation a layer."""
    from vllm.v1.worker.gpu.attn_utils import _reshape_kv_cache
    from vllm.v1.worker.utils import AttentionGroup

    raw = {n: torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors for n in t.shared_by}
    groups = [
        AttentionGroup(b, list(g.layer_names), g.kv_cache_spec, i)
        for i, (g, b) in enumerate(zip(config.kv_cache_groups, backends, strict=True))
    ]
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    return _reshape_kv_cache(groups, raw, "auto", sizes, {}, config)


def build(name: str, order: str) -> tuple[dict[str, Any], KVCacheConfig]:
    """Three layers of attention backend ``name`` as this vLLM builds them (``order``: NHD or HND)."""
    spec = attention_spec("MLA" in name)
    config = groups_config([(spec, NAMES)], spec.page_size_bytes)
    if VIEWS:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layout = KVCacheLayout.LBNHC if order == "NHD" else KVCacheLayout.LBHNC
        return allocate_kv_cache(config, torch.device("cpu"), layout), config
    from vllm.v1.attention.backends.utils import set_kv_cache_layout

    set_kv_cache_layout(order)
    try:
        return per_layer_caches(config, [backend_class(name)]), config
    finally:
        set_kv_cache_layout(None)


def reads(name: str, cache: Any, kv: int, b: int, tok: int, h: int) -> int:
    """Address of K (``kv`` 0) or V of (block, token, local head) where attention backend ``name`` reads it."""
    if "MLA" in name:
        return int((cache[b, 0, tok] if cache.dim() == 4 else cache[b, tok]).data_ptr())
    if name == "CPU_ATTN":  # its kernels view [blocks, heads, 2 * tokens, head] and chunk it in K and V
        nb, heads, bs, _ = cache.shape
        return int(cache.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)[kv][b, h, tok].data_ptr())
    if cache.dim() == 4:  # the views: [B, H, N, K|V], read as [B, N, H, K|V] and split
        return int(cache.transpose(1, 2).split(cache.shape[-1] // 2, -1)[kv][b, tok, h].data_ptr())
    return int(cache.unbind(1)[kv][b, tok, h].data_ptr())  # [B, 2, N, H, head]


def kvpush_addr(layout: KVLayout, spec: CacheSpec, layer: int, kv: int, b: int, tok: int, h: int) -> int:
    """Address of (layer, K/V, block, token, local head) by the layout's rules (token-level layouts)."""
    per_layer = len(layout.regions) // len(NAMES)
    region = layout.regions[layer * per_layer + (kv if per_layer == 2 else 0)]
    if layout.order is TokenOrder.NHD:
        inner = (tok * layout.local_heads + h) * layout.head_bytes
    else:
        inner = (h * layout.block_size + tok) * layout.head_bytes
    v_offset = kv * (layout.head_bytes // 2) if per_layer == 1 else 0  # K|V content: V follows K
    return region.base + b * layout.block_stride + inner + v_offset


def describe(name: str, caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
    """The layout the backend that serves ``name`` gives: the host backend for CPU caches of CPU attention
    backends; else the CUDA backend's describer on these CPU tensors (its ATTENTION must name ``name``)."""
    if name.startswith("CPU_"):
        return HostBackend().describe(caches, spec)
    cuda = pytest.importorskip("kvpush_cuda.backend")
    assert name in cuda.ATTENTION
    return describe_strided(caches, spec, MemKind.VRAM, "cpu")[0]


CASES = [("CPU_ATTN", "HND")]
CASES += [(n, o) for n in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER") for o in ("NHD", "HND")]
CASES += [("TRITON_MLA", "NHD")]
if VIEWS:
    CASES += [("CPU_MLA", "NHD")]


@pytest.mark.parametrize(("name", "order"), CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_every_attention_cache_this_vllm_builds_is_addressed_where_attention_reads(name: str, order: str) -> None:
    """For every layer, K/V, block, token and head: kvpush's address is where the attention backend reads.

    CPU attention packs a (block, head) chunk its own way (K rows then V
    rows), so kvpush moves whole chunks (``BLOCK``): there the check is that
    each chunk kvpush moves holds exactly the bytes the kernel reads for it.
    """
    caches, config = build(name, order)
    attention = dict.fromkeys(NAMES, name)
    spec = vl.vllm_cache_spec(VLLM_CONFIG, config, NAMES, attention, RANK, TP, caches=caches)
    mla = "MLA" in name
    assert (spec.num_heads, spec.local_heads, spec.head_start) == ((1, 1, 0) if mla else (HEADS, LOCAL, RANK * LOCAL))
    layout = describe(name, caches, spec)
    heads, kvs = (1, 1) if mla else (LOCAL, 2)
    if name == "CPU_ATTN":
        assert layout.order is TokenOrder.BLOCK
        chunk = BS * layout.head_bytes
        for li, cache in enumerate(caches.values()):
            for b in range(NB):
                for h in range(heads):
                    start = layout.regions[li].base + b * layout.block_stride + h * chunk
                    row = range(D * cache.element_size())  # one token's K (or V) row
                    read = {reads(name, cache, kv, b, t, h) + e for kv in (0, 1) for t in range(BS) for e in row}
                    assert read == set(range(start, start + chunk)), (li, b, h)
        return
    if not mla and not VIEWS:
        assert layout.order is (TokenOrder.NHD if order == "NHD" else TokenOrder.HND)
    rng = np.random.default_rng(0)
    for li, cache in enumerate(caches.values()):
        for b in range(NB):
            for tok in [*rng.choice(BS, 5, replace=False).tolist(), 0, BS - 1]:
                for h in range(heads):
                    for kv in range(kvs):
                        want = reads(name, cache, kv, b, tok, h)
                        assert kvpush_addr(layout, spec, li, kv, b, tok, h) == want, (li, kv, b, tok, h)


def test_the_axes_follow_the_shape_this_vllm_hands() -> None:
    """vLLM 0.29 and later: ``[blocks, heads, tokens, K|V]`` views; earlier: FlashAttention's own
    ``[blocks, 2, tokens, heads, head]``, MLA's ``[blocks, tokens, latent]``, CPU attention's
    ``[blocks, heads, tokens, K|V]``; without the tensors the views are assumed."""
    want = {"FLASH_ATTN": "BHNC" if VIEWS else "BKNHC", "TRITON_MLA": "BHNC" if VIEWS else "BNC", "CPU_ATTN": "BHNC"}
    for name, axes in want.items():
        caches, config = build(name, "NHD")
        spec = vl.vllm_cache_spec(VLLM_CONFIG, config, NAMES, dict.fromkeys(NAMES, name), RANK, TP, caches=caches)
        assert spec.axes == axes, name
        content = MLA_D if "MLA" in name else (D if axes == "BKNHC" else 2 * D)
        assert spec.head_dim == content, name
        assert vl.vllm_cache_spec(VLLM_CONFIG, config, NAMES, dict.fromkeys(NAMES, name), RANK, TP).axes == "BHNC"


def test_a_cache_of_no_known_shape_is_refused_naming_it() -> None:
    """A cache whose shape is none vLLM declares for this geometry (here: split into kernel blocks of half
    the block size) is refused at start with its shape, strides and attention backend."""
    caches, config = build("FLASH_ATTN", "NHD")
    # Both allocations have the tokens of a block at axis 2: [B, H, N, C] and [B, 2, N, H, head].
    halves = {n: torch.empty((2 * NB, t.shape[1], BS // 2, *t.shape[3:]), dtype=t.dtype) for n, t in caches.items()}
    with pytest.raises(BackendError) as info:
        vl.vllm_cache_spec(VLLM_CONFIG, config, NAMES, dict.fromkeys(NAMES, "FLASH_ATTN"), RANK, TP, caches=halves)
    msg = str(info.value)
    first = next(iter(halves.values()))
    assert str(tuple(first.shape)) in msg and str(tuple(first.stride())) in msg and "'FLASH_ATTN'" in msg


def state_tensors(cache: Any, spec: Any) -> list[Any]:
    """The state tensors the GDN/Mamba kernels read: vLLM's list (before 0.29), or ``MambaBase``'s views of the
    raw page view (0.29 and later)."""
    if isinstance(cache, list | tuple):
        return list(cache)
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes,
        get_state_dtype=lambda: spec.dtypes,
        state_alignment=getattr(spec, "state_alignment", 1),  # vLLM 0.34: each state starts aligned in its page
    )
    MambaBase.bind_kv_cache(layer, cache)
    return list(layer.kv_cache)


STATE_ALIGNMENT = "state_alignment" in {f.name for f in dataclasses.fields(MambaSpec)}
"""vLLM 0.34 on: ``MambaSpec.state_alignment`` starts each state of a page on that many bytes."""


@pytest.mark.parametrize(
    ("shapes", "alignment", "nbytes"),
    [
        (((3, 64), (2, 8, 8)), 1, 3 * 64 * 2 + 2 * 8 * 8 * 4),
        pytest.param(
            ((3, 5), (2, 3, 3)),
            16,
            32 + 80,  # 30 bytes of conv state padded to 32, then 72 of ssm state to 80
            marks=pytest.mark.skipif(not STATE_ALIGNMENT, reason="this vLLM packs states with no alignment"),
        ),
    ],
)
def test_state_regions_cover_exactly_the_states_this_vllm_builds(
    shapes: tuple[tuple[int, ...], ...], alignment: int, nbytes: int
) -> None:
    """A GDN layer beside attention: each block's state region is exactly the bytes of that block's conv and
    ssm states (with the padding between them, where vLLM aligns each state), wherever this vLLM puts them
    (per-state tensors or a page view), and its size is the spec's states (computed from ``shapes``/``dtypes``
    where vLLM declares no ``state_content_size_bytes``)."""
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=LOCAL, head_size=D, dtype=torch.bfloat16)
    page = attn.page_size_bytes
    aligned = {"state_alignment": alignment} if STATE_ALIGNMENT else {}
    state = MambaSpec(
        block_size=4096,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
        mamba_cache_mode="none",
        **aligned,
    )
    gdn, full = ["model.layers.0.linear_attn"], ["model.layers.1.self_attn.attn"]
    config = groups_config([(state, gdn), (attn, full)], page)
    if VIEWS:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    else:
        caches = per_layer_caches(config, [backend_class("CPU_ATTN"), backend_class("CPU_ATTN")])
    names = gdn + full
    attention = {full[0]: caches[full[0]]}
    spec = vl.vllm_cache_spec(VLLM_CONFIG, config, full, {full[0]: "CPU_ATTN"}, RANK, TP, caches=attention)
    layout = vl.with_states(HostBackend().describe(attention, spec), names, full, caches, config)
    (group,) = layout.states
    assert group.nbytes == nbytes
    region = next(r for r in layout.regions if r.layer == 0)
    tensors = state_tensors(caches[gdn[0]], state)
    for b in range(NB):
        start = region.base + b * group.block_stride
        held = set()
        for t in tensors:
            lo = int(t[b].data_ptr())
            held |= set(range(lo, lo + t[b].numel() * t.element_size()))
        last = max(held) + 1
        assert held <= set(range(start, start + group.nbytes)) and min(held) == start, b
        assert start + group.nbytes - last < alignment, b  # the region ends with the last state's padding
        if alignment == 1:
            assert held == set(range(start, start + group.nbytes)), b
