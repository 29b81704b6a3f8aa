"""vLLM's CUDA KV-cache tensors as a kvpush ``KVLayout``, read from strides.

vLLM hands the connector one tensor per layer, but their shape says less
than their strides:
- FlashAttention: ``[2, num_blocks, block_size, heads, dim]``; with
  ``VLLM_KV_CACHE_LAYOUT=HND`` the shape stays the same and the strides make
  it head-major in memory.
- FlashInfer: ``[num_blocks, 2, block_size, heads, dim]``: K and V of a
  block sit side by side, so a region's block stride is twice a block.
- Cross-layer layout (one allocation, a block holds every layer): each layer
  is a strided view, so its blocks are ``num_layers * 2`` blocks apart.
- MLA (``kv_split=False``): ``[num_blocks, block_size, heads, dim]``.
The physical in-block order and the block stride are read from the strides,
so every variant becomes regions of equally spaced, dense blocks: what
``kvpush.layout`` maps and coalesces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.backends.base import CacheSpec, MemRegistration
from kvpush.backends.tensors import TensorInfo, tensor_info
from kvpush.errors import BackendError
from kvpush.layout import KVLayout, MemKind, Region, TokenOrder


@dataclass(frozen=True)
class _Geometry:
    """What must be equal for every layer, so one piece list serves all regions."""

    num_blocks: int
    block_stride: int
    itemsize: int
    device_index: int
    order: TokenOrder


def _axes(name: str, info: TensorInfo, spec: CacheSpec) -> tuple[int | None, int]:
    """(K/V axis or None, block axis) of a layer tensor."""
    shape = info.shape
    if not spec.kv_split:
        if len(shape) != 4:
            raise BackendError(f"layer {name}: expected [num_blocks, ...] with 4 dims (kv_split=False), got {shape}")
        return None, 0
    if len(shape) != 5:
        raise BackendError(f"layer {name}: expected 5 dims ([2, num_blocks, ...] or [num_blocks, 2, ...]), got {shape}")
    if shape[0] == 2:
        # [2, 2, ...] is ambiguous; FlashAttention's K/V-first order is vLLM's default.
        return 0, 1
    if shape[1] == 2:
        return 1, 0
    raise BackendError(f"layer {name}: no K/V axis of size 2 in front of the blocks, shape {shape}")


def _block_order(name: str, info: TensorInfo, spec: CacheSpec, local: int, first: int) -> TokenOrder:
    """Physical order of tokens and heads inside a block; the block must be dense."""
    inner = info.shape[first:]
    strides = info.strides[first:]
    bs, d, item = spec.block_size, spec.head_dim, info.itemsize
    nhd_shape, hnd_shape = (bs, local, d), (local, bs, d)
    if inner == nhd_shape and (inner != hnd_shape or spec.order == TokenOrder.NHD):
        st_tok, st_head = strides[0], strides[1]
    elif inner == hnd_shape:
        st_head, st_tok = strides[0], strides[1]
    else:
        raise BackendError(
            f"layer {name}: block shape {inner} is neither NHD {nhd_shape} nor HND {hnd_shape} "
            f"(block_size {bs}, {local} local heads, head_dim {d})"
        )
    if d > 1 and strides[2] != item:
        raise BackendError(f"layer {name}: head_dim is not contiguous (stride {strides[2]} bytes)")
    nhd = (bs == 1 or st_tok == local * d * item) and (local == 1 or st_head == d * item)
    hnd = (local == 1 or st_head == bs * d * item) and (bs == 1 or st_tok == d * item)
    if nhd and hnd:
        return TokenOrder(spec.order)
    if nhd:
        return TokenOrder.NHD
    if hnd:
        return TokenOrder.HND
    raise BackendError(
        f"layer {name}: a block is not dense (token stride {st_tok}, head stride {st_head} bytes); "
        "kvpush needs each block's tokens x heads x dim in one piece"
    )


def _storage_span(t: Any, info: TensorInfo) -> tuple[int, int]:
    """Bytes of the allocation behind ``t``: registrations never span two allocations."""
    if hasattr(t, "untyped_storage"):
        s = t.untyped_storage()
        return int(s.data_ptr()), int(s.data_ptr()) + int(s.nbytes())
    return info.addr, info.addr + info.nbytes_span


def describe_strided(
    kv_caches: dict[str, Any],
    spec: CacheSpec,
    device_type: str = "cuda",
    mem: MemKind = MemKind.VRAM,
) -> tuple[KVLayout, dict[int, tuple[int, int]]]:
    """Layout of per-layer KV tensors of any vLLM variant, plus each region's allocation span.

    Regions come in model order, K before V per layer, as the core expects on
    both sides. The span map (region base -> ``(lo, hi)`` of its allocation)
    lets ``registrations`` merge touching regions only inside one allocation:
    a NIXL/UCX registration that crosses two CUDA allocations gets the IPC
    handle of the first and silently misplaces writes into the second.
    """
    if not kv_caches:
        raise BackendError("no KV cache tensors given")
    if spec.tp_size < 1 or not 0 <= spec.tp_rank < spec.tp_size:
        raise BackendError(f"bad TP rank {spec.tp_rank} of {spec.tp_size}")
    if spec.num_heads < 1 or (spec.num_heads % spec.tp_size and spec.tp_size % spec.num_heads):
        raise BackendError(f"{spec.num_heads} KV heads cannot be sharded over TP {spec.tp_size}")
    if getattr(spec, "kv_inner", False):
        raise BackendError("kv_inner (vLLM's CPU cache layout) is not a CUDA layout; use backend 'host'")
    local = max(1, spec.num_heads // spec.tp_size)
    # As vLLM shards KV heads (and as kvpush.backends.tensors does): with more ranks than
    # heads, each head is replicated on tp/num_heads consecutive ranks.
    head_start = spec.tp_rank * spec.num_heads // spec.tp_size
    regions: list[Region] = []
    spans: dict[int, tuple[int, int]] = {}
    first: _Geometry | None = None
    block_bytes = 0
    for layer, (name, t) in enumerate(kv_caches.items()):
        info = tensor_info(t)
        if info.device_type != device_type:
            raise BackendError(f"layer {name}: tensor is on {info.device_type}, this backend handles {device_type}")
        kv_axis, blk_axis = _axes(name, info, spec)
        inner_first = 1 if kv_axis is None else 2
        order = _block_order(name, info, spec, local, inner_first)
        block_bytes = spec.block_size * local * spec.head_dim * info.itemsize
        num_blocks = info.shape[blk_axis]
        stride = info.strides[blk_axis] if num_blocks > 1 else block_bytes
        if stride < block_bytes:
            raise BackendError(f"layer {name}: blocks overlap (block stride {stride} < block bytes {block_bytes})")
        geom = _Geometry(num_blocks, stride, info.itemsize, info.device_index, order)
        if first is None:
            first = geom
        elif geom != first:
            raise BackendError(f"layer {name}: geometry {geom} differs from the first layer's {first}")
        size = (num_blocks - 1) * stride + block_bytes
        span = _storage_span(t, info)
        kv_bases = [info.addr] if kv_axis is None else [info.addr, info.addr + info.strides[kv_axis]]
        if kv_axis is not None and info.strides[kv_axis] < block_bytes:
            raise BackendError(f"layer {name}: K and V overlap (K/V stride {info.strides[kv_axis]} bytes)")
        for base in kv_bases:
            regions.append(Region(base=base, size=size, device_id=info.device_index, layer=layer))
            spans[base] = span
    assert first is not None
    layout = KVLayout(
        block_size=spec.block_size,
        num_blocks=first.num_blocks,
        block_stride=first.block_stride,
        head_bytes=spec.head_dim * first.itemsize,
        num_heads=spec.num_heads,
        head_start=head_start,
        local_heads=local,
        order=first.order,
        mem=mem,
        dtype=spec.dtype,
        regions=tuple(regions),
    ).validate()
    return layout, spans


def allocation_registrations(
    layout: KVLayout, spans: dict[int, tuple[int, int]]
) -> tuple[list[MemRegistration], list[Region]]:
    """One registration per allocation that holds regions, and the regions no span covers.

    Registering the whole allocation (not the union of its regions) keeps the
    count small (one for vLLM's shared KV buffer) and never crosses into the
    next allocation.
    """
    known: dict[tuple[int, int, int], None] = {}
    rest: list[Region] = []
    for r in layout.regions:
        span = spans.get(r.base)
        if span is not None and span[0] <= r.base and r.base + r.size <= span[1]:
            known[(span[0], span[1], r.device_id)] = None
        else:
            rest.append(r)
    return [MemRegistration(lo, hi - lo, dev, layout.mem) for lo, hi, dev in known], rest
