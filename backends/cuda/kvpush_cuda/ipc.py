"""CUDA IPC for peer copies: D exports its KV allocations, a P process on the same host maps them.

D hands out one IPC handle per device allocation its KV regions lie in (a
handle names a whole ``cudaMalloc`` allocation: regions are given as offsets
into it), with the host's boot id, its pid and the device's UUID. P maps each
allocation once (``cuIpcOpenMemHandle``, peer access enabled lazily when the
memory is on another GPU) and turns D's region addresses into its own. A
handle from another host, or memory that cannot be exported (virtual-memory
allocations, ``expandable_segments``), means no peer copies: NIXL writes
instead. Driver calls through ctypes: torch has no binding for them.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

import msgspec

from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout

log = logging.getLogger(__name__)

_LAZY_ENABLE_PEER_ACCESS = 1
_VERSION = 1


class _Handle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes (read whole with ``bytes(h)``: the field would stop at a NUL)."""

    _fields_ = [("reserved", ctypes.c_byte * 64)]


class Alloc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One exported device allocation: its base and size in D's process, and its IPC handle."""

    base: int
    size: int
    handle: bytes


class Export(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What D sends for peer copies (``Hello.peer``)."""

    version: int
    kind: str  # "cuda-ipc"
    boot_id: str
    pid: int
    device_uuid: str
    allocs: list[Alloc]


@dataclass
class Mapped:
    """P's view of a D rank's KV: each of D's allocations at P's address; ``local`` translates region bases."""

    pid: int
    spans: list[tuple[int, int, int]]  # D base, size, P's address of that base
    opened: list[int] = field(default_factory=list)  # P's addresses to close (none when D is this process)
    bases: dict[int, int] = field(default_factory=dict)  # D region base -> P's address
    lists: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # a part's D bases -> P's

    def local(self, addrs: list[int]) -> list[int]:
        """P's addresses of D's region bases (every one was checked at ``open``), remembered per list: a push's
        parts ask for the same few lists again and again."""
        key = tuple(addrs)
        hit = self.lists.get(key)
        if hit is None:
            hit = self.lists[key] = self._local(addrs)
            if len(self.lists) > 1024:  # a bound, not expected: a layout has as many ranges as parts can take
                self.lists.clear()
        return hit

    def _local(self, addrs: list[int]) -> list[int]:
        out = []
        for a in addrs:
            hit = self.bases.get(a)
            if hit is None:
                hit = self._translate(a)
                self.bases[a] = hit
            out.append(hit)
        return out

    def _translate(self, addr: int) -> int:
        for lo, size, at in self.spans:
            if lo <= addr < lo + size:
                return at + (addr - lo)
        raise BackendError(f"address {addr:#x} is outside every allocation D {self.pid} exported")

    def covers(self, addr: int, size: int) -> bool:
        return any(lo <= addr and addr + size <= lo + n for lo, n, _ in self.spans)


def boot_id() -> str:
    """This host's boot id: two processes share CUDA IPC only on the same running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Driver:
    """The CUDA driver calls peer copies need, on the calling thread's current context."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise BackendError(f"CUDA driver not loadable for peer copies: {exc}") from None
        u64, p64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
        # Declared, not guessed: the handle goes by value (64 bytes) and pointers are 64-bit.
        lib.cuMemGetAddressRange_v2.argtypes = [p64, ctypes.POINTER(ctypes.c_size_t), u64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), u64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [p64, _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [u64]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in (lib.cuMemGetAddressRange_v2, lib.cuIpcGetMemHandle, lib.cuIpcOpenMemHandle_v2):
            f.restype = ctypes.c_int
        lib.cuIpcCloseMemHandle.restype = ctypes.c_int
        self._lib = lib
        self._check(lib.cuInit(0), "cuInit")

    def bind(self, device: int) -> None:
        """Make ``device``'s primary context (the one torch uses) current on this thread if none is: a
        thread that only ever called torch may have none yet, and the driver calls below need one."""
        ctx = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(device)), "PrimaryCtxRetain")
        self._check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            raise BackendError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def address_range(self, addr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding ``addr``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr)),
            "cuMemGetAddressRange",
        )
        return int(base.value), int(size.value)

    def ipc_handle(self, base: int) -> bytes:
        h = _Handle()
        self._check(self._lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return bytes(h)

    def open(self, handle: bytes) -> int:
        if len(handle) != 64:
            raise BackendError(f"a CUDA IPC handle is 64 bytes, this one {len(handle)}")
        h = _Handle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self._check(
            self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS)),
            "cuIpcOpenMemHandle",
        )
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self._check(self._lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


def export(driver: Driver, layout: KVLayout, device_uuid: str) -> bytes:
    """The blob D sends: an IPC handle per allocation its regions lie in."""
    driver.bind(layout.regions[0].device_id if layout.regions else 0)
    allocs: dict[int, Alloc] = {}
    for r in layout.regions:
        base, size = driver.address_range(r.base)
        if base not in allocs:
            allocs[base] = Alloc(base, size, driver.ipc_handle(base))
    exp = Export(_VERSION, "cuda-ipc", boot_id(), os.getpid(), device_uuid, list(allocs.values()))
    return msgspec.msgpack.encode(exp)


def open_export(driver: Driver, blob: bytes, layout: KVLayout, device: int) -> Mapped | None:
    """P's mapping (on its ``device``) of the allocations D exported, or None when they are out of reach
    (another host, a region outside them, a handle this process cannot open)."""
    try:
        exp = msgspec.msgpack.decode(blob, type=Export)
    except msgspec.DecodeError as exc:
        raise BackendError(f"peer copy: malformed CUDA IPC export: {exc}") from None
    if exp.version != _VERSION or exp.kind != "cuda-ipc":
        raise BackendError(f"peer copy: export {exp.kind!r} version {exp.version}, this reads cuda-ipc {_VERSION}")
    if exp.boot_id != boot_id() or not exp.boot_id:
        return None  # another host (or one that cannot tell): NIXL writes
    driver.bind(device)
    if exp.pid == os.getpid():
        mapped = Mapped(exp.pid, [(a.base, a.size, a.base) for a in exp.allocs])
    else:
        mapped = Mapped(exp.pid, [])
        try:
            for a in exp.allocs:
                at = driver.open(a.handle)
                mapped.opened.append(at)
                mapped.spans.append((a.base, a.size, at))
        except BackendError as exc:
            log.warning("peer copy: cannot map D %d's KV (%s): NIXL writes instead", exp.pid, exc)
            close(driver, mapped)
            return None
    if not all(mapped.covers(r.base, r.size) for r in layout.regions):
        log.warning("peer copy: D %d's export does not cover its KV regions: NIXL writes instead", exp.pid)
        close(driver, mapped)
        return None
    mapped.local([r.base for r in layout.regions])
    return mapped


def close(driver: Driver, mapped: Mapped) -> None:
    """Unmap what ``open_export`` opened."""
    while mapped.opened:
        driver.close(mapped.opened.pop())
