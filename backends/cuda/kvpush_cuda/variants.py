"""KV-cache tensors shaped as vLLM's attention backends allocate them.

Used by the tests and the benchmark to build every variant ``describe``
supports, and to read any of them back in one canonical logical order
``[kv, block, token, head, dim]``, so a transfer between two variants is
checked byte for byte with ``torch.equal``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

VARIANTS = ("flash_nhd", "flash_hnd", "flashinfer", "cross_layer", "shared_buffer", "mla")


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
    """Per-layer tensors, in model order, as vLLM hands them to a connector.

    - flash_nhd: ``[2, nb, bs, h, d]`` per layer (FlashAttention).
    - flash_hnd: same shape, head-major strides (``VLLM_KV_CACHE_LAYOUT=HND``).
    - flashinfer: ``[nb, 2, bs, h, d]``: K and V of a block side by side.
    - cross_layer: one ``[nb, layers, 2, bs, h, d]`` buffer; each layer a strided view.
    - shared_buffer: one flat buffer sliced per layer (vLLM's raw KV tensor).
    - mla: ``[nb, bs, 1, d]`` per layer, no K/V split (``kv_split=False``).
    """
    L, nb, bs, h, d = num_layers, num_blocks, block_size, heads, head_dim
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    kw = {"dtype": dtype, "device": device}
    if variant == "flash_nhd":
        return {n: torch.empty((2, nb, bs, h, d), **kw) for n in names}
    if variant == "flash_hnd":
        return {n: torch.empty((2, nb, h, bs, d), **kw).permute(0, 1, 3, 2, 4) for n in names}
    if variant == "flashinfer":
        return {n: torch.empty((nb, 2, bs, h, d), **kw) for n in names}
    if variant == "cross_layer":
        buf = torch.empty((nb, L, 2, bs, h, d), **kw)
        return {n: buf[:, i].permute(1, 0, 2, 3, 4) for i, n in enumerate(names)}
    if variant == "shared_buffer":
        per = 2 * nb * bs * h * d
        raw = torch.empty(L * per, **kw)
        return {n: raw[i * per : (i + 1) * per].view(2, nb, bs, h, d) for i, n in enumerate(names)}
    if variant == "mla":
        return {n: torch.empty((nb, bs, 1, d), **kw) for n in names}
    raise ValueError(f"unknown KV variant {variant!r}; known: {', '.join(VARIANTS)}")


def canonical(t: Any, variant: str) -> Any:
    """A view of one layer's tensor as ``[kv, block, token, head, dim]``."""
    if variant == "flashinfer":
        return t.transpose(0, 1)
    if variant == "mla":
        return t.unsqueeze(0)
    return t


def kv_split(variant: str) -> bool:
    """Whether the variant holds K and V separately (all but MLA)."""
    return variant != "mla"
