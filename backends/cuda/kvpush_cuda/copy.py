"""Device gather/scatter of byte pieces: the CUDA side of ``pack`` and ``unpack``.

A fragmented request is ~131k pieces of 4 KiB spread over 128 regions
(separate allocations). NIXL pays per descriptor (docs/cuda.md), so the pieces are
gathered into one contiguous buffer on the device instead, which costs a
read and a write of the bytes at HBM speed. Two implementations:
- ``triton``: one kernel launch for all regions, addresses as raw integers.
- ``torch``: index_select/index_copy_ per region over raw views; no compiler
  needed, one launch per region, so slower on many regions.
Both run on a side stream owned by the copier (never the model's stream);
``gather``/``scatter`` are synchronous on return, as the Backend's ``pack``
says, unless called with ``wait=False`` (``start_pack``): then they return a
CUDA event recorded after the copy, for the engine to poll.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from kvpush.core.errors import BackendError

log = logging.getLogger(__name__)

Kernel = Literal["auto", "triton", "torch"]

_TORCH_INT = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}
_TYPESTR = {8: "<i8", 4: "<i4", 2: "<i2", 1: "|u1"}


def split_pieces(offs: np.ndarray, poss: np.ndarray, lens: np.ndarray, chunk: int) -> tuple[np.ndarray, ...]:
    """Cut pieces longer than ``chunk`` bytes so that one program never copies a whole region alone."""
    if lens.size == 0 or int(lens.max()) <= chunk:
        return offs, poss, lens
    counts = -(-lens // chunk)
    rep = np.repeat(np.arange(lens.size), counts)
    within = (np.arange(rep.size) - np.repeat(np.cumsum(counts) - counts, counts)) * chunk
    return offs[rep] + within, poss[rep] + within, np.minimum(chunk, lens[rep] - within)


def unit_width(*arrays: np.ndarray | list[int]) -> tuple[int, bool]:
    """Widest load (8, 4, 2 or 1 bytes) dividing every address and length, and whether all are 16-aligned."""
    g = 0
    for a in arrays:
        arr = np.asarray(a, dtype=np.int64)
        if arr.size:
            g = int(np.gcd(g, np.gcd.reduce(arr)))
    if g == 0:
        return 8, True
    low = g & -g
    return min(8, low), low >= 16


class _RawCuda:
    """A ``__cuda_array_interface__`` over raw device memory, so torch can view it without a copy."""

    def __init__(self, addr: int, count: int, width: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": _TYPESTR[width],
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }


@dataclass(frozen=True)
class Bases:
    """Region base addresses of one side of a copy: explicit (KV regions), or ``first + i * step`` (staging)."""

    addrs: tuple[int, ...] | None
    first: int = 0
    step: int = 0
    count: int = 0

    @classmethod
    def of(cls, addrs: list[int] | tuple[int, ...]) -> Bases:
        t = tuple(map(int, addrs))
        return cls(t, count=len(t))

    @classmethod
    def linear(cls, first: int, step: int, count: int) -> Bases:
        return cls(None, int(first), int(step), int(count))

    def as_list(self) -> list[int]:
        if self.addrs is not None:
            return list(self.addrs)
        return [self.first + i * self.step for i in range(self.count)]

    def gcd(self) -> int:
        return math.gcd(*self.addrs) if self.addrs is not None else math.gcd(self.first, self.step)


def _spec(arg: Any) -> tuple[Any, ...]:
    """What Triton specializes a kernel on for one argument: an int's value 1, divisibility by 16 and
    width; a tensor's dtype and 16-byte alignment. Finer than Triton's own key never hurts (a miss)."""
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg >= 2**63)
    return (str(arg.dtype), arg.data_ptr() % 16 == 0)


class DirectLauncher:
    """Launches a Triton kernel through its compiled handle, skipping the JIT's per-call dispatch.

    The JIT's dispatch costs more than the compiled kernel's ``run``, most on
    an engine thread that just woke up (cold caches; docs/cuda.md has the
    numbers). The first launch of each specialization
    goes through the JIT (which compiles and returns the compiled kernel); later
    ones with the same specialization key call it directly. Falls back to the
    JIT path for good if this Triton's compiled kernels look different.
    """

    def __init__(self, jit_fn: Any) -> None:
        self._fn = jit_fn
        self._kernels: dict[tuple[Any, ...], Any] = {}
        self._direct = True
        try:
            from triton import knobs

            self._hooks = knobs.runtime
        except ImportError:  # pragma: no cover - older Triton
            self._direct = False

    def launch(
        self,
        grid: tuple[int, int],
        args: tuple[Any, ...],
        consts: tuple[tuple[str, Any], ...],
        num_warps: int,
        stream: Any,
        context: Callable[[], Any],
    ) -> None:
        """``fn[grid](*args, **consts, num_warps=...)`` on ``stream`` (a torch stream); ``context()`` makes
        that stream current for the JIT path."""
        key = (tuple(_spec(a) for a in args), consts, num_warps)
        kernel = self._kernels.get(key) if self._direct else None
        if kernel is not None:
            h = stream.cuda_stream
            full = (*args, *(v for _, v in consts))
            meta = kernel.launch_metadata((grid[0], grid[1], 1), h, *full)
            hooks = self._hooks
            kernel.run(
                grid[0],
                grid[1],
                1,
                h,
                kernel.function,
                kernel.packed_metadata,
                meta,
                hooks.launch_enter_hook,
                hooks.launch_exit_hook,
                *full,
            )
            return
        with context():
            compiled = self._fn[grid](*args, **dict(consts), num_warps=num_warps)
        if self._direct:
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
                self._kernels[key] = compiled
            else:  # pragma: no cover - another Triton
                self._direct = False


def _launch_spec(
    src: tuple[Any, int, int],
    dst: tuple[Any, int, int],
    table: Any,
    tiles: int,
    regions: int,
    gcd: int,
    tile_bytes: int,
) -> tuple[Any, ...]:
    """(grid, args, constexprs) of ``copy_pieces_kernel``: ``src``/``dst`` are (bases array or None for a
    linear side, first, step); ``gcd`` of every address and length picks the widest load."""
    low = gcd & -gcd if gcd else 16
    width = min(8, low)
    consts = (
        ("S_ARRAY", src[0] is not None),
        ("D_ARRAY", dst[0] is not None),
        ("W", width),
        ("BLOCK", tile_bytes // width),
        ("ALIGN16", low >= 16),
    )
    sb = table if src[0] is None else src[0]  # unused by the kernel on a linear side
    db = table if dst[0] is None else dst[0]
    return (tiles, regions), (sb, src[1], src[2], db, dst[1], dst[2], table, tiles), consts


@dataclass(frozen=True)
class _Template:
    """What a prepared gather or scatter of one piece array over one region list needs for any range of
    those regions: the device table, the uploaded bases (a range is a view), their common alignment."""

    pieces: np.ndarray
    regions: tuple[int, ...]
    index: dict[int, int]
    bases: Any
    table: Any
    tiles: int
    gcd: int  # of the table's offsets and lengths and of every region base
    per_region: int

    def launch(self, kind: str, regions: list[int], staging_addr: int, tile_bytes: int) -> tuple[Any, ...] | None:
        """(grid, args, constexprs) for ``regions`` (a contiguous range of ours) and this staging address."""
        i, n = self.index.get(regions[0]), len(regions)
        if i is None or i + n > len(self.regions) or self.regions[i + n - 1] != regions[-1] or n > 65535:
            return None
        if n > 2 and self.regions[i + n // 2] != regions[n // 2]:
            return None
        g = math.gcd(self.gcd, staging_addr, self.per_region)
        kv, staging = (self.bases[i : i + n], 0, 0), (None, staging_addr, self.per_region)
        src, dst = (kv, staging) if kind == "gather" else (staging, kv)
        return _launch_spec(src, dst, self.table, self.tiles, n, g, tile_bytes)


class PinnedRing:
    """Page-locked host slots that piece tables are uploaded from, each with a device twin.

    ``pin_memory()`` per upload costs several times the upload itself on an
    engine thread that just woke (the host allocator's bookkeeping), and the
    upload is on the finished order's path: P builds a peer copy's table when
    D's registration arrives. A slot is written again only once the upload
    that read it has run (its event): a table queued behind a long copy, or
    behind a wait for a layer still being computed, is never overwritten
    before the device read it, and the caller is never made to wait for that
    (``upload`` gives None: the caller pins a buffer of its own instead).

    A table used by one launch only (a peer copy's, built as it is posted) is copied into the slot's
    device twin instead of a new device tensor (``lend``), and ``hold`` keeps the slot, host and device,
    until that launch's end event. That saves the allocation and the upload's own event, most of a
    table's host cost on a woken thread. (Letting the kernel read the page-locked slot in place saved the
    copy too, but every program then reads its piece over the host link, and the copy took 0.15 ms longer
    than that saved: docs/benchmarks-log.md, "The finished order's P path on a woken thread".)
    """

    def __init__(self, torch: ModuleType, slots: int = 32, slot_elems: int = 8192) -> None:
        self._torch = torch
        self.slots, self.slot_elems = int(slots), int(slot_elems)
        self._buf = torch.empty(self.slots * self.slot_elems, dtype=torch.int64, pin_memory=True)
        self._host = self._buf.numpy()
        self._events: list[Any] = [None] * self.slots  # each slot's event, made once and recorded again
        self._recorded = [False] * self.slots
        self._held: list[Any] = [None] * self.slots  # a lent slot: the end event of the kernel reading it
        self._dev: Any = None  # the device twins, one allocation, made at the first ``lend``
        self._next = 0

    def _take(self, n: int) -> int | None:
        """The next slot for ``n`` words, or None when they do not fit or it is still read (an upload that has
        not run, a kernel reading it in place that has not ended)."""
        i = self._next
        if n > self.slot_elems or (self._recorded[i] and not self._events[i].query()):
            return None
        if (held := self._held[i]) is _LENT or (held is not None and not held.query()):
            return None
        self._held[i] = None
        self._next = (i + 1) % self.slots
        return i

    def lend(self, arr: np.ndarray, device: Any) -> tuple[Any, int] | None:
        """``arr`` (int64) in the next slot's device twin, copied on the current stream (the copier's), and the
        slot's index for ``hold``; None when ``upload``'s None would be."""
        n = int(arr.size)
        if (i := self._take(n)) is None:
            return None
        if self._dev is None:
            self._dev = self._torch.empty(self.slots * self.slot_elems, dtype=self._torch.int64, device=device)
        self._held[i] = _LENT  # until ``hold``: no upload of this launch's bases may take the slot meanwhile
        off = i * self.slot_elems
        self._host[off : off + n] = arr
        out = self._dev[off : off + n]
        out.copy_(self._buf[off : off + n], non_blocking=True)
        return out, i

    def hold(self, i: int, end: Any) -> None:
        """Slot ``i`` (from ``lend``) is read until event ``end``: not written again before it is reached (a launch
        that failed holds it until the copy into its twin ran)."""
        self._held[i] = end

    def upload(self, arr: np.ndarray, device: Any, stream: Any) -> Any:
        """``arr`` (int64, at most ``slot_elems``) in a new device tensor, copied on ``stream`` (the current
        one); None when the next slot's last upload has not run yet."""
        n = int(arr.size)
        if (i := self._take(n)) is None:
            return None
        off = i * self.slot_elems
        self._host[off : off + n] = arr
        out = self._torch.empty(n, dtype=self._torch.int64, device=device)
        out.copy_(self._buf[off : off + n], non_blocking=True)
        if (ev := self._events[i]) is None:
            ev = self._events[i] = self._torch.cuda.Event()
        ev.record(stream)
        self._recorded[i] = True
        return out


_LENT = object()
"""A lent slot whose launch is not queued yet: taken by nothing else."""


class PieceCopier:
    """Copies the same pieces of many regions between device memory areas, on one device.

    Piece tables and region-base arrays are uploaded once and cached (LRU):
    a request's pieces are reused by every chunk of a pipelined transfer and
    the KV region bases never change, so a steady-state call issues no
    host-to-device copy, which would queue behind NIXL's copies on the copy
    engines.
    """

    def __init__(
        self,
        torch: ModuleType,
        device: str,
        kernel: Kernel = "auto",
        tile_bytes: int = 4096,
        num_warps: int = 4,
        cache_entries: int = 32,
        stream_priority: int = -1,
    ) -> None:
        if kernel not in ("auto", "triton", "torch"):
            raise BackendError(f"unknown CUDA copy kernel {kernel!r}: choose auto, triton or torch")
        if tile_bytes < 16 or tile_bytes & (tile_bytes - 1):
            raise BackendError(f"tile_bytes must be a power of two >= 16, got {tile_bytes}")
        self._torch = torch
        self.device = torch.device(device)
        self.tile_bytes = int(tile_bytes)
        self.num_warps = int(num_warps)
        self.requested: str = kernel
        self.kernel: str = kernel
        self._stream: Any = None
        self.stream_priority = int(stream_priority)
        self._launch: Any = None
        self._cache_entries = cache_entries
        self._tables: OrderedDict[bytes, tuple[Any, int, int]] = OrderedDict()
        self._bases: OrderedDict[tuple[int, ...], tuple[Any, int]] = OrderedDict()
        self._by_identity: OrderedDict[tuple[str, tuple[int, ...]], tuple[tuple[Any, ...], Any]] = OrderedDict()
        # (kind, id(pieces), first region, last region, regions, staging address) -> (pieces, launch): the
        # parts a push announced with prepare_*, launched without recomputing anything.
        self._prepared: OrderedDict[tuple[Any, ...], tuple[np.ndarray, tuple[Any, ...]]] = OrderedDict()
        self._templates: OrderedDict[tuple[str, int], _Template] = OrderedDict()  # (kind, id(pieces))
        self._ring: PinnedRing | None = None
        self._bound: dict[int, Any] = {}  # thread id -> the stream ``bind_here`` made current on that thread
        self.stats: dict[str, float] = {
            "calls": 0,
            "call_s": 0.0,  # whole _copy calls, host
            "prep_s": 0.0,  # tables and bases found (Triton path)
            "launch_s": 0.0,  # the kernel launch
            "event_s": 0.0,  # the end event created and recorded (asynchronous calls)
            "wait_s": 0.0,  # synchronous calls waiting for the copy
            "uploads": 0,
            "lent": 0,  # tables copied into a ring slot's device twin, held until their launch ended
            "prepared_calls": 0,  # asynchronous calls launched as prepare_* computed them
        }
        if kernel in ("auto", "triton"):
            try:
                from kvpush_cuda._kernel import copy_pieces_kernel
            except ImportError as exc:
                if kernel == "triton":
                    raise BackendError(f"Triton copy kernel requested but Triton is not importable: {exc}") from None
                log.warning("Triton not importable (%s): CUDA pack/unpack use torch indexing (slower)", exc)
                self.kernel = "torch"
            else:
                self._launch = DirectLauncher(copy_pieces_kernel)
                self.kernel = "triton"

    @property
    def stream(self) -> Any:
        """The copier's own stream: pack/unpack never queue behind (or block) the model's work.

        High priority (the default, -1): a layer-wise pack is queued while the
        forward's next GEMM fills every SM; at normal priority its blocks can
        wait for the GEMM's to drain, which puts that wait on the transfer's
        tail (measured in docs/cuda.md, ``stream_priority``).
        """
        if self._stream is None and self.device.type == "cuda":
            self._stream = self._torch.cuda.Stream(device=self.device, priority=self.stream_priority)
        return self._stream

    def bind_here(self) -> None:
        """Make the copier's stream the calling thread's current stream, for good: an engine's own thread
        (the backend's thread hook), which runs nothing else on the device.

        Its uploads and launches then skip entering and leaving a stream context, which costs more than the
        upload it wraps on a thread that just woke (docs/benchmarks-log.md, "The finished order's P path on a
        woken thread"). A stream made later (``set_stream_priority``) is not current there: calls go through
        the context again.
        """
        if self.device.type != "cuda":
            return
        torch = self._torch
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)
        self._bound[threading.get_ident()] = self.stream

    def set_stream_priority(self, priority: int) -> None:
        """Use a new stream of this priority from the next copy on (the current one is drained first)."""
        if self._stream is not None:
            self._stream.synchronize()
        self.stream_priority, self._stream = int(priority), None

    def _pieces(self, pieces: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``_unpack_pieces``, remembered for the last few piece arrays *by identity*.

        The engine passes the same array object to ``prepare_*`` and to every
        part's pack or unpack, so later calls skip the numpy work and the
        table's content hash. The array is kept referenced, so its id cannot
        be reused while it is remembered.
        """
        return self._remembered("pieces", (pieces,), lambda: _unpack_pieces(pieces))

    def _remembered(self, kind: str, objs: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """``make()``, remembered for the last few argument objects of ``kind`` by identity.

        The objects are kept referenced, so their ids cannot be reused while remembered.
        """
        key = (kind, tuple(id(o) for o in objs))
        hit = self._by_identity.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], objs, strict=True)):
            return hit[1]
        value = make()
        self._by_identity[key] = (objs, value)
        while len(self._by_identity) > 16:
            self._by_identity.popitem(last=False)
        return value

    def gather(self, regions: list[int], pieces: np.ndarray, staging_addr: int, wait: bool = True) -> Any:
        """Region 0's pieces, then region 1's, ... back to back from ``staging_addr``.

        With ``wait=False`` returns an event recorded after the copy (None if nothing to copy).
        """
        return self._staged("gather", regions, pieces, staging_addr, wait)

    def scatter(self, regions: list[int], pieces: np.ndarray, staging_addr: int, wait: bool = True) -> Any:
        """Inverse of ``gather``."""
        return self._staged("scatter", regions, pieces, staging_addr, wait)

    def _staged(self, kind: str, regions: list[int], pieces: np.ndarray, staging_addr: int, wait: bool) -> Any:
        """``gather`` or ``scatter``: a launch ``prepare_*`` computed, else a plain copy."""
        if self._templates and not wait:
            launched, event = self._prepared_launch(kind, regions, pieces, staging_addr)
            if launched:
                return event
        offs, lens, poss, per_region = self._pieces(pieces)
        if per_region == 0 or not regions:
            return None
        linear = Bases.linear(staging_addr, per_region, len(regions))
        if kind == "gather":
            return self._copy(Bases.of(regions), offs, linear, poss, lens, wait)
        return self._copy(linear, poss, Bases.of(regions), offs, lens, wait)

    def copy(
        self,
        src_bases: list[int],
        src_offs: np.ndarray,
        dst_bases: list[int],
        dst_offs: np.ndarray,
        lens: np.ndarray,
    ) -> None:
        """Copy ``lens[p]`` bytes from ``src_bases[r] + src_offs[p]`` to ``dst_bases[r] + dst_offs[p]``, all r, p.

        Synchronous: the bytes are in place when this returns.
        """
        if len(src_bases) != len(dst_bases):
            raise BackendError(f"copy: {len(src_bases)} source regions but {len(dst_bases)} destinations")
        self._copy(Bases.of(src_bases), np.asarray(src_offs), Bases.of(dst_bases), np.asarray(dst_offs), lens)

    def start_copy(self, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray) -> Any:
        """``copy`` of ``(n, 3)`` pieces (source offset, destination offset, length) that returns the CUDA
        event ending it instead of waiting (a peer copy: the destination is another process's mapped KV).
        A call ``prepare_copy`` saw (the same ``pieces`` object and bases) only launches."""
        if len(src_bases) != len(dst_bases):
            raise BackendError(f"copy: {len(src_bases)} source regions but {len(dst_bases)} destinations")
        hit = self._prepared.pop(_copy_key(src_bases, dst_bases, pieces), None) if src_bases else None
        if hit is not None and hit[0] is pieces:
            t0 = time.perf_counter()
            self._launch.launch(*hit[1], self.num_warps, self.stream, self._context)
            t1 = time.perf_counter()
            out = self._finish(False)
            self.stats["calls"] += 1
            self.stats["prepared_calls"] += 1
            self.stats["launch_s"] += t1 - t0
            self.stats["call_s"] += time.perf_counter() - t0
            return out
        src, dst = Bases.of(src_bases), Bases.of(dst_bases)
        return self._copy(src, pieces[:, 0], dst, pieces[:, 1], pieces[:, 2], False, by_content=False, lend=True)

    def prepare_copy(self, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray) -> None:
        """Upload what ``start_copy`` of these arguments needs and compute its launch now, off the critical
        path (kept for the call with this very ``pieces`` object)."""
        if self.kernel != "triton" or not src_bases or pieces.shape[0] == 0:
            return
        with self._context():
            launch = self._triton_launch(
                Bases.of(src_bases), pieces[:, 0], Bases.of(dst_bases), pieces[:, 1], pieces[:, 2], by_content=False
            )
        self._prepared[_copy_key(src_bases, dst_bases, pieces)] = (pieces, launch)
        while len(self._prepared) > 8 * self._cache_entries:
            self._prepared.popitem(last=False)

    def _copy(
        self,
        src: Bases,
        src_offs: np.ndarray,
        dst: Bases,
        dst_offs: np.ndarray,
        lens: np.ndarray,
        wait: bool = True,
        by_content: bool = True,
        lend: bool = False,
    ) -> Any:
        """The copy on the copier's stream; then either wait for it or return an event recorded after it
        (``by_content``: see ``_table``; ``lend``: the table is used by this launch only, ``PinnedRing.lend``)."""
        lens = np.asarray(lens, dtype=np.int64)
        keep = lens > 0
        if not keep.all():
            src_offs, dst_offs, lens = src_offs[keep], dst_offs[keep], lens[keep]
        if lens.size == 0 or src.count == 0:
            return None
        self.stats["calls"] += 1
        t0 = time.perf_counter()
        if self.kernel == "triton":
            try:
                slot = self._copy_triton(src, src_offs, dst, dst_offs, lens, by_content, lend and not wait)
                out = self._finish(wait)
                if slot is not None and self._ring is not None:
                    self._ring.hold(slot, out)
                self.stats["call_s"] += time.perf_counter() - t0
                return out
            except Exception as exc:
                if self.requested == "triton":
                    raise BackendError(f"Triton copy kernel failed on {self.device}: {exc}") from exc
                log.warning("Triton copy kernel failed (%s); falling back to torch indexing", exc)
                self.kernel = "torch"
        width, _ = unit_width(src.as_list(), dst.as_list(), src_offs, dst_offs, lens)
        self._copy_torch(src.as_list(), src_offs, dst.as_list(), dst_offs, lens, width)
        out = self._finish(wait)
        self.stats["call_s"] += time.perf_counter() - t0
        return out

    def _context(self) -> Any:
        torch = self._torch
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is not None and self._bound.get(threading.get_ident()) is self._stream:
            return contextlib.nullcontext()  # bind_here made the stream current on this thread
        if torch.cuda.current_device() == self.device.index:
            return torch.cuda.stream(self.stream)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def _finish(self, wait: bool = True) -> Any:
        """Wait for the copier's stream, or return an event recorded on it (the copy's end)."""
        if self.device.type != "cuda":
            return None
        if wait:
            t0 = time.perf_counter()
            self.stream.synchronize()
            self.stats["wait_s"] += time.perf_counter() - t0
            return None
        t0 = time.perf_counter()
        event = self._torch.cuda.Event()
        event.record(self.stream)
        self.stats["event_s"] += time.perf_counter() - t0
        return event

    def _upload(self, arr: np.ndarray) -> Any:
        """Host int64 array -> device tensor, through pinned memory so the copy is asynchronous."""
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        self.stats["uploads"] += 1
        if self.device.type != "cuda":
            return self._torch.from_numpy(arr)
        with self._context():  # queued on the copier's stream, ahead of the copies that read it
            if self._ring is None:
                self._ring = PinnedRing(self._torch)
            ring = self._ring
            if arr.size <= ring.slot_elems and (out := ring.upload(arr, self.device, self.stream)) is not None:
                return out
            return self._torch.from_numpy(arr).pin_memory().to(self.device, non_blocking=True)

    def _table(
        self, src_offs: np.ndarray, dst_offs: np.ndarray, lens: np.ndarray, by_content: bool = True
    ) -> tuple[Any, int, int]:
        """(device table, tiles, gcd of its offsets and lengths), cached by identity, then (``by_content``) by
        content. A peer copy's table is new with every registration (D's blocks): hashing it only costs."""
        arrays = (src_offs, dst_offs, lens)
        make = self._table_by_content if by_content else self._new_table
        return self._remembered("table", arrays, lambda: make(*arrays))

    def _table_by_content(self, src_offs: np.ndarray, dst_offs: np.ndarray, lens: np.ndarray) -> tuple[Any, int, int]:
        arrs = [np.ascontiguousarray(a, dtype=np.int64) for a in (src_offs, dst_offs, lens)]
        h = hashlib.blake2b(digest_size=16)
        for a in arrs:
            h.update(a.data)
        key = h.digest()
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit
        entry = self._new_table(*arrs)
        self._tables[key] = entry
        while len(self._tables) > self._cache_entries:
            self._tables.popitem(last=False)
        return entry

    def _new_table(self, src_offs: np.ndarray, dst_offs: np.ndarray, lens: np.ndarray) -> tuple[Any, int, int]:
        """The table uploaded, its tile count and the gcd of its offsets and lengths (no cache)."""
        table, tiles, g = self._host_table(src_offs, dst_offs, lens)
        return self._upload(table), tiles, g

    def _host_table(self, src_offs: np.ndarray, dst_offs: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, int, int]:
        """The table on the host (pieces cut to tiles, then every source offset, destination offset, length),
        its tile count and the gcd of its words."""
        arrs = [np.ascontiguousarray(a, dtype=np.int64) for a in (src_offs, dst_offs, lens)]
        so, do, ln = split_pieces(*arrs, self.tile_bytes)
        table = np.concatenate([so, do, ln])
        return table, int(ln.size), int(np.gcd.reduce(table))

    def _lent_table(
        self, src_offs: np.ndarray, dst_offs: np.ndarray, lens: np.ndarray
    ) -> tuple[Any, int, int, int] | None:
        """(the table in a ring slot's device twin, tiles, gcd, the slot's index), for one launch; None when no
        slot is free (the caller uploads instead)."""
        if self.device.type != "cuda":
            return None
        table, tiles, g = self._host_table(src_offs, dst_offs, lens)
        if self._ring is None:
            self._ring = PinnedRing(self._torch)
        with self._context():  # queued on the copier's stream, ahead of the copy that reads it
            got = self._ring.lend(table, self.device)
        if got is None:
            return None
        self.stats["lent"] += 1
        return got[0], tiles, g, got[1]

    def _bases_tensor(self, bases: Bases) -> tuple[Any, int]:
        """(device array of explicit bases, their gcd), cached: KV region bases never change.

        A part of a push copies a slice of the regions a prepare uploaded: it
        gets a view into that upload instead of an upload of its own.
        """
        assert bases.addrs is not None
        hit = self._bases.get(bases.addrs)
        if hit is None:
            hit = self._slice_of_uploaded(bases)
            if hit is None:
                hit = (self._upload(np.asarray(bases.addrs, dtype=np.int64)), bases.gcd())
            self._bases[bases.addrs] = hit
            while len(self._bases) > self._cache_entries:
                self._bases.popitem(last=False)
        else:
            self._bases.move_to_end(bases.addrs)
        return hit

    def _slice_of_uploaded(self, bases: Bases) -> tuple[Any, int] | None:
        assert bases.addrs is not None
        n = len(bases.addrs)
        for full, (tensor, _) in list(self._bases.items()):
            if len(full) <= n:
                continue
            try:
                i = full.index(bases.addrs[0])
            except ValueError:
                continue
            if full[i : i + n] == bases.addrs:
                return tensor[i : i + n], bases.gcd()
        return None

    def prepare_gather(
        self, regions: list[int], pieces: np.ndarray, parts: Sequence[tuple[int, int, int]] = ()
    ) -> None:
        """Upload what ``gather(regions, pieces, ...)`` needs now, off the critical path (any staging address).

        ``parts``: the calls to come, ``(r0, r1, staging_addr)`` for ``gather(regions[r0:r1], pieces,
        staging_addr, wait=False)``; their launches are computed now too.
        """
        self._prepare("gather", regions, pieces, parts)

    def prepare_scatter(
        self, regions: list[int], pieces: np.ndarray, parts: Sequence[tuple[int, int, int]] = ()
    ) -> None:
        """Upload what ``scatter(regions, pieces, ...)`` needs now (D knows its pieces when it registers)."""
        self._prepare("scatter", regions, pieces, parts)

    def _prepare(
        self, kind: str, regions: list[int], pieces: np.ndarray, parts: Sequence[tuple[int, int, int]]
    ) -> None:
        offs, lens, poss, per_region = self._pieces(pieces)
        if self.kernel != "triton" or not lens.size or not regions:
            return
        with self._context():
            if kind == "gather":
                table, m, g_table = self._table(offs, poss, lens)
            else:
                table, m, g_table = self._table(poss, offs, lens)
            bases = Bases.of(regions)
            bases_t, g_bases = self._bases_tensor(bases)
        # Any other range of these regions (a layer-wise part, a cut D did not guess) is launched from
        # this template: a view of the bases, two integers and the alignment, nothing recomputed.
        index = {a: i for i, a in reversed(list(enumerate(bases.addrs or ())))}
        template = _Template(
            pieces, bases.addrs or (), index, bases_t, table, m, math.gcd(g_table, g_bases), per_region
        )
        self._templates[(kind, id(pieces))] = template
        while len(self._templates) > 4 * self._cache_entries:
            self._templates.popitem(last=False)
        for r0, r1, addr in parts:
            sub = regions[r0:r1]
            if not sub:
                continue
            linear = Bases.linear(addr, per_region, len(sub))
            if kind == "gather":
                launch = self._triton_launch(Bases.of(sub), offs, linear, poss, lens)
            else:
                launch = self._triton_launch(linear, poss, Bases.of(sub), offs, lens)
            self._prepared[(kind, id(pieces), sub[0], sub[-1], len(sub), addr)] = (pieces, launch)
        while len(self._prepared) > 8 * self._cache_entries:
            self._prepared.popitem(last=False)

    def _prepared_launch(
        self, kind: str, regions: list[int], pieces: np.ndarray, staging_addr: int
    ) -> tuple[bool, Any]:
        """The launch ``_prepare`` made for exactly this call, or one from its template, run now:
        (launched, its end event); (False, None) if this call was not prepared."""
        if not regions:
            return False, None
        t0 = time.perf_counter()
        key = (kind, id(pieces), regions[0], regions[-1], len(regions), staging_addr)
        hit = self._prepared.pop(key, None)
        if hit is not None and hit[0] is pieces:
            launch = hit[1]
        else:
            tpl = self._templates.get((kind, id(pieces)))
            launch = tpl.launch(kind, regions, staging_addr, self.tile_bytes) if tpl is not None else None
            if launch is None or tpl is None or tpl.pieces is not pieces:
                return False, None
        self.stats["calls"] += 1
        self.stats["prepared_calls"] += 1
        self._launch.launch(*launch, self.num_warps, self.stream, self._context)
        t1 = time.perf_counter()
        out = self._finish(False)
        self.stats["launch_s"] += t1 - t0
        self.stats["call_s"] += time.perf_counter() - t0
        return True, out

    def _triton_launch(
        self,
        src: Bases,
        src_offs: np.ndarray,
        dst: Bases,
        dst_offs: np.ndarray,
        lens: np.ndarray,
        by_content: bool = True,
        table: tuple[Any, int, int] | None = None,
    ) -> tuple[Any, ...]:
        """(grid, args, constexprs) of the Triton copy; uploads its tables if they are new (``table``: the piece
        table, its tiles and gcd, already made)."""
        r = src.count
        if r > 65535:
            raise BackendError(f"{r} regions exceed the kernel grid's 65535")
        table, m, g = table if table is not None else self._table(src_offs, dst_offs, lens, by_content)
        sides = []
        for side in (src, dst):
            if side.addrs is not None:
                arr, gb = self._bases_tensor(side)
                sides.append((arr, side.first, side.step))
            else:
                gb = side.gcd()
                sides.append((None, side.first, side.step))
            g = math.gcd(g, gb)
        return _launch_spec(sides[0], sides[1], table, m, r, g, self.tile_bytes)

    def _copy_triton(
        self,
        src: Bases,
        src_offs: np.ndarray,
        dst: Bases,
        dst_offs: np.ndarray,
        lens: np.ndarray,
        by_content: bool = True,
        lend: bool = False,
    ) -> int | None:
        """Launch the copy; returns the ring slot whose device twin holds its table (``lend``), to hold until its
        end."""
        t0 = time.perf_counter()
        lent = self._lent_table(src_offs, dst_offs, lens) if lend else None
        try:
            # The stream is made current only where needed (uploads, the JIT path), not around every launch.
            launch = self._triton_launch(src, src_offs, dst, dst_offs, lens, by_content, lent[:3] if lent else None)
            t1 = time.perf_counter()
            self._launch.launch(*launch, self.num_warps, self.stream, self._context)
        except BaseException:
            if lent is not None and self._ring is not None:  # no launch reads the slot: free it again
                self._ring.hold(lent[3], self._finish(False))
            raise
        t2 = time.perf_counter()
        self.stats["prep_s"] += t1 - t0
        self.stats["launch_s"] += t2 - t1
        return None if lent is None else lent[3]

    def _view(self, addr: int, count: int, width: int) -> Any:
        torch = self._torch
        if self.device.type == "cuda":
            return torch.as_tensor(_RawCuda(addr, count, width), device=self.device)
        raw = (ctypes.c_uint8 * (count * width)).from_address(addr)
        return torch.frombuffer(raw, dtype=getattr(torch, _TORCH_INT[width]), count=count)

    def _copy_torch(
        self,
        src_bases: list[int],
        src_offs: np.ndarray,
        dst_bases: list[int],
        dst_offs: np.ndarray,
        lens: np.ndarray,
        width: int,
    ) -> None:
        torch = self._torch
        if lens.size == 0:
            return
        length = int(lens[0])
        rows = bool((lens == length).all()) and not (src_offs % length).any() and not (dst_offs % length).any()
        if rows:
            # Equal aligned pieces: index whole rows of `length` bytes.
            unit, sidx, didx = length, src_offs // length, dst_offs // length
        else:
            # Any pieces: index single elements of `width` bytes.
            unit = width
            n = lens // width
            rep = np.repeat(np.arange(n.size), n)
            within = np.arange(rep.size) - np.repeat(np.cumsum(n) - n, n)
            sidx, didx = src_offs[rep] // width + within, dst_offs[rep] // width + within
        per_row = unit // width
        s_rows, d_rows = int(sidx.max()) + 1, int(didx.max()) + 1
        with self._context():
            si = torch.from_numpy(np.ascontiguousarray(sidx, dtype=np.int64)).to(self.device)
            di = torch.from_numpy(np.ascontiguousarray(didx, dtype=np.int64)).to(self.device)
            for sb, db in zip(src_bases, dst_bases, strict=True):
                src = self._view(sb, s_rows * per_row, width).view(s_rows, per_row)
                dst = self._view(db, d_rows * per_row, width).view(d_rows, per_row)
                dst.index_copy_(0, di, src.index_select(0, si))


def _copy_key(src_bases: list[int], dst_bases: list[int], pieces: np.ndarray) -> tuple[Any, ...]:
    """What a prepared ``start_copy`` is found by: the pieces' identity and the bases' ends and count."""
    return ("copy", id(pieces), src_bases[0], src_bases[-1], dst_bases[0], dst_bases[-1], len(src_bases))


def _unpack_pieces(pieces: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(offsets, lengths, staging positions, bytes per region) of an ``(n, 2)`` piece array."""
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 2)
    offs, lens = p[:, 0], p[:, 1]
    poss = np.cumsum(lens) - lens
    return offs, lens, poss, int(lens.sum())
