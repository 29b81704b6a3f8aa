"""The backend interface: the only device-specific surface of kvpush.

A backend answers four questions for the core, and nothing else:
1. Where is the KV? ``describe`` turns the engine's KV tensors into a
   ``KVLayout`` (addresses, block geometry, heads, memory kind, device ids).
2. What must NIXL register? ``registrations`` (usually one entry per tensor).
3. When is the KV safe to read? ``record_ready`` on the producing side,
   ``wait_ready`` on the push thread: no WRITE is posted before the device
   finished writing those blocks.
4. How are many small pieces moved locally? ``pack`` gathers byte pieces into
   a contiguous staging buffer and ``unpack`` scatters them back, so a
   fragmented request becomes one large WRITE.
The core owns the protocol, the transfer plan and the threads.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.layout import KVLayout, MemKind


@dataclass(frozen=True)
class CacheSpec:
    """What the engine knows about its KV cache that tensors alone do not say.

    ``layer_names`` orders the layers identically on P and D; ``kv_split``
    says whether each layer tensor holds K and V on a leading axis of 2.
    """

    block_size: int
    num_heads: int
    head_dim: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    order: str = "NHD"
    kv_split: bool = True


@dataclass(frozen=True)
class MemRegistration:
    """One buffer to register with NIXL."""

    addr: int
    size: int
    device_id: int
    mem: MemKind


@dataclass(frozen=True)
class StagingBuffer:
    """A contiguous, registered buffer used for packed transfers.

    ``owner`` keeps the backing allocation alive for as long as the buffer is.
    """

    addr: int
    size: int
    device_id: int
    mem: MemKind
    owner: Any = None


class Backend(abc.ABC):
    """Device-specific glue. Subclasses stay small: a page of code."""

    name: str = "abstract"
    mem: MemKind = MemKind.DRAM

    @abc.abstractmethod
    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        """Describe the engine's per-layer KV tensors as a layout.

        Raise ``BackendError`` for tensors this backend does not own (wrong
        device, non-contiguous, unexpected shape).
        """

    def registrations(self, layout: KVLayout) -> list[MemRegistration]:
        """Buffers to register: by default each region, merged when they overlap or touch."""
        spans = sorted((r.base, r.base + r.size, r.device_id) for r in layout.regions)
        merged: list[list[int]] = []
        for lo, hi, dev in spans:
            if merged and merged[-1][2] == dev and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi, dev])
        return [MemRegistration(lo, hi - lo, dev, layout.mem) for lo, hi, dev in merged]

    def record_ready(self) -> Any:
        """Called where the KV was produced; returns a marker for ``wait_ready``.

        Host memory written by the engine's own thread is ready at once.
        """
        return None

    def wait_ready(self, marker: Any) -> None:
        """Block the push thread (never the engine) until ``marker`` is reached."""

    @abc.abstractmethod
    def alloc_staging(self, nbytes: int, device_id: int) -> StagingBuffer:
        """Allocate a contiguous buffer for packed transfers on ``device_id``."""

    @abc.abstractmethod
    def pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        """Gather ``pieces`` (``(n, 2)``: offset, length) of every region base in ``regions``.

        Writes region 0's pieces, then region 1's, …, back to back from
        ``staging_addr``; synchronous when it returns.
        """

    @abc.abstractmethod
    def unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        """Inverse of ``pack``: scatter the staging bytes back into the regions."""

    def pack_bandwidth(self) -> float:
        """Bytes per second of pack or unpack, for the plan's cost model."""
        return 5e9

    def close(self) -> None:
        """Release staging buffers and anything else the backend holds."""
