"""Shared helpers for the CUDA backend tests (CPU and GPU); a plain module with a unique name, not a conftest."""

from __future__ import annotations

import threading
from typing import Any

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


def region_bytes(torch_mod: Any, addr: int, size: int, dev: int) -> np.ndarray:
    """The bytes of device memory ``[addr, addr + size)`` on ``dev``, copied to the host."""
    from kvpush_cuda.copy import _RawCuda

    return torch_mod.as_tensor(_RawCuda(addr, size, 1), device=f"cuda:{dev}").cpu().numpy()


def peer_child(conn: Any, dev: int) -> None:
    """D's process of the peer copy test: a zeroed KV cache on ``dev`` exported for peer copies; sends
    (blob, layout), then each region's bytes when asked."""
    import torch as t

    from kvpush_cuda import CudaBackend
    from kvpush_cuda.variants import make_kv

    t.cuda.set_device(dev)
    be = CudaBackend(device=dev)
    kv = make_kv(t, "LBNHC", 3, 32, 16, 2, 64, t.bfloat16, f"cuda:{dev}")
    for x in kv.values():
        x.zero_()
    layout = be.describe(kv, spec_for("LBNHC", 16, 2, 64))
    # Exported from a thread that never touched CUDA, as D's engine thread does.
    box: list[Any] = []
    th = threading.Thread(target=lambda: box.append(be.export_peer(layout)))
    th.start()
    th.join()
    conn.send((box[0], layout))
    if conn.recv() == "read":
        t.cuda.synchronize(dev)
        conn.send([region_bytes(t, r.base, r.size, dev) for r in layout.regions])
        conn.recv()
