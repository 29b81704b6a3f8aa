"""The backend contract: the only device-specific surface of kvpush.

The core ``Backend`` answers five questions, and nothing else:
1. Where is the KV? ``describe`` turns the engine's KV tensors into a
   ``KVLayout`` (addresses, block geometry, heads, memory kind, device ids).
2. What must NIXL register? ``registrations`` (usually one entry per allocation).
3. When is the KV safe to read? ``record_ready`` on the producing side,
   ``wait_ready``/``poll_ready`` on kvpush's threads: no WRITE is posted
   before the device finished writing those blocks.
4. How are many small pieces moved locally? ``alloc_staging``, ``pack`` and
   ``unpack`` gather a request's pieces into one registered buffer and
   scatter them back, so a fragmented request becomes one large WRITE.
5. What can it do? ``capabilities``, which the planner honours.

Two optional surfaces sit beside it, each in its own module:
``kvpush.backends.copy.AsyncCopy`` (packs and unpacks that return before the
bytes are in place) and ``kvpush.backends.testing.TestSupport`` (what the
conformance suite needs to allocate caches and move their bytes; engines
never call it). The core owns the protocol, the transfer plan and the threads.

``CacheSpec``, what the engine tells ``describe``, is named here as part of the contract; it lives in
``kvpush.core.layout`` beside the ``KVLayout`` it becomes, where pure code (``core.geometry``) may build one
without importing the backends.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.core.layout import CacheSpec, KVLayout, MemKind


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can do; the engine and the planner honour it.

    ``direct``: NIXL may read (P) and write (D) the KV regions in place. A
    backend that cannot register its KV memory (Neuron host staging) sets it
    False: every transfer touching it is then planned staged, whatever
    ``plan`` the operator configured, and a transfer that gets no staging
    slot fails with that reason instead of writing unregistered memory.
    ``chained_ready``: ``AsyncCopy.start_pack(..., after=marker)`` queues the
    pack behind a ``record_ready`` marker on the device (a CUDA stream waiting
    on an event), so P need not see the KV ready before it launches the pack.
    ``peer_by_default``: with ``peer_copy`` "auto", P and D on one host use
    peer copies (``kvpush.backends.peer``): the backend finds on its own whether
    D is in reach, and its mapping reaches no more than NIXL's registration.
    """

    direct: bool = True
    chained_ready: bool = False
    peer_by_default: bool = False


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
    capabilities: Capabilities = Capabilities()
    staging_bytes: int = 128 << 20
    """The staging region's size where ``staging_bytes`` is not set: what a rank can spare for packed pushes
    (a ring's slots are an eighth of it, so a larger region means fewer parts to a long push)."""
    busy_poll_s: float = 1e-3
    """The engines' longest sleep between polls of transfers in flight where ``busy_poll_max_s`` is not set:
    a core is dear next to latency on a host that computes with its CPUs, cheap on one whose device does."""

    @abc.abstractmethod
    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        """Describe the engine's per-layer KV tensors as a layout.

        Raise ``BackendError`` for tensors this backend does not own (wrong
        device, not dense, a shape ``spec`` does not explain) or an attention
        backend whose cache it cannot address, naming the layer, the shape
        and ``supported_layouts()``.
        """

    def supported_layouts(self) -> list[str]:
        """What ``describe`` accepts, in words, for the error a refused cache gets."""
        return []

    def bind_thread(self) -> None:
        """Prepare the calling thread for this backend's calls.

        The engine calls it (through ``bind_engine_thread``) once at the start
        of every thread it runs (push, receive, marker waiter) before any other
        call from that thread; a CUDA backend makes its device current there.
        Anyone else calling the backend from a thread of their own calls it
        first too. Default: nothing.
        """

    def bind_engine_thread(self) -> None:
        """``bind_thread`` for a thread the engine owns (push, receive, marker waiter), which runs only the
        engine's calls: a backend may set per-thread state there that a caller's thread must not get (the
        CUDA backend makes its copy stream current, so its copies skip a stream context). Default:
        ``bind_thread``.
        """
        self.bind_thread()

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

    def pack_bandwidth(self) -> float:
        """Bytes per second of pack or unpack, for the plan's cost model."""
        return 5e9

    def close(self) -> None:
        """Release staging buffers and anything else the backend holds."""
