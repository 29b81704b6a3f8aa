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

An optional *test-support surface* (``conformance_setup``,
``make_test_cache``, ``write_bytes``, ``read_bytes``, ``free_test_cache``,
``foreign_test_tensors``) lets ``kvpush.conformance``, which knows nothing of
the device, allocate KV caches and move their bytes; engines never call it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
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
    kv_inner: bool = False
    """vLLM CPU layout ``[num_blocks, heads, block_size, 2 * dim]``: kernel-packed, moved as whole blocks."""


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
        """Block the calling thread (never the model's forward) until ``marker`` is reached.

        P's push thread calls it for its own short copies, and a waiter thread
        (``kvpush.engine.waiter``) for markers the forward has yet to reach:
        wait in a call that releases the GIL (CUDA's ``Event.synchronize``
        does), or the waiting stalls the forward's launches.
        """

    def poll_ready(self, marker: Any) -> bool:
        """Whether ``marker`` is reached, without blocking if the backend can tell.

        The push thread asks this before posting a layer, so it keeps serving
        messages while the device still computes. The default waits.
        """
        self.wait_ready(marker)
        return True

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

    chains_ready: bool = False
    """Whether ``start_pack(..., after=marker)`` queues the pack behind a ``record_ready`` marker on the
    device (a CUDA stream waiting on the event), so the push thread need not see the KV ready first."""

    def start_pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int, after: Any = None) -> Any:
        """``pack``, but it may return before the bytes are in place: returns a marker for ``poll_ready``.

        The push thread posts the WRITE only once ``poll_ready`` says the
        marker is reached; meanwhile it keeps progressing NIXL (completing
        earlier parts, sending their notifications) instead of blocking in a
        device synchronize. ``after`` (only passed when ``chains_ready``): a
        ``record_ready`` marker the pack must run after. The default waits for
        it, packs synchronously and returns None.
        """
        if after is not None:
            self.wait_ready(after)
        self.pack(regions, pieces, staging_addr)
        return None

    def start_unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> Any:
        """``unpack`` that may return early; D reports the regions only once the marker is reached.

        Until then the staging bytes and the destination blocks stay D's (the
        slot is not granted again, the blocks are not handed back). The default
        unpacks synchronously and returns None.
        """
        self.unpack(regions, pieces, staging_addr)
        return None

    def prepare_pack(self, regions: list[int], pieces: np.ndarray, parts: Sequence[tuple[int, int, int]] = ()) -> None:
        """Hint: a ``pack`` of these pieces is coming (P calls it when it plans, before the KV is ready).

        A device backend uploads its piece table here, off the critical path.
        ``parts``: the ``start_pack(regions[r0:r1], pieces, staging_addr)``
        calls P expects to make, as ``(r0, r1, staging_addr)``, so a backend
        can compute their launches now too. Optional.
        """

    def prepare_unpack(
        self, regions: list[int], pieces: np.ndarray, parts: Sequence[tuple[int, int, int]] = ()
    ) -> None:
        """Hint: an ``unpack`` of these pieces is coming (D calls it when it registers); ``parts`` as for
        ``prepare_pack`` (D's guess at P's cut). Optional."""

    def pack_bandwidth(self) -> float:
        """Bytes per second of pack or unpack, for the plan's cost model."""
        return 5e9

    def close(self) -> None:
        """Release staging buffers and anything else the backend holds."""

    # -- test support (optional): what the conformance suite needs ------------
    # Engines never call these. A backend that leaves them out still works in
    # kvpush; it just cannot be checked by ``kvpush conformance``.

    @classmethod
    def conformance_setup(cls, workdir: Path) -> AbstractContextManager[dict[str, str]]:
        """Prepare this host for the conformance suite, before any instance exists.

        Entered once per suite run; yields environment variables the suite
        sets for itself and the P/D worker processes it spawns (the Neuron
        backend builds its stand-in runtime into ``workdir`` here and names it
        in ``KVPUSH_NRT_LIB``). The default prepares nothing.
        """
        return nullcontext({})

    def make_test_cache(self, spec: CacheSpec, num_layers: int, num_blocks: int, device: int = 0) -> dict[str, Any]:
        """Allocate KV tensors the way an engine on ``device`` would, one per layer, in layer order.

        Each tensor's *logical* shape is ``[2, num_blocks, *block]`` (``[num_blocks,
        *block]`` when ``spec.kv_split`` is false), the block ``[block_size,
        local_heads, head_dim]`` for NHD or ``[local_heads, block_size,
        head_dim]`` for HND, in ``spec.dtype``; ``describe(result, spec)``
        must accept it. Contents are undefined.
        """
        raise NotImplementedError(self._no_test_support("make_test_cache"))

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """Overwrite ``tensor`` with ``data``: uint8, the tensor's bytes in logical C order.

        Behaves like the engine's producer: the write may still be running on
        the device when this returns, and a marker from a later
        ``record_ready()`` covers it. That is what lets the suite check the
        ordering guarantee.
        """
        raise NotImplementedError(self._no_test_support("write_bytes"))

    def read_bytes(self, tensor: Any) -> np.ndarray:
        """The tensor's bytes in logical C order (1-D uint8), after all device work issued before the call."""
        raise NotImplementedError(self._no_test_support("read_bytes"))

    def free_test_cache(self, kv_caches: dict[str, Any]) -> None:
        """Release a cache from ``make_test_cache`` or ``foreign_test_tensors``.

        Default: nothing (dropping the references frees it).
        """

    def foreign_test_tensors(self, spec: CacheSpec, num_blocks: int, device: int = 0) -> dict[str, dict[str, Any]]:
        """Caches of the right shape that ``describe`` must refuse with ``BackendError``, by label.

        E.g. host memory for a device backend, or another device type. The
        suite adds generic cases of its own (non-tensor objects, wrong
        geometry). Default: none.
        """
        return {}

    def _no_test_support(self, what: str) -> str:
        return (
            f"backend {self.name!r} ({type(self).__module__}.{type(self).__qualname__}) does not implement "
            f"{what}, part of the optional test-support surface the conformance suite needs "
            "(see docs/backends.md, 'Test support')"
        )
