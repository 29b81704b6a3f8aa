"""Shared helpers for the CUDA backend tests (CPU and GPU); a plain module with a unique name, not a conftest."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpush.backends.base import CacheSpec  # noqa: E402
from kvpush.core.layout import KVLayout, TokenOrder  # noqa: E402
from kvpush_cuda.variants import axes, canonical, content, is_mla  # noqa: E402


def spec_for(variant: str, bs: int, heads: int, d: int, attention: str = "") -> CacheSpec:
    """The CacheSpec a vLLM worker would give for ``variant`` (``d``: head size; K|V content is twice it)."""
    h = 1 if is_mla(variant) else heads
    return CacheSpec(bs, h, content(variant, d), "bfloat16", axes=axes(variant), attention=attention)


def fill_random(kv: dict, seed: int) -> None:
    """Distinct random bits in every element (bf16 reinterpreted as int16, so NaNs compare as bytes)."""
    g = torch.Generator().manual_seed(seed)
    for t in kv.values():
        bits = torch.randint(-(2**15), 2**15, tuple(t.shape), dtype=torch.int16, generator=g)
        t.view(torch.int16).copy_(bits.to(t.device))


def expected_addr(layout: KVLayout, region: int, block: int, tok: int, head: int) -> int:
    """Address of (block, token, local head) in ``region`` by the layout's own rules."""
    if layout.order is TokenOrder.NHD:
        inner = (tok * layout.local_heads + head) * layout.head_bytes
    else:
        inner = (head * layout.block_size + tok) * layout.head_bytes
    return layout.regions[region].base + block * layout.block_stride + inner


def check_addresses(layout: KVLayout, kv: dict, variant: str, samples: int = 200, seed: int = 0) -> None:
    """Every sampled element's real address equals the one the layout computes."""
    rng = np.random.default_rng(seed)
    tensors = [canonical(t, variant) for t in kv.values()]  # [kv, block, token, head, content]
    nkv = tensors[0].shape[0]
    assert len(layout.regions) == len(tensors) * nkv
    for _ in range(samples):
        li = int(rng.integers(len(tensors)))
        c = tensors[li]
        k, b, tok, h = (int(rng.integers(n)) for n in c.shape[:4])
        real = c[k, b, tok, h].data_ptr()
        assert real == expected_addr(layout, li * nkv + k, b, tok, h), (variant, li, k, b, tok, h)


def blocks_equal(dst_kv: dict, dst_variant: str, dst_ids, src_kv: dict, src_variant: str, src_ids) -> bool:
    """Byte equality of the listed blocks of every layer, read in canonical order."""
    di = torch.as_tensor(np.asarray(dst_ids), dtype=torch.long)
    si = torch.as_tensor(np.asarray(src_ids), dtype=torch.long)
    for d, s in zip(dst_kv.values(), src_kv.values(), strict=True):
        a = canonical(d, dst_variant).view(torch.int16)[:, di.to(d.device)]
        b = canonical(s, src_variant).view(torch.int16)[:, si.to(s.device)]
        if not torch.equal(a.cpu(), b.cpu()):
            return False
    return True
