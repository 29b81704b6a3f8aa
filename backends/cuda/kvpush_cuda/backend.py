"""``CudaBackend``: the kvpush Backend for KV caches in NVIDIA GPU memory.

- describe: vLLM's per-layer CUDA tensors (vLLM 0.29 and later: views of
  one buffer; earlier: each attention backend's own per-layer shape), read
  from their strides by the shared describer (``kvpush.backends.tensors``;
  every variant in ``variants``), as a VRAM layout with the tensors' device index, for the
  attention backends in ``ATTENTION``.
- registrations: one NIXL VRAM registration per allocation, never one that
  spans two (UCX's cuda_ipc maps a registration through one IPC handle).
- ordering: ``record_ready`` records a CUDA event on the producing stream;
  ``wait_ready`` waits for that event alone on the push thread, so the model
  keeps running and no device-wide synchronize is needed.
- pack/unpack: one Triton gather/scatter launch on a side stream (see
  ``copy``), which turns ~131k small pieces into one large WRITE; the
  engines use ``start_pack``/``start_unpack``, which return the launch's
  CUDA event instead of synchronizing, so their threads keep progressing
  NIXL while the device copies.
torch is imported when the backend is constructed, never at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvpush.backends.base import Backend, CacheSpec, Capabilities, MemRegistration, StagingBuffer
from kvpush.backends.tensors import allocation_registrations, describe_strided
from kvpush.backends.testing import TestSupport, cache_shape
from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout, MemKind
from kvpush_cuda import ipc
from kvpush_cuda._torch import cuda_torch
from kvpush_cuda.copy import Kernel, PieceCopier

log = logging.getLogger(__name__)

# Gather or scatter speed of the Triton kernel on H200 (bytes/s, read + write
# counted once): measured by kvpush_tools.cuda.bench, see docs/cuda.md.
DEFAULT_PACK_BANDWIDTH = 1.0e12
# Test support: GPU cycles that write_bytes keeps the stream busy before its copy, like a long prefill, so the
# conformance suite's ordering test fails when record_ready does not order the write (with the copy alone a
# marker of None went unnoticed; docs/cuda.md, Tests).
TEST_WRITE_DELAY_CYCLES = 50_000_000
ATTENTION = {
    "": "token-addressable caches named by CacheSpec.axes (engines other than vLLM, tests)",
    **dict.fromkeys(
        ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"),
        "vLLM's [blocks, heads, tokens, K|V] views in a KVCacheLayout whose blocks are dense (LBNHC, LBHNC, "
        "BLNHC, BLHNC); or a layer's own [blocks, 2, tokens, heads, head] (vLLM before 0.29: NHD or HND "
        "strides, cross-layer NHD buffer) or [2, blocks, tokens, heads, head]",
    ),
    **dict.fromkeys(
        ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA"),
        "[blocks, 1, tokens, latent] views, or a layer's own [blocks, tokens, latent] (vLLM before 0.29): one "
        "latent row per token, the same on every TP rank",
    ),
}
"""vLLM attention backends whose caches read K and V (or the latent) per token and head, as vLLM hands them
to the connector (``kvpush.integrations.vllm.layout.cache_axes`` names the shape), so a token-level copy
lands where they read."""


STAGING_WHAT = (
    "device (VRAM, registered with NIXL together with the KV)",
    "host (pinned host memory; the KV is never registered: for transports that cannot register VRAM)",
)
STAGING = tuple(w.split()[0] for w in STAGING_WHAT)


class CudaBackend(TestSupport, Backend):
    """KV in CUDA device memory, registered with NIXL as VRAM.

    ``device`` pins the device for staging and ordering when nothing was
    described yet (else the KV tensors' device is used); ``kernel`` picks the
    pack/unpack implementation (``auto`` = Triton when importable);
    ``tile_bytes`` and ``num_warps`` shape the Triton launch (one program
    copies one tile of at most ``tile_bytes``); ``stream_priority`` is the
    copier stream's (CUDA: lower is higher; -1, high, lets a layer-wise pack
    run beside the forward's GEMMs instead of after them, see ``copy.py``).
    ``staging`` is ``device`` (VRAM; the KV is registered too and pushed in
    place where that is cheaper) or ``host``: pinned host memory that the
    copy kernels reach over the bus, and the KV never registered, for
    transports that cannot register device memory (NIXL's LIBFABRIC plugin
    over tcp, a UCX without GPU support): every push is then staged.
    """

    name = "cuda"
    mem = MemKind.VRAM

    def __init__(
        self,
        device: int | None = None,
        kernel: Kernel = "auto",
        tile_bytes: int = 4096,
        num_warps: int = 4,
        pack_bandwidth: float = DEFAULT_PACK_BANDWIDTH,
        stream_priority: int = -1,
        staging: str = "device",
    ) -> None:
        if staging not in STAGING:
            raise BackendError(f"cuda backend: staging {staging!r} is not one of: {'; '.join(STAGING_WHAT)}")
        self._host_staging = staging == "host"
        self._torch = cuda_torch()
        n = self._torch.cuda.device_count()
        if device is not None and not 0 <= device < n:
            raise BackendError(f"CUDA device {device} does not exist ({n} visible)")
        self._device: int | None = device
        self._kernel: Kernel = kernel
        self._tile = int(tile_bytes)
        self._warps = int(num_warps)
        self._pack_bw = float(pack_bandwidth)
        self._priority = int(stream_priority)
        self._spans: dict[int, tuple[int, int]] = {}
        self._staging: dict[int, tuple[int, int]] = {}  # addr -> (size, device)
        self._copiers: dict[int, PieceCopier] = {}
        self._ipc: ipc.Driver | None = None

    @property
    def device(self) -> int:
        """The CUDA device this backend works on."""
        if self._device is None:
            self._device = int(self._torch.cuda.current_device())
        return self._device

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """In place with device staging; with host staging NIXL never sees the KV, so every push is staged."""
        return Capabilities(direct=not self._host_staging, chained_ready=True, peer_by_default=True)

    staging_bytes = 512 << 20
    """Device memory is plentiful next to the KV cache, and each part of a push in rounds costs the engine
    threads fixed host work: four rings' slots of 64 MiB cut a 16k-token 8B-model push into 36 parts, not
    144 (docs/benchmarks-log.md section 16)."""

    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        if spec.attention not in ATTENTION:
            raise BackendError(
                f"cuda backend: attention backend {spec.attention!r} is not one whose cache it can address; "
                f"supported: {'; '.join(self.supported_layouts())}"
            )
        layout, spans = describe_strided(kv_caches, spec, MemKind.VRAM, "cuda")
        devices = {r.device_id for r in layout.regions}
        if self._device is not None and devices != {self._device}:
            raise BackendError(f"KV tensors are on CUDA devices {sorted(devices)}, backend pinned to {self._device}")
        self._device = layout.regions[0].device_id
        self._spans.update(spans)
        return layout

    def supported_layouts(self) -> list[str]:
        return [f"{name or 'generic'}: {what}" for name, what in ATTENTION.items()]

    def bind_thread(self) -> None:
        """Make the backend's device current on the calling (kvpush) thread.

        A new thread starts on device 0; UCX's CUDA transports and Triton use
        the thread's current device, so the engine calls this at the start of
        each of its threads (the thread hook), before registering, packing or
        waiting there. Never called on the model's thread.
        """
        torch = self._torch
        if torch.cuda.current_device() != self.device:
            torch.cuda.set_device(self.device)

    def bind_engine_thread(self) -> None:
        """``bind_thread``, and the device's copy stream made current there for good (``PieceCopier.bind_here``):
        an engine thread launches nothing else, and its copies then skip a stream context each."""
        self.bind_thread()
        self._copier_on(self.device).bind_here()

    def registrations(self, layout: KVLayout) -> list[MemRegistration]:
        """One registration per allocation holding regions (regions we did not describe merged as by default);
        none with host staging, where only the staging buffers are registered."""
        if self._host_staging:
            return []
        regs, rest = allocation_registrations(layout, self._spans)
        if rest:
            regs += super().registrations(msgspec.structs.replace(layout, regions=tuple(rest)))
        return regs

    def record_ready(self) -> Any:
        """A CUDA event on the caller's current stream of the KV device: the stream that wrote the KV."""
        torch = self._torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_ready(self, marker: Any) -> None:
        """Wait for the producing stream's event(s) only; the device keeps running other work."""
        if marker is None:
            return
        events: Iterable[Any] = marker if isinstance(marker, list | tuple) else (marker,)
        for ev in events:
            if not hasattr(ev, "synchronize"):
                raise BackendError(f"wait_ready got {type(ev).__name__}, expected a marker from record_ready")
            ev.synchronize()

    def poll_ready(self, marker: Any) -> bool:
        """``cudaEventQuery`` on the marker's event(s): the push thread never blocks on a layer in progress."""
        if marker is None:
            return True
        events: Iterable[Any] = marker if isinstance(marker, list | tuple) else (marker,)
        for ev in events:
            if not hasattr(ev, "query"):
                raise BackendError(f"poll_ready got {type(ev).__name__}, expected a marker from record_ready")
            if not ev.query():
                return False
        return True

    def alloc_staging(self, nbytes: int, device_id: int | None = None) -> StagingBuffer:
        torch = self._torch
        dev = self.device if device_id is None else int(device_id)
        where = "pinned host memory" if self._host_staging else f"cuda:{dev}"
        try:
            if self._host_staging:  # page-locked and mapped: the copy kernels on ``dev`` read and write it
                buf = torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=True)
            else:
                buf = torch.empty(int(nbytes), dtype=torch.uint8, device=f"cuda:{dev}")
        except RuntimeError as exc:  # out of memory, bad device
            raise BackendError(f"cannot allocate {nbytes} bytes of staging in {where}: {exc}") from None
        addr = int(buf.data_ptr())
        self._staging[addr] = (int(nbytes), dev)
        if self._host_staging:
            return StagingBuffer(addr, int(nbytes), 0, MemKind.DRAM, owner=buf)
        return StagingBuffer(addr, int(nbytes), dev, MemKind.VRAM, owner=buf)

    def _copier(self, staging_addr: int) -> PieceCopier:
        dev = self.device
        for addr, (size, d) in self._staging.items():
            if addr <= staging_addr < addr + size:
                dev = d
                break
        return self._copier_on(dev)

    def _copier_on(self, dev: int) -> PieceCopier:
        if dev not in self._copiers:
            self._copiers[dev] = PieceCopier(
                self._torch, f"cuda:{dev}", self._kernel, self._tile, self._warps, stream_priority=self._priority
            )
        return self._copiers[dev]

    def set_stream_priority(self, priority: int) -> None:
        """Change the copier streams' priority (benchmarks compare them); call while nothing is copying."""
        self._priority = int(priority)
        for copier in self._copiers.values():
            copier.set_stream_priority(self._priority)

    def pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        self._copier(staging_addr).gather(regions, pieces, staging_addr)

    def unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        self._copier(staging_addr).scatter(regions, pieces, staging_addr)

    def start_pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int, after: Any = None) -> Any:
        """The gather queued on the copier's stream, behind ``after``'s event(s) if given (the layer that
        wrote the KV may still run: the device orders them, no host round trip); returns the CUDA event
        that ends the gather (``poll_ready``)."""
        copier = self._copier(staging_addr)
        self._wait_on(copier, after)
        return copier.gather(regions, pieces, staging_addr, wait=False)

    @staticmethod
    def _wait_on(copier: PieceCopier, after: Any) -> None:
        """Queue the copier's stream behind ``after``'s event(s) (``record_ready`` markers), if given."""
        if after is None:
            return
        events: Iterable[Any] = after if isinstance(after, list | tuple) else (after,)
        for ev in events:
            if not hasattr(ev, "record"):
                raise BackendError(f"a copy got {type(ev).__name__} to wait on, expected a record_ready marker")
            copier.stream.wait_event(ev)

    def start_unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> Any:
        """The scatter queued on the copier's stream; returns the CUDA event that ends it."""
        return self._copier(staging_addr).scatter(regions, pieces, staging_addr, wait=False)

    def prepare_pack(
        self,
        regions: list[int],
        pieces: np.ndarray,
        device_id: int | None = None,
        parts: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Optional hint: upload the piece table of a coming ``pack`` now (P, when it plans).

        Not part of the Backend contract: pack works without it, only then it
        uploads the table itself, on the critical path.
        """
        self._copier_on(self.device if device_id is None else device_id).prepare_gather(regions, pieces, parts)

    def prepare_unpack(
        self,
        regions: list[int],
        pieces: np.ndarray,
        device_id: int | None = None,
        parts: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """Optional hint: upload the piece table of a coming ``unpack`` now (D knows it when it registers)."""
        self._copier_on(self.device if device_id is None else device_id).prepare_scatter(regions, pieces, parts)

    # -- peer copies (kvpush.backends.peer) ---------------------------------------
    def export_peer(self, layout: KVLayout) -> bytes | None:
        """CUDA IPC handles of the allocations ``layout``'s regions lie in (``ipc``); None where the memory
        cannot be exported (a virtual-memory allocation) or there is no driver to ask."""
        try:
            uuid = str(self._torch.cuda.get_device_properties(self.device).uuid)
            return ipc.export(self._driver(), layout, uuid)
        except BackendError as exc:
            log.warning("cuda backend: no peer copies into this rank's KV: %s", exc)
            return None

    def open_peer(self, blob: bytes, layout: KVLayout) -> Any:
        """D's allocations mapped into this process (``ipc.open_export``), or None when out of reach."""
        return ipc.open_export(self._driver(), blob, layout, self.device)

    def prepare_peer_copy(self, peer: Any, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray) -> None:
        """Optional hint: upload the tables of a coming ``start_peer_copy`` now (P builds its parts ahead)."""
        self._copier_on(self.device).prepare_copy(src_bases, peer.local(dst_bases), pieces)

    def start_peer_copy(
        self, peer: Any, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray, after: Any = None
    ) -> Any:
        """One gather-scatter launch on the copier's stream, from this rank's regions into D's mapped ones,
        behind ``after``'s event(s) if given; returns the CUDA event ending it."""
        copier = self._copier_on(self.device)
        self._wait_on(copier, after)
        return copier.start_copy(src_bases, peer.local(dst_bases), pieces)

    def close_peer(self, peer: Any) -> None:
        driver = self._driver()
        driver.bind(self.device)
        ipc.close(driver, peer)

    def _driver(self) -> ipc.Driver:
        if self._ipc is None:
            self._ipc = ipc.Driver()
        return self._ipc

    def copy_stats(self) -> dict[str, float]:
        """Pack/unpack counters summed over devices (calls, host prep, launch, wait seconds, uploads)."""
        out: dict[str, float] = {}
        for c in self._copiers.values():
            for k, v in c.stats.items():
                out[k] = out.get(k, 0.0) + v
        return out

    @property
    def kernel(self) -> str:
        """The pack/unpack implementation in use (``triton`` or ``torch``)."""
        return self._copier(0).kernel

    def pack_bandwidth(self) -> float:
        return self._pack_bw

    # -- test support for kvpush.conformance (engines never call these) --------

    def _test_shape(self, spec: CacheSpec, num_blocks: int) -> tuple[tuple[int, ...], Any]:
        torch = self._torch
        dtype = getattr(torch, spec.dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise BackendError(f"dtype {spec.dtype!r} is not a torch dtype")
        return cache_shape(spec, num_blocks), dtype

    def make_test_cache(self, spec: CacheSpec, num_layers: int, num_blocks: int, device: int = 0) -> dict[str, Any]:
        """Dense per-layer CUDA tensors shaped as ``spec.axes`` names them."""
        shape, dtype = self._test_shape(spec, num_blocks)
        return {f"layer{i}": self._torch.empty(shape, dtype=dtype, device=f"cuda:{device}") for i in range(num_layers)}

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """Queue an upload on the caller's current stream, like a model kernel writing KV (may still run)."""
        torch = self._torch
        raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        want = tensor.numel() * tensor.element_size()
        if raw.size != want:
            raise BackendError(f"write_bytes: {raw.size} bytes for a tensor of {want}")
        with torch.cuda.device(tensor.device):
            torch.cuda._sleep(TEST_WRITE_DELAY_CYCLES)  # on the stream the copy below is queued on
        src = torch.from_numpy(raw).pin_memory().to(tensor.device, non_blocking=True)
        dst = tensor.view(torch.uint8)
        dst.copy_(src.view(dst.shape))

    def read_bytes(self, tensor: Any) -> np.ndarray:
        """The tensor's bytes in logical C order, after all work on its device (every stream)."""
        torch = self._torch
        torch.cuda.synchronize(tensor.device)
        return tensor.contiguous().view(torch.uint8).reshape(-1).cpu().numpy()

    def foreign_test_tensors(self, spec: CacheSpec, num_blocks: int, device: int = 0) -> dict[str, dict[str, Any]]:
        """Host tensors of the right shape: this backend must refuse them."""
        shape, dtype = self._test_shape(spec, num_blocks)
        return {"host memory": {"layer0": self._torch.empty(shape, dtype=dtype)}}

    def close(self) -> None:
        for c in self._copiers.values():
            if c._stream is not None:
                c._stream.synchronize()
        self._copiers.clear()
        self._staging.clear()
        self._spans.clear()
