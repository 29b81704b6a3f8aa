"""Tensor introspection shared by backends, without importing any framework.

Backends receive torch tensors (vLLM) or numpy arrays (tests, NxDI host
buffers); both expose the same facts through different names. Duck typing
keeps the core free of a torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.backends.base import CacheSpec
from kvpush.errors import BackendError
from kvpush.layout import KVLayout, MemKind, Region, TokenOrder


@dataclass(frozen=True)
class TensorInfo:
    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    dtype: str
    device_type: str
    device_index: int
    nbytes_span: int  # bytes from addr to the end of the last element


def tensor_info(t: Any) -> TensorInfo:
    """Address, shape and byte strides of a torch tensor or numpy array."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):
        item = int(t.element_size())
        shape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) * item for s in t.stride())
        dev = t.device
        dtype = str(t.dtype).removeprefix("torch.")
        addr, dev_type, dev_index = int(t.data_ptr()), dev.type, dev.index or 0
    elif hasattr(t, "__array_interface__"):
        item = int(t.itemsize)
        shape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) for s in t.strides)
        addr, dtype, dev_type, dev_index = int(t.ctypes.data), str(t.dtype), "cpu", 0
    else:
        raise BackendError(f"unsupported KV tensor type {type(t).__name__}: need a torch tensor or numpy array")
    span = item + sum((s - 1) * st for s, st in zip(shape, strides, strict=True) if s > 0)
    return TensorInfo(addr, shape, strides, item, dtype, dev_type, dev_index, span)


def describe_paged(
    kv_caches: dict[str, Any],
    spec: CacheSpec,
    mem: MemKind,
    device_type: str,
) -> KVLayout:
    """Layout of paged per-layer caches, ``[2, num_blocks, ...]`` or ``[num_blocks, ...]``.

    The per-block part is ``[block_size, heads, dim]`` (NHD) or
    ``[heads, block_size, dim]`` (HND), contiguous. Layers are taken in the
    order of ``kv_caches`` (callers pass them in model order).
    """
    if not kv_caches:
        raise BackendError("no KV cache tensors given")
    order = TokenOrder(spec.order)
    if spec.tp_size < 1 or not 0 <= spec.tp_rank < spec.tp_size:
        raise BackendError(f"bad TP rank {spec.tp_rank} of {spec.tp_size}")
    if spec.num_heads < 1 or (spec.num_heads % spec.tp_size and spec.tp_size % spec.num_heads):
        raise BackendError(f"{spec.num_heads} KV heads cannot be sharded over TP {spec.tp_size}")
    local = max(1, spec.num_heads // spec.tp_size)
    # As vLLM shards KV heads (QKVParallelLinear): with more ranks than heads, each head is
    # replicated on tp/num_heads *consecutive* ranks, so rank r holds head r // (tp/num_heads).
    head_start = spec.tp_rank * spec.num_heads // spec.tp_size
    regions: list[Region] = []
    first: tuple[int, int, int, int] | None = None
    for layer, (name, t) in enumerate(kv_caches.items()):
        info = tensor_info(t)
        if info.device_type != device_type:
            raise BackendError(f"layer {name}: tensor is on {info.device_type}, this backend handles {device_type}")
        shape, strides = info.shape, info.strides
        if spec.kv_inner:
            regions.extend(_inner_kv_regions(name, info, spec, local, layer))
            geom = (shape[0], strides[0], info.itemsize, info.device_index)
            if first is not None and geom != first:
                raise BackendError(f"layer {name}: geometry {geom} differs from the first layer's {first}")
            first = geom
            continue
        kv_axes = 1 if spec.kv_split else 0
        if spec.kv_split and (len(shape) != 5 or shape[0] != 2):
            raise BackendError(f"layer {name}: expected [2, num_blocks, ...] with 5 dims, got shape {shape}")
        if not spec.kv_split and len(shape) != 4:
            raise BackendError(f"layer {name}: expected [num_blocks, ...] with 4 dims, got shape {shape}")
        num_blocks = shape[kv_axes]
        inner = shape[kv_axes + 1 :]
        want = (
            (spec.block_size, local, spec.head_dim)
            if order is TokenOrder.NHD
            else (local, spec.block_size, spec.head_dim)
        )
        if inner != want:
            raise BackendError(f"layer {name}: block shape {inner} is not {order.value} {want}")
        inner_strides = strides[kv_axes + 1 :]
        exp = (inner[1] * inner[2] * info.itemsize, inner[2] * info.itemsize, info.itemsize)
        if inner_strides != exp:
            raise BackendError(f"layer {name}: a block is not contiguous (strides {inner_strides})")
        block_stride = strides[kv_axes]
        geom = (num_blocks, block_stride, info.itemsize, info.device_index)
        if first is None:
            first = geom
        elif geom != first:
            raise BackendError(f"layer {name}: geometry {geom} differs from the first layer's {first}")
        span = (num_blocks - 1) * block_stride + spec.block_size * local * spec.head_dim * info.itemsize
        for kv in range(2 if spec.kv_split else 1):
            base = info.addr + kv * (strides[0] if spec.kv_split else 0)
            regions.append(Region(base=base, size=span, device_id=info.device_index, layer=layer))
    assert first is not None
    return KVLayout(
        block_size=spec.block_size,
        num_blocks=first[0],
        block_stride=first[1],
        head_bytes=spec.head_dim * first[2] * (2 if spec.kv_inner else 1),
        num_heads=spec.num_heads,
        head_start=head_start,
        local_heads=local,
        order=TokenOrder.BLOCK if spec.kv_inner else order,
        mem=mem,
        dtype=spec.dtype,
        regions=tuple(regions),
    ).validate()


def _inner_kv_regions(name: str, info: TensorInfo, spec: CacheSpec, local: int, layer: int) -> list[Region]:
    """One region per layer for vLLM's CPU cache ``[num_blocks, heads, block_size, 2 * dim]``.

    The CPU attention kernels pack K and V inside a block their own way (the
    tensor shape does not say how), so the layout is opaque: whole blocks.
    """
    shape, strides, item = info.shape, info.strides, info.itemsize
    want = (local, spec.block_size, 2 * spec.head_dim)
    if len(shape) != 4 or shape[1:] != want:
        raise BackendError(f"layer {name}: expected [num_blocks, {', '.join(map(str, want))}], got {shape}")
    if strides[0] != local * spec.block_size * 2 * spec.head_dim * item:
        raise BackendError(f"layer {name}: blocks are not contiguous (strides {strides})")
    return [Region(info.addr, shape[0] * strides[0], info.device_index, layer=layer)]
