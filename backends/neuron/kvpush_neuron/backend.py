"""``NeuronBackend``: Neuron device KV for the device-agnostic kvpush core.

Two modes, chosen per host:

- ``direct`` (Neuron Direct RDMA): the KV tensors' device virtual addresses
  are registered with NIXL, as ``VRAM`` for the LIBFABRIC backend on EFA
  hosts, whose plugin detects Neuron (PCI vendor 0x1d0f), registers with
  ``FI_HMEM_NEURON`` and picks the EFA rail per buffer through
  ``nrt_get_attached_efa_bdf``. P's WRITE goes HBM to HBM. Packing (many
  small pieces into one WRITE) copies device to device with
  ``nrt_tensor_copy`` into a device staging tensor. On the stand-in runtime
  used in tests, "device" memory is host memory and the transport is UCX,
  so ``mem="DRAM"`` registers it as what it really is there.
- ``host_staging``: for hosts where device memory cannot be registered
  (older NIXL, no EFA, UCX only). Nothing on the device is registered; the
  transfer plan must be the staged one: P's ``pack`` reads the request's
  pieces device -> host (``nrt_tensor_read``, nearby pieces as one read, see
  ``runs``) and gathers them into a registered host buffer, one WRITE moves
  that buffer, and D's ``unpack`` writes host -> device (``nrt_tensor_write``).
  Only the request's bytes cross PCIe, not whole caches (vLLM-Neuron's
  NixlConnector staging copies whole tensors to CPU).

Ordering (no WRITE before the prefill that produced the KV finished on the
device): what the runtime offers is (a) ``nrt_execute``, synchronous by
default: when the model call returns, its outputs, including the in-place
KV caches, are written; NxDI models run this way, so a marker recorded
after the forward returned is already satisfied; (b) the explicit async API,
where a scheduled request has a sequence number and ``nrta_is_completed``
tells when it finished: pass ``record_ready(seq=...)`` and the push thread
polls it; (c) framework streams (torch-neuronx eager): pass
``record_ready(fence=...)`` with the stream's synchronize, run on the push
thread, never the engine's.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, CacheSpec, Capabilities, MemRegistration, StagingBuffer
from kvpush.backends.host import gather as host_gather
from kvpush.backends.tensors import describe_strided
from kvpush.core.errors import BackendError, ConfigError
from kvpush.core.layout import KVLayout, MemKind
from kvpush_neuron.runs import DEFAULT_GAP, read_runs
from kvpush_neuron.runtime import Placement, Runtime, load_runtime
from kvpush_neuron.tensor import DEVICE_TYPE, ForeignTensor, NeuronTensor, torch_device
from kvpush_neuron.testing import NeuronTestSupport

log = logging.getLogger(__name__)

ENV_MODE = "KVPUSH_NEURON_MODE"
ENV_MEM = "KVPUSH_NEURON_MEM"
TORCH_NEURON_DEVICES = ("neuron", "privateuseone")


class Mode(enum.StrEnum):
    """How KV leaves the device: registered with NIXL as is, or copied through host staging."""

    DIRECT = "direct"
    HOST_STAGING = "host_staging"


@dataclass(frozen=True)
class ReadyMarker:
    """What the push thread waits for before reading a request's KV.

    ``seq``: an ``nrta_*`` request sequence number; ``fence``: a callable that
    returns once the device work is done. Neither: the producer was synchronous.
    """

    seq: int | None = None
    fence: Callable[[], None] | None = None


class NeuronBackend(NeuronTestSupport, Backend):
    """Neuron device memory, registered directly or staged through host memory.

    ``NeuronTestSupport`` adds the optional test-support surface ``kvpush
    conformance`` uses (caches through the runtime; builds the stand-in)."""

    name = "neuron"

    def __init__(
        self,
        mode: str | None = None,
        mem: str | None = None,
        lib: str | None = None,
        ready_timeout_s: float = 60.0,
        read_gap: int = DEFAULT_GAP,
    ) -> None:
        mode = mode or os.environ.get(ENV_MODE, Mode.DIRECT)
        mem = mem or os.environ.get(ENV_MEM, MemKind.VRAM)
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise ConfigError(f"neuron backend mode {mode!r} is not one of {[m.value for m in Mode]}") from None
        try:
            self.mem = MemKind(mem)
        except ValueError:
            raise ConfigError(f"neuron backend mem {mem!r} is not one of {[m.value for m in MemKind]}") from None
        self.ready_timeout_s = ready_timeout_s
        self.read_gap = read_gap
        self.runtime_calls = 0  # runtime copies issued by pack/unpack (a cost the plan's model does not see)
        self.runtime: Runtime = load_runtime(lib)
        # Before any NIXL agent exists: LIBFABRIC's Neuron support needs it.
        self.runtime.init()
        self.efa_bdfs: dict[int, str] = {}
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, Any]] = []  # (start, end, tensor), sorted by start
        self._host_staging: list[tuple[int, int]] = []
        self._owned: list[NeuronTensor] = []

    # -- describing ----------------------------------------------------------
    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        """Validate that every tensor is Neuron device memory, then describe it like any paged cache.

        ``spec`` chooses the layout: see ``kvpush_neuron.layout`` for the
        vLLM-Neuron paged and the two NxDI cache layouts.
        """
        if not kv_caches:
            raise BackendError("no KV cache tensors given")
        views = {name: self._resolve(name, t) for name, t in kv_caches.items()}
        layout, _ = describe_strided(views, spec, self.mem, DEVICE_TYPE)
        for v in views.values():
            self._remember(v)
        return layout

    def _resolve(self, name: str, t: Any) -> NeuronTensor | ForeignTensor:
        if isinstance(t, NeuronTensor):
            if t.handle is None:
                raise BackendError(f"layer {name}: Neuron tensor was already freed")
            if t.runtime is not self.runtime:
                raise BackendError(f"layer {name}: tensor comes from runtime {t.runtime.path}, not {self.runtime.path}")
            if t.placement != Placement.DEVICE:
                raise BackendError(
                    f"layer {name}: tensor is Neuron runtime {t.placement.name.lower()} memory, "
                    "not on a Neuron device; allocate KV caches with placement DEVICE"
                )
            self._check_hbm(name, t.va, t.vnc)
            return t
        dev = torch_device(t)
        if dev is None:
            kind = "a numpy array (host memory)" if hasattr(t, "__array_interface__") else type(t).__name__
            raise BackendError(
                f"layer {name}: KV tensor is {kind}; the neuron backend takes tensors on a Neuron device "
                "(NeuronTensor from the runtime, or torch-neuronx tensors); use backend 'host' for CPU memory"
            )
        dev_type, index = dev
        if dev_type not in TORCH_NEURON_DEVICES:
            raise BackendError(
                f"layer {name}: tensor is on device {dev_type!r}, not a Neuron device "
                f"({' or '.join(TORCH_NEURON_DEVICES)}); use the backend for {dev_type!r}"
            )
        addr = int(t.data_ptr())
        if addr == 0:
            raise BackendError(
                f"layer {name}: Neuron tensor has data_ptr() == 0: torch-neuronx exposes device addresses only "
                "when NEURON_RT_MAP_HBM=1 is set before the first device allocation"
            )
        self._check_hbm(name, addr, index)
        if self.mode is Mode.HOST_STAGING:
            raise BackendError(
                f"layer {name}: host staging copies through Neuron runtime tensor handles, which framework "
                "tensors do not expose; pass NeuronTensor caches or use mode='direct'"
            )
        shape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) for s in t.stride())
        dtype = str(t.dtype).removeprefix("torch.")
        return ForeignTensor(addr, shape, strides, dtype, int(t.element_size()), index)

    def _check_hbm(self, name: str, addr: int, vnc: int) -> None:
        """Ask the runtime whether ``addr`` is HBM: the same query NIXL uses to route it."""
        if not self.runtime.has("nrt_get_attached_efa_bdf"):
            log.warning("%s lacks nrt_get_attached_efa_bdf: cannot verify layer %s is HBM", self.runtime.path, name)
            return
        bdf = self.runtime.efa_bdf(addr)
        if bdf is None:
            raise BackendError(
                f"layer {name}: address {addr:#x} is not Neuron device memory (nrt_get_attached_efa_bdf "
                "refused it): the tensor was not allocated on a device by this process's Neuron runtime"
            )
        self.efa_bdfs.setdefault(vnc, bdf)

    def _remember(self, t: Any) -> None:
        start = int(t.va)
        end = start + int(t.size)
        i = bisect.bisect(self._starts, start)
        if i > 0 and self._spans[i - 1][0] == start:
            self._spans[i - 1] = (start, end, t)  # the latest description of an address wins (reused memory)
            return
        self._starts.insert(i, start)
        self._spans.insert(i, (start, end, t))

    def _locate(self, addr: int, span: int) -> tuple[Any, int]:
        """The described or allocated tensor holding ``[addr, addr + span)`` and the offset in it."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            start, end, t = self._spans[i]
            if addr + span <= end:
                return t, addr - start
        raise BackendError(
            f"bytes [{addr:#x}, {addr + span:#x}) are not inside a Neuron tensor this backend described or allocated"
        )

    # -- registration ---------------------------------------------------------
    def registrations(self, layout: KVLayout) -> list[MemRegistration]:
        """Device regions in direct mode; nothing in host staging (only staging buffers are registered)."""
        if self.mode is Mode.HOST_STAGING:
            return []
        return super().registrations(layout)

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Direct in ``direct`` mode; in host staging NIXL cannot touch the KV, so every transfer is staged."""
        return Capabilities(direct=self.mode is Mode.DIRECT)

    def supported_layouts(self) -> list[str]:
        return [
            "vLLM-Neuron paged, one tensor a layer [2, blocks, heads, tokens, dim] (axes KBHNC)",
            "NxDI block KV layout, K and V tensors [blocks, tokens, heads, dim] (axes BNHC)",
            "NxDI per-sequence cache, K and V tensors [slots, heads, max_seq_len, dim] (axes BHNC, a slot a block)",
        ]

    # -- ordering --------------------------------------------------------------
    def record_ready(self, seq: int | None = None, fence: Callable[[], None] | None = None) -> ReadyMarker:
        """Marker for "the KV of this prefill is on the device"; cheap, never blocks the engine."""
        return ReadyMarker(seq, fence)

    def poll_ready(self, marker: Any) -> bool:
        """Whether the marked device work finished (``nrta_is_completed``), without blocking.

        Layer-wise pushes ask this per layer so the push thread keeps serving
        D while the forward runs. A marker with a host fence (a callable) can
        only be waited on, so it is.
        """
        if marker is None:
            return True
        if not isinstance(marker, ReadyMarker):
            raise BackendError(f"poll_ready got {type(marker).__name__}, not a marker from NeuronBackend.record_ready")
        if marker.fence is not None or marker.seq is None:
            self.wait_ready(marker)
            return True
        return bool(self.runtime.is_completed(marker.seq))

    def wait_ready(self, marker: Any) -> None:
        """Block the push thread until the marked device work finished (or raise after the timeout)."""
        if marker is None:
            return
        if not isinstance(marker, ReadyMarker):
            raise BackendError(f"wait_ready got {type(marker).__name__}, not a marker from NeuronBackend.record_ready")
        if marker.fence is not None:
            marker.fence()
        if marker.seq is None:
            return
        deadline = time.monotonic() + self.ready_timeout_s
        sleep = 20e-6
        while not self.runtime.is_completed(marker.seq):
            if time.monotonic() > deadline:
                raise BackendError(
                    f"prefill's device work (nrta sequence {marker.seq:#x}) did not complete within "
                    f"{self.ready_timeout_s}s; not pushing its KV"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    # -- staging ---------------------------------------------------------------
    def alloc_staging(self, nbytes: int, device_id: int = 0) -> StagingBuffer:
        """Device staging tensor on core ``device_id`` (direct), or page-aligned host memory (host staging)."""
        if nbytes <= 0:
            raise BackendError(f"staging size must be > 0, got {nbytes}")
        if self.mode is Mode.HOST_STAGING:
            buf = mmap.mmap(-1, nbytes)
            arr = np.frombuffer(buf, dtype=np.uint8)
            addr = int(arr.ctypes.data)
            self._host_staging.append((addr, addr + nbytes))
            return StagingBuffer(addr, nbytes, 0, MemKind.DRAM, owner=(buf, arr))
        t = NeuronTensor(self.runtime, (nbytes,), "uint8", device_id, name="kvpush-staging")
        self._owned.append(t)
        self._remember(t)
        return StagingBuffer(t.va, nbytes, device_id, self.mem, owner=t)

    def pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        self._move(regions, pieces, staging_addr, to_staging=True)

    def unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        self._move(regions, pieces, staging_addr, to_staging=False)

    def _move(self, regions: list[int], pieces: np.ndarray, staging_addr: int, to_staging: bool) -> None:
        """Runtime copies of every piece of every region, in the staging order ``pack`` documents."""
        if pieces.size == 0 or not regions:
            return
        per_region = int(pieces[:, 1].sum())
        total = per_region * len(regions)
        span = int((pieces[:, 0] + pieces[:, 1]).max())
        if self.mode is Mode.HOST_STAGING:
            if not any(lo <= staging_addr and staging_addr + total <= hi for lo, hi in self._host_staging):
                raise BackendError(f"staging bytes [{staging_addr:#x}, +{total}) are not in a host staging buffer")
            if to_staging:
                self._pack_host(regions, pieces, staging_addr, span, per_region)
            else:
                self._unpack_host(regions, pieces, staging_addr, span)
            return
        stage, stage_off = self._locate(staging_addr, total)
        stage_h = self._handle(stage)
        offs, lens = pieces[:, 0].tolist(), pieces[:, 1].tolist()
        pos = stage_off
        for base in regions:
            t, toff = self._locate(base, span)
            h = self._handle(t)
            for off, ln in zip(offs, lens, strict=True):
                if to_staging:
                    self.runtime.copy(h, toff + off, stage_h, pos, ln)
                else:
                    self.runtime.copy(stage_h, pos, h, toff + off, ln)
                self.runtime_calls += 1
                pos += ln

    def _pack_host(self, regions: list[int], pieces: np.ndarray, staging_addr: int, span: int, per: int) -> None:
        """Device -> host: a few large reads per region into scratch, then a host gather into staging."""
        runs, remapped = read_runs(pieces, self.read_gap)
        scratch = np.empty(int(runs[:, 1].sum()), dtype=np.uint8)
        base_addr = int(scratch.ctypes.data)
        for i, base in enumerate(regions):
            t, toff = self._locate(base, span)
            h = self._handle(t)
            for off, ln, at in runs.tolist():
                self.runtime.read(h, base_addr + at, toff + off, ln)
                self.runtime_calls += 1
            out = np.ctypeslib.as_array((ctypes.c_uint8 * per).from_address(staging_addr + i * per))
            host_gather([base_addr], remapped, out)

    def _unpack_host(self, regions: list[int], pieces: np.ndarray, staging_addr: int, span: int) -> None:
        """Host -> device: one write per piece (pieces arrive merged where D's bytes are contiguous)."""
        offs, lens = pieces[:, 0].tolist(), pieces[:, 1].tolist()
        pos = staging_addr
        for base in regions:
            t, toff = self._locate(base, span)
            h = self._handle(t)
            for off, ln in zip(offs, lens, strict=True):
                self.runtime.write(h, pos, toff + off, ln)
                self.runtime_calls += 1
                pos += ln

    @staticmethod
    def _handle(t: Any) -> int:
        h = getattr(t, "handle", None)
        if h is None:
            raise BackendError(
                f"{t!r} has no Neuron runtime handle (framework tensor or freed); packing copies through the "
                "runtime and needs NeuronTensor caches"
            )
        return int(h)

    def pack_bandwidth(self) -> float:
        """Assumed, not measured on a trn host: device DMA copies vs. PCIe round trips."""
        return 8e9 if self.mode is Mode.HOST_STAGING else 20e9

    def close(self) -> None:
        """Free staging tensors; the runtime stays initialised (frameworks in this process share it)."""
        for t in self._owned:
            t.free()
        self._owned.clear()
        self._host_staging.clear()
        self._starts.clear()
        self._spans.clear()
