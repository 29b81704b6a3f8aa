"""KV-cache tensors shaped and strided as vLLM's attention backends hand them to a connector.

Used by the tests and the benchmark to build every variant ``describe``
supports, and to read any of them back in one canonical logical order
``[kv, block, token, head, content]``, so a transfer between two variants is
checked byte for byte with ``torch.equal``.

Two generations:
- vLLM 0.32 and later (``vllm/v1/kv_cache_interface.py``,
  ``create_kv_cache_views``): one flat buffer per KV-cache tensor, viewed as
  ``[L, B, H, N, C]`` with strides in one of six ``KVCacheLayout`` orders;
  each layer gets the ``[B, H, N, C]`` slice, ``C`` holding the head's K then
  V (``head_size + head_size_v``), or MLA's latent with one head slot.
  FlashAttention, FlashInfer and Triton attention read K and V by splitting
  ``C``. Variants ``LBNHC`` (the default order, NHD), ``LBHNC`` (HND),
  ``BLNHC`` and ``BLHNC`` (a block of every layer side by side), ``mla``;
  ``LHBNC`` and ``BHLNC`` keep a block's heads apart (not dense): refused.
- vLLM before 0.29 (0.24: ``vllm/v1/worker/gpu/attn_utils.py``,
  ``_reshape_attention_kv_cache``): one allocation per layer, viewed in the
  attention backend's ``get_kv_cache_shape`` with the memory order of its
  ``get_kv_cache_stride_order``. FlashAttention, FlashInfer, Triton and Flex
  attention: ``[nb, 2, bs, h, d]``, ``v024_nhd`` (stride order identity) and
  ``v024_hnd`` (``(0, 1, 3, 2, 4)``: ``[nb, 2, h, bs, d]`` memory);
  ``v024_cross_layer``: the one ``[nb, layers, 2, bs, h, d]`` buffer of
  ``allocate_uniform_kv_caches`` (NHD), each layer a ``[nb, 2, bs, h, d]``
  view; MLA: ``v024_mla`` ``[nb, bs, d]`` (no head axis).
- K/V outermost (vLLM's ROCm backends, older vLLM): ``old_flash_nhd``
  ``[2, nb, bs, h, d]``, ``old_flash_hnd`` (HND strides); ``old_mla``
  ``[nb, bs, 1, d]``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4)}
LAYOUTS |= {"BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
"""vLLM's ``KVCacheLayout`` stride orders: physical order of the logical axes ``[L, B, H, N, C]``."""
VARIANTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "mla")
VARIANTS += ("v024_nhd", "v024_hnd", "v024_cross_layer", "v024_mla")
VARIANTS += ("old_flash_nhd", "old_flash_hnd", "old_mla")
V024_STRIDE_ORDER = {"v024_nhd": (0, 1, 2, 3, 4), "v024_hnd": (0, 1, 3, 2, 4)}
"""vLLM 0.24's ``get_kv_cache_stride_order`` of FlashAttention, FlashInfer and Triton (NHD, HND): the memory
order of the logical ``[nb, 2, bs, h, d]``."""
REFUSED = ("LHBNC", "BHLNC")
"""Orders whose blocks are not dense for one layer (a block's heads sit a layer or more apart)."""


def axes(variant: str) -> str:
    """``CacheSpec.axes`` for the variant's per-layer tensors."""
    if variant in LAYOUTS or variant == "mla":
        return "BHNC"
    if variant.startswith("v024_"):
        return "BNC" if variant == "v024_mla" else "BKNHC"
    return {"old_mla": "BNHC"}.get(variant, "KBNHC")


def is_mla(variant: str) -> bool:
    return variant in ("mla", "v024_mla", "old_mla")


def content(variant: str, head_dim: int) -> int:
    """Elements of one head's per-token content: K and V together in vLLM 0.32's non-MLA layouts."""
    return 2 * head_dim if variant in LAYOUTS else head_dim


def _strided(torch: ModuleType, order: tuple[int, ...], shape: tuple[int, ...], **kw: Any) -> Any:
    """A ``[L, B, H, N, C]`` view whose memory order is ``order`` (as ``compute_layout_strides``)."""
    strides = [0] * 5
    acc = 1
    for dim in reversed(order):
        strides[dim] = acc
        acc *= shape[dim]
    raw = torch.empty(acc, **kw)
    return torch.as_strided(raw, shape, strides)


def make_kv(
    torch: ModuleType,
    variant: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: Any,
    device: Any,
) -> dict[str, Any]:
    """Per-layer tensors, in model order, as vLLM hands them to a connector (see the module docstring)."""
    L, nb, bs, h, d = num_layers, num_blocks, block_size, heads, head_dim
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    kw = {"dtype": dtype, "device": device}
    if variant in LAYOUTS or variant in REFUSED or variant == "mla":
        order = LAYOUTS["LBNHC"] if variant == "mla" else LAYOUTS[variant]
        c = d if variant == "mla" else 2 * d
        view = _strided(torch, order, (L, nb, 1 if variant == "mla" else h, bs, c), **kw)
        return {n: view[i] for i, n in enumerate(names)}
    if variant in V024_STRIDE_ORDER:  # as _reshape_attention_kv_cache: memory in stride order, then permuted back
        order = V024_STRIDE_ORDER[variant]
        logical = (nb, 2, bs, h, d)
        inv = [order.index(i) for i in range(5)]
        return {n: torch.empty(tuple(logical[i] for i in order), **kw).permute(*inv) for n in names}
    if variant == "v024_cross_layer":  # allocate_uniform_kv_caches, NHD: stride order (1, 0, 2, 3, 4, 5)
        buf = torch.empty((nb, L, 2, bs, h, d), **kw)
        return {n: buf[:, i] for i, n in enumerate(names)}
    if variant == "v024_mla":
        return {n: torch.empty((nb, bs, d), **kw) for n in names}
    if variant == "old_flash_nhd":
        return {n: torch.empty((2, nb, bs, h, d), **kw) for n in names}
    if variant == "old_flash_hnd":
        return {n: torch.empty((2, nb, h, bs, d), **kw).permute(0, 1, 3, 2, 4) for n in names}
    if variant == "old_mla":
        return {n: torch.empty((nb, bs, 1, d), **kw) for n in names}
    raise ValueError(f"unknown KV variant {variant!r}; known: {', '.join(VARIANTS + REFUSED)}")


def canonical(t: Any, variant: str) -> Any:
    """A view of one layer's tensor as ``[kv, block, token, head, content]``."""
    if variant in LAYOUTS or variant == "mla":
        return t.transpose(1, 2).unsqueeze(0)  # [B, H, N, C] -> [1, B, N, H, C]
    if variant in ("v024_nhd", "v024_hnd", "v024_cross_layer"):
        return t.transpose(0, 1)
    if variant == "v024_mla":
        return t.unsqueeze(2).unsqueeze(0)  # [B, N, C] -> [1, B, N, 1, C]
    if variant == "old_mla":
        return t.unsqueeze(0)
    return t


def regions_per_layer(variant: str) -> int:
    """K and V apart in the per-layer shapes (all but MLA); one K|V region per layer in vLLM's views."""
    return 1 if variant in LAYOUTS or is_mla(variant) else 2


def shared_allocation(variant: str) -> bool:
    """Whether every layer's cache lies in one allocation (vLLM's views, the cross-layer buffer)."""
    return variant in LAYOUTS or variant in ("mla", "v024_cross_layer")
