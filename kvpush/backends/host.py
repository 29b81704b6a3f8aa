"""Host DRAM backend: the reference backend for tests and CPU vLLM.

KV lives in CPU tensors or numpy arrays; the engine's thread wrote it before
handing the request over, so it is ready at once. Pack and unpack are memcpy
through numpy views of the raw memory. Layouts come from the shared strided
describer (``kvpush.backends.tensors``); which attention backends' caches it
can address is ``ATTENTION``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import msgspec
import numpy as np

from kvpush.backends import host_peer
from kvpush.backends.base import Backend, CacheSpec, MemRegistration, StagingBuffer
from kvpush.backends.tensors import allocation_registrations, describe_strided, tensor_info
from kvpush.backends.testing import TestSupport, cache_shape
from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout, MemKind

ATTENTION = {
    "": "token-addressable caches named by CacheSpec.axes (engines other than vLLM, tests)",
    "CPU_ATTN": "vLLM CPU attention, [blocks, heads, tokens, K|V] head-major; each (block, head) chunk is packed "
    "by the kernel, so whole chunks move (same block size on both sides)",
    "CPU_MLA": "vLLM CPU MLA, [blocks, 1, tokens, latent]: one latent row per token, the same on every TP rank",
    "AMX_MLA": "vLLM CPU MLA on AMX hosts (bf16, block size a multiple of 32), the same [blocks, 1, tokens, latent] "
    "rows: its writer puts a token at its slot times the cache's row stride, its kernels read those rows",
}
"""vLLM attention backends whose CPU caches this backend can address, and how."""
OPAQUE = frozenset({"CPU_ATTN"})

# Element sizes of dtypes numpy lacks; test caches hold them as unsigned ints of that size.
_RAW_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of raw memory, no copy."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _np_dtype(name: str) -> np.dtype:
    """numpy's dtype for ``name``, or a same-sized unsigned int where numpy has none (bfloat16, fp8)."""
    if name in _RAW_ITEMSIZE:
        return np.dtype(f"u{_RAW_ITEMSIZE[name]}")
    try:
        return np.dtype(name)
    except TypeError:
        raise BackendError(f"host backend: unknown dtype {name!r}") from None


def _dense_bytes(t: Any) -> tuple[int, int]:
    """(address, byte count) of a C-contiguous numpy array or CPU torch tensor; BackendError otherwise."""
    info = tensor_info(t)
    n = int(np.prod(info.shape)) * info.itemsize
    expect, acc = [], info.itemsize
    for dim in reversed(info.shape):
        expect.append(acc)
        acc *= dim
    if info.device_type != "cpu" or (n and tuple(reversed(expect)) != info.strides):
        raise BackendError(
            f"host backend: need a C-contiguous CPU tensor, got {info.device_type} with strides {info.strides}"
        )
    return info.addr, n


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


class HostBackend(TestSupport, Backend):
    """CPU memory registered as NIXL DRAM; peer copies (``kvpush.backends.peer``) by cross-memory attach."""

    name = "host"
    mem = MemKind.DRAM

    def __init__(self) -> None:
        self._spans: dict[int, tuple[int, int]] = {}
        self._exporter = host_peer.Exporter()
        self._opener = host_peer.Opener()

    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        if spec.attention not in ATTENTION:
            raise BackendError(
                f"host backend: attention backend {spec.attention!r} is not one whose cache it can address; "
                f"supported: {'; '.join(self.supported_layouts())}"
            )
        layout, spans = describe_strided(kv_caches, spec, MemKind.DRAM, "cpu", opaque=spec.attention in OPAQUE)
        self._spans.update(spans)
        return layout

    def supported_layouts(self) -> list[str]:
        return [f"{name or 'generic'}: {what}" for name, what in ATTENTION.items()]

    def registrations(self, layout: KVLayout) -> list[MemRegistration]:
        """One registration per allocation holding regions (vLLM's layers share one); others merged as by default."""
        regs, rest = allocation_registrations(layout, self._spans)
        if rest:
            regs += super().registrations(msgspec.structs.replace(layout, regions=tuple(rest)))
        return regs

    def alloc_staging(self, nbytes: int, device_id: int = 0) -> StagingBuffer:
        buf = np.zeros(nbytes, dtype=np.uint8)
        return StagingBuffer(int(buf.ctypes.data), nbytes, 0, MemKind.DRAM, owner=buf)

    def pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        total = int(pieces[:, 1].sum()) * len(regions) if pieces.size else 0
        gather(regions, pieces, _view(staging_addr, total) if total else np.zeros(0, np.uint8))

    def pack_bandwidth(self) -> float:
        # numpy's gathers on one core are slow next to a NIXL WRITE of contiguous memory, so staging pays
        # only when descriptors are very many (docs/benchmarks-log.md, "Figures behind code defaults").
        return 2e9

    def unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> None:
        total = int(pieces[:, 1].sum()) * len(regions) if pieces.size else 0
        scatter(regions, pieces, _view(staging_addr, total) if total else np.zeros(0, np.uint8))

    # -- peer copies (kvpush.backends.peer.PeerCopy) -----------------------
    def export_peer(self, layout: KVLayout) -> bytes | None:
        """This process's id and the spans NIXL would register for ``layout`` (``kvpush.backends.host_peer``):
        P may write exactly what D would let NIXL write, no more."""
        return self._exporter.export([(r.addr, r.size) for r in self.registrations(layout)])

    def open_peer(self, blob: bytes, layout: KVLayout) -> host_peer.PeerHandle | None:
        return self._opener.open(blob, layout)

    def start_peer_copy(
        self, peer: host_peer.PeerHandle, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray
    ) -> None:
        """Synchronous (the kernel copies in the call, the GIL released): None, reached at once."""
        host_peer.copy(peer, src_bases, dst_bases, pieces)

    def close_peer(self, peer: host_peer.PeerHandle) -> None:
        """Nothing to release: the handle maps nothing, each copy names the pid anew."""

    # -- test support (kvpush.conformance) ---------------------------------
    def make_test_cache(self, spec: CacheSpec, num_layers: int, num_blocks: int, device: int = 0) -> dict[str, Any]:
        """Dense numpy arrays shaped as ``spec.axes`` names them."""
        shape = cache_shape(spec, num_blocks)
        return {f"layer{i}": np.empty(shape, dtype=_np_dtype(spec.dtype)) for i in range(num_layers)}

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """memcpy into the tensor: host memory written by this thread is ready at once."""
        addr, n = _dense_bytes(tensor)
        src = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        if src.size != n:
            raise BackendError(f"write_bytes: {src.size} bytes given for a tensor of {n}")
        if n:
            _view(addr, n)[:] = src

    def read_bytes(self, tensor: Any) -> np.ndarray:
        addr, n = _dense_bytes(tensor)
        return _view(addr, n).copy() if n else np.zeros(0, np.uint8)

    def foreign_test_tensors(self, spec: CacheSpec, num_blocks: int, device: int = 0) -> dict[str, dict[str, Any]]:
        """Memory the host backend cannot describe: strided heads; torch meta tensors when torch is loaded."""
        base = self.make_test_cache(spec, 2, num_blocks)
        out: dict[str, dict[str, Any]] = {
            # every other element of a twice-as-wide head: a block's bytes are not dense
            "strided head_dim (not a dense block)": {
                name: np.empty((*t.shape[:-1], 2 * t.shape[-1]), t.dtype)[..., ::2] for name, t in base.items()
            }
        }
        torch = sys.modules.get("torch")
        if torch is None:
            return out  # importing torch only for this example would cost seconds
        out["torch meta tensors (not host memory)"] = {
            name: torch.empty(t.shape, dtype=torch.float16, device="meta") for name, t in base.items()
        }
        return out
