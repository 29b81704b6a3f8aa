"""Host DRAM backend: the reference backend for tests and CPU vLLM.

KV lives in CPU tensors or numpy arrays; the engine's thread wrote it before
handing the request over, so it is ready at once. Pack and unpack are memcpy
through numpy views of the raw memory.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, CacheSpec, StagingBuffer
from kvpush.backends.tensors import describe_paged
from kvpush.layout import KVLayout, MemKind


def _view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of raw memory, no copy."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def gather(regions: list[int], pieces: np.ndarray, out: np.ndarray) -> None:
    """Copy each region's pieces, in order, into ``out`` (uint8, contiguous)."""
    _move(regions, pieces, out, to_staging=True)


def scatter(regions: list[int], pieces: np.ndarray, src: np.ndarray) -> None:
    """Inverse of ``gather``."""
    _move(regions, pieces, src, to_staging=False)


def _move(regions: list[int], pieces: np.ndarray, buf: np.ndarray, to_staging: bool) -> None:
    if pieces.size == 0:
        return
    offs, lens = pieces[:, 0], pieces[:, 1]
    per_region = int(lens.sum())
    span = int((offs + lens).max())
    uniform = bool((lens == lens[0]).all()) and not (offs % lens[0]).any()
    for i, base in enumerate(regions):
        mem = _view(base, span)
        stage = buf[i * per_region : (i + 1) * per_region]
        if uniform:
            # Equal, aligned pieces: one fancy-indexed copy per region.
            length = int(lens[0])
            rows = mem[: span - span % length].reshape(-1, length)
            idx = offs // length
            if to_staging:
                stage.reshape(-1, length)[:] = rows[idx]
            else:
                rows[idx] = stage.reshape(-1, length)
        else:
            pos = 0
            for off, ln in zip(offs.tolist(), lens.tolist(), strict=True):
                if to_staging:
                    stage[pos : pos + ln] = mem[off : off + ln]
                else:
                    mem[off : off + ln] = stage[pos : pos + ln]
                pos += ln


class HostBackend(Backend):
    """CPU memory registered as NIXL DRAM."""

    name = "host"
    mem = MemKind.DRAM

    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        return describe_paged(kv_caches, spec, MemKind.DRAM, "cpu")

    def alloc_staging(self, nbytes: int, device_id: int = 0) -> StagingBuffer:
        buf = np.zeros(nbytes, dtype=np.uint8)
        return StagingBuffer(int(buf.ctypes.data), nbytes, 0, MemKind.DRAM, owner=buf)

    def pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        total = int(pieces[:, 1].sum()) * len(regions) if pieces.size else 0
        gather(regions, pieces, _view(staging_addr, total) if total else np.zeros(0, np.uint8))

    def unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        total = int(pieces[:, 1].sum()) * len(regions) if pieces.size else 0
        scatter(regions, pieces, _view(staging_addr, total) if total else np.zeros(0, np.uint8))
