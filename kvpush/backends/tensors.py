"""The one strided-tensor describer every backend uses, without importing any framework.

Engines hand the connector one tensor per layer whose *strides* say more than
their shapes: vLLM (0.32 and later) gives every attention backend's cache as
a ``[blocks, heads, tokens, content]`` view and the physical order (token- or
head-major, blocks of all layers interleaved or not) only shows in the
strides; older vLLM and NxDI add a K/V axis in front of or behind the blocks,
and older vLLM's MLA caches have no head axis (``[blocks, tokens, latent]``:
one head). ``describe_strided`` names each axis from ``CacheSpec.axes``, checks the
sizes against what the engine said, and reads from the strides:
- the block stride (how far apart two blocks of one layer are),
- the in-block order (``NHD`` or ``HND``), requiring every block dense,
- the K/V offset (two regions per layer) when there is a K/V axis.
So every variant becomes regions of equally spaced dense blocks: what
``kvpush.core.layout`` maps and coalesces. Duck typing (torch tensors, numpy
arrays, anything with the same attributes) keeps the core free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.backends.base import CacheSpec, MemRegistration
from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder

AXES = "BHNCK"
"""Axis names ``CacheSpec.axes`` may use: blocks, heads, tokens, content, K/V. ``B``, ``N`` and ``C`` are
required; without ``H`` a tensor holds one head (a rank holding more is refused); ``K`` is optional."""


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


def storage_span(t: Any, info: TensorInfo) -> tuple[int, int]:
    """``(lo, hi)`` of the allocation behind ``t``: registrations never span two allocations."""
    if hasattr(t, "untyped_storage"):
        s = t.untyped_storage()
        return int(s.data_ptr()), int(s.data_ptr()) + int(s.nbytes())
    root = t
    while getattr(root, "base", None) is not None and hasattr(root.base, "__array_interface__"):
        root = root.base
    if root is not t and hasattr(root, "ctypes"):
        return int(root.ctypes.data), int(root.ctypes.data) + int(root.nbytes)
    return info.addr, info.addr + info.nbytes_span


@dataclass(frozen=True)
class _Geometry:
    """What must be equal for every layer, so one piece list serves all regions."""

    num_blocks: int
    block_stride: int
    itemsize: int
    device_index: int
    order: TokenOrder


@dataclass(frozen=True)
class _Layer:
    geometry: _Geometry
    bases: tuple[int, ...]  # one per region of the layer (K, V or a single K|V region)
    size: int


def check_spec(spec: CacheSpec) -> None:
    """Raise ``BackendError`` for a spec no cache can match (TP, heads, axes)."""
    if spec.tp_size < 1 or not 0 <= spec.tp_rank < spec.tp_size:
        raise BackendError(f"bad TP rank {spec.tp_rank} of {spec.tp_size}")
    if spec.num_heads < 1 or (spec.num_heads % spec.tp_size and spec.tp_size % spec.num_heads):
        raise BackendError(f"{spec.num_heads} KV heads cannot be sharded over TP {spec.tp_size}")
    axes = spec.axes
    if len(set(axes)) != len(axes) or set(axes) - set(AXES) or set("BNC") - set(axes):
        raise BackendError(
            f"axes {axes!r}: need each of B, N, C once and optionally H and K (e.g. 'BHNC', 'KBNHC', 'BNC')"
        )
    if "H" not in axes and spec.local_heads != 1:
        raise BackendError(
            f"axes {axes!r} have no head axis, so a tensor holds one head; this rank holds {spec.local_heads}"
        )


def _block_order(name: str, info: TensorInfo, spec: CacheSpec, ax: dict[str, int]) -> TokenOrder:
    """Physical order of tokens and heads inside a block, which must be dense (content contiguous too)."""
    bs, local, c, item = spec.block_size, spec.local_heads, spec.head_dim, info.itemsize
    st_n, st_c = info.strides[ax["N"]], info.strides[ax["C"]]
    # Without a head axis the one head sits inside the token (NHD, which then places the same bytes as HND).
    st_h, h_at = (info.strides[ax["H"]], ax["H"]) if "H" in ax else (c * item, len(info.shape))
    if c > 1 and st_c != item:
        raise BackendError(f"layer {name}: a head's content is not contiguous (stride {st_c} bytes, element {item})")
    nhd = (bs == 1 or st_n == local * c * item) and (local == 1 or st_h == c * item)
    hnd = (local == 1 or st_h == bs * c * item) and (bs == 1 or st_n == c * item)
    if nhd and hnd:  # one head or one token a block: both orders place the same bytes
        return TokenOrder.NHD if ax["N"] < h_at else TokenOrder.HND
    if nhd:
        return TokenOrder.NHD
    if hnd:
        return TokenOrder.HND
    raise BackendError(
        f"layer {name}: a block is not dense (token stride {st_n}, head stride {st_h} bytes); "
        "kvpush needs each block's tokens x heads x content in one piece"
    )


def _layer(name: str, t: Any, spec: CacheSpec, device_type: str, opaque: bool) -> tuple[_Layer, TensorInfo]:
    info = tensor_info(t)
    if info.device_type != device_type:
        raise BackendError(f"layer {name}: tensor is on {info.device_type}, this backend handles {device_type}")
    if len(info.shape) != len(spec.axes):
        raise BackendError(
            f"layer {name}: shape {info.shape} has {len(info.shape)} dims, axes {spec.axes!r} name {len(spec.axes)}"
        )
    ax = {a: i for i, a in enumerate(spec.axes)}
    want = {"H": spec.local_heads, "N": spec.block_size, "C": spec.head_dim, "K": 2}
    for a, n in want.items():
        if a in ax and info.shape[ax[a]] != n:
            raise BackendError(
                f"layer {name}: shape {info.shape} (axes {spec.axes}) has {a}={info.shape[ax[a]]}, expected {n} "
                f"(block_size {spec.block_size}, {spec.local_heads} local heads, head content {spec.head_dim})"
            )
    order = _block_order(name, info, spec, ax)
    if opaque and order is not TokenOrder.HND and spec.local_heads > 1:
        raise BackendError(f"layer {name}: {spec.attention} blocks must be head-major (HND) to move head by head")
    block_bytes = spec.block_size * spec.local_heads * spec.head_dim * info.itemsize
    num_blocks = info.shape[ax["B"]]
    stride = info.strides[ax["B"]] if num_blocks > 1 else block_bytes
    if stride < block_bytes:
        raise BackendError(f"layer {name}: blocks overlap (block stride {stride} < block bytes {block_bytes})")
    bases = (info.addr,)
    if "K" in ax:
        kv = info.strides[ax["K"]]
        if kv < block_bytes:
            raise BackendError(f"layer {name}: K and V overlap (K/V stride {kv} bytes < block bytes {block_bytes})")
        bases = (info.addr, info.addr + kv)
    geom = _Geometry(num_blocks, stride, info.itemsize, info.device_index, TokenOrder.BLOCK if opaque else order)
    return _Layer(geom, bases, (num_blocks - 1) * stride + block_bytes), info


def describe_strided(
    kv_caches: dict[str, Any],
    spec: CacheSpec,
    mem: MemKind,
    device_type: str,
    opaque: bool = False,
) -> tuple[KVLayout, dict[int, tuple[int, int]]]:
    """Layout of per-layer KV tensors, plus each region's allocation span (region base -> ``(lo, hi)``).

    Layers are taken in the order of ``kv_caches`` (the connector passes them
    in model order), K before V when there is a K/V axis. ``opaque``: the
    attention kernel packs each (block, head) chunk its own way, so the
    layout is ``BLOCK`` (whole blocks, head by head). The span map lets
    ``allocation_registrations`` register whole allocations.
    """
    if not kv_caches:
        raise BackendError("no KV cache tensors given")
    check_spec(spec)
    groups = spec.layer_groups or (0,) * len(kv_caches)
    if len(groups) != len(kv_caches):
        raise BackendError(f"{len(groups)} layer groups given for {len(kv_caches)} KV tensors")
    regions: list[Region] = []
    spans: dict[int, tuple[int, int]] = {}
    first: _Geometry | None = None
    if spec.tensors_per_layer < 1 or len(kv_caches) % spec.tensors_per_layer:
        raise BackendError(f"{len(kv_caches)} KV tensors are not {spec.tensors_per_layer} a layer")
    for i, (name, t) in enumerate(kv_caches.items()):
        layer = i // spec.tensors_per_layer
        desc, info = _layer(name, t, spec, device_type, opaque)
        if first is None:
            first = desc.geometry
        elif desc.geometry != first:
            raise BackendError(f"layer {name}: geometry {desc.geometry} differs from the first layer's {first}")
        span = storage_span(t, info)
        for base in desc.bases:
            regions.append(Region(base, desc.size, info.device_index, group=groups[i], layer=layer))
            spans[base] = span
    assert first is not None
    layout = KVLayout(
        block_size=spec.block_size,
        num_blocks=first.num_blocks,
        block_stride=first.block_stride,
        head_bytes=spec.head_dim * first.itemsize,
        num_heads=spec.num_heads,
        head_start=spec.head_start,
        local_heads=spec.local_heads,
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
    next allocation: a CUDA IPC registration that spans two allocations maps
    the first one's handle and misplaces writes into the second.
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
