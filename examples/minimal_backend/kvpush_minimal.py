"""The smallest complete kvpush backend: KV caches are numpy arrays in host memory.

It is the worked example of docs/backends.md, written the way a backend for a
new device starts: every method the core calls, plus the optional test
support, with nothing borrowed from the built-in host backend. It passes the
conformance suite without being installed:

    PYTHONPATH=examples/minimal_backend kvpush conformance --backend kvpush_minimal:MinimalBackend

A device backend replaces the numpy parts: addresses come from the device
allocator, ``mem`` is ``VRAM``, pack/unpack are device copies, and
``record_ready``/``wait_ready`` order the device's work (e.g. an event).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, CacheSpec, StagingBuffer
from kvpush.backends.testing import TestSupport
from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "uint8": np.uint8}


ORDERS = {"KBNHC": TokenOrder.NHD, "KBHNC": TokenOrder.HND}
"""The caches it takes: ``[2, blocks, tokens, heads, dim]`` or ``[2, blocks, heads, tokens, dim]``, dense."""


def block_shape(spec: CacheSpec) -> tuple[int, int, int]:
    """One block of one rank: ``[tokens, heads, dim]`` (NHD) or ``[heads, tokens, dim]`` (HND)."""
    if spec.axes not in ORDERS:
        raise BackendError(f"axes {spec.axes!r}: this backend takes {', '.join(ORDERS)}")
    if ORDERS[spec.axes] is TokenOrder.NHD:
        return (spec.block_size, spec.local_heads, spec.head_dim)
    return (spec.local_heads, spec.block_size, spec.head_dim)


class MinimalBackend(TestSupport, Backend):
    """KV as one numpy array per layer, ``[2, num_blocks, *block]``: K blocks, then V blocks."""

    name = "minimal"
    mem = MemKind.DRAM  # what NIXL registers the memory as

    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        """Each layer gives two regions (its K half, its V half) of ``num_blocks`` dense blocks."""
        if not kv_caches:
            raise BackendError("no KV cache tensors given")
        want = block_shape(spec)
        regions: list[Region] = []
        first: np.ndarray | None = None
        for layer, (name, t) in enumerate(kv_caches.items()):
            if not isinstance(t, np.ndarray):
                raise BackendError(f"layer {name}: expected a numpy array, got {type(t).__name__}")
            if t.ndim != 5 or t.shape[0] != 2 or t.shape[2:] != want:
                raise BackendError(f"layer {name}: shape {t.shape} is not [2, num_blocks, {', '.join(map(str, want))}]")
            if not t.flags.c_contiguous:
                raise BackendError(f"layer {name}: not C-contiguous, blocks are not where the layout says")
            if first is not None and (t.shape, t.dtype) != (first.shape, first.dtype):
                raise BackendError(f"layer {name}: shape or dtype differs from the first layer's")
            first = t
            half = t.nbytes // 2
            regions += [Region(t.ctypes.data, half, layer=layer), Region(t.ctypes.data + half, half, layer=layer)]
        assert first is not None
        block_bytes = int(np.prod(want)) * first.itemsize
        return KVLayout(
            block_size=spec.block_size,
            num_blocks=first.shape[1],
            block_stride=block_bytes,  # blocks are back to back
            head_bytes=spec.head_dim * first.itemsize,
            num_heads=spec.num_heads,
            head_start=spec.head_start,
            local_heads=spec.local_heads,
            order=ORDERS[spec.axes],
            mem=self.mem,
            dtype=spec.dtype,
            regions=tuple(regions),
        ).validate()

    # registrations(): the base class registers each layer's K and V regions (merged: they touch).
    # record_ready()/wait_ready(): host writes by the engine's thread are done when it hands over: no-ops.

    def alloc_staging(self, nbytes: int, device_id: int = 0) -> StagingBuffer:
        buf = np.zeros(nbytes, dtype=np.uint8)
        return StagingBuffer(buf.ctypes.data, nbytes, device_id, self.mem, owner=buf)  # owner keeps it alive

    def pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        """Copy each region's ``(offset, length)`` pieces, region after region, to the staging buffer."""
        pos = staging_addr
        for base in regions:
            for off, length in pieces.tolist():
                ctypes.memmove(pos, base + off, length)
                pos += length

    def unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        """The inverse of ``pack``."""
        pos = staging_addr
        for base in regions:
            for off, length in pieces.tolist():
                ctypes.memmove(base + off, pos, length)
                pos += length

    # -- test support: what `kvpush conformance` needs to allocate and inspect caches --------------

    def make_test_cache(self, spec: CacheSpec, num_layers: int, num_blocks: int, device: int = 0) -> dict[str, Any]:
        shape = (2, num_blocks, *block_shape(spec))
        return {f"layer{i}": np.empty(shape, dtype=NUMPY_DTYPES[spec.dtype]) for i in range(num_layers)}

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        tensor.reshape(-1).view(np.uint8)[:] = data

    def read_bytes(self, tensor: Any) -> np.ndarray:
        return tensor.reshape(-1).view(np.uint8).copy()
