"""Peer copies between two processes of one CPU host: Linux cross-memory attach (``process_vm_writev``).

D exports its KV spans with its process id; P, on the same host, writes D's
blocks straight from its own with ``process_vm_writev``: the kernel copies
each piece once, from P's pages into D's, with no staging buffer and no NIXL
descriptor (``kvpush.backends.peer``). The kernel lets a process write
another only where it could ptrace it (same user, or ``CAP_SYS_PTRACE``),
which is the access check; the rules here add what the kernel cannot know:

- The blob names this boot (``/proc/sys/kernel/random/boot_id``): a pid means
  nothing on another host, so a D elsewhere is out of reach (None), never a
  write into whichever local process has that pid.
- It names a *cookie*, random bytes at an address in D, that P reads back
  through the same pid before it writes anything: a pid of another pid
  namespace (two containers of one host share the boot id) or of a process
  that replaced an exited D then fails the comparison, and P answers None
  instead of writing a stranger's memory. The read needs the very ptrace
  access a write needs (the kernel checks ``PTRACE_MODE_ATTACH`` for both
  directions), so it also probes permission; a zero-length write would not:
  the kernel returns before it looks at the pid.
- P writes only inside the spans D exported: ``open_peer`` refuses a layout
  with a region outside them (None) and ``copy`` a piece outside them
  (``BackendError``), because a bad offset must not land in D's heap.

The blob is a versioned msgpack map whose ``mechanism`` says it is this one:
a blob of another mechanism or version is out of reach (None), one that says
it is ours but does not decode is malformed (``BackendError``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from kvpush.core.errors import BackendError
from kvpush.core.layout import KVLayout

log = logging.getLogger(__name__)

MECHANISM = "process_vm"
"""What a blob of this module names itself, so one of another backend's mechanism is told apart."""
VERSION = 1
"""Blob version: bumped when a field changes meaning; a peer with another one is out of reach, not an error."""
IOV_MAX = 1024
"""Most iovecs one ``process_vm_writev`` takes per side (Linux ``UIO_MAXIOV``; more fails with EINVAL)."""
COOKIE_BYTES = 16
BOOT_ID = "/proc/sys/kernel/random/boot_id"

_Addr = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
"""An address or size: user-space addresses lie far below 2**63 (and msgspec bounds stop at int64)."""


class _Header(msgspec.Struct, frozen=True):
    """What every version's blob starts with; decoded first, so a newer blob is told apart from a broken one."""

    mechanism: str
    version: int


class PeerExport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """D's offer: which process, on which boot, may be written where; ``cookie`` lies at ``cookie_addr`` in it."""

    mechanism: str
    version: int
    boot_id: str
    pid: Annotated[int, msgspec.Meta(ge=1)]
    cookie_addr: _Addr
    cookie: Annotated[bytes, msgspec.Meta(min_length=COOKIE_BYTES, max_length=COOKIE_BYTES)]
    spans: tuple[tuple[_Addr, _Addr], ...]
    """(base, size) of every exported span."""


@dataclass(frozen=True)
class PeerHandle:
    """P's handle on one D: its pid and the exported spans, merged, sorted (``lo``, ``hi`` exclusive)."""

    pid: int
    lo: np.ndarray
    hi: np.ndarray


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_call(name: str) -> Any:
    """libc's ``name`` with errno kept, or None off Linux or where libc lacks it.

    A ``CDLL`` call releases the GIL for its duration, so a copy of many MB does not stall the engine's other
    threads."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_writev = _libc_call("process_vm_writev")
_readv = _libc_call("process_vm_readv")


def available() -> bool:
    """Whether this platform has cross-memory attach at all."""
    return (
        _writev is not None
        and _readv is not None
        and ctypes.sizeof(_Iovec) == 16  # numpy builds the iovecs as two uint64
        and os.path.exists(BOOT_ID)
    )


def boot_id() -> str:
    """This boot's id: equal on two processes exactly when they run on one kernel instance."""
    with open(BOOT_ID) as f:
        return f.read().strip()


def merge_spans(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of ``spans`` ((base, size)) merged where they overlap or touch, sorted: a range lies in the
    exported memory exactly when it lies in one merged span, which one ``searchsorted`` finds."""
    merged: list[list[int]] = []
    for lo, hi in sorted((b, b + s) for b, s in spans if s > 0):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    arr = np.array(merged, dtype=np.uint64).reshape(-1, 2)
    return arr[:, 0].copy(), arr[:, 1].copy()


def inside(lo: np.ndarray, hi: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For each range ``[start, end)`` (uint64), whether one merged span ``[lo, hi)`` holds it whole."""
    if lo.size == 0:
        return np.zeros(start.shape, dtype=bool)  # nothing exported: nothing lies inside
    idx = np.searchsorted(lo, start, side="right").astype(np.int64) - 1
    ok = idx >= 0
    safe = np.maximum(idx, 0)
    return ok & (start >= lo[safe]) & (end <= hi[safe]) & (end >= start)


class Exporter:
    """D's side: the cookie a P reads back, kept alive as long as the backend that exports it."""

    def __init__(self) -> None:
        self._cookie: np.ndarray | None = None

    def export(self, spans: list[tuple[int, int]]) -> bytes | None:
        """The blob offering ``spans`` ((base, size)) to processes of this host; None without cross-memory attach."""
        if not available():
            return None
        if self._cookie is None:
            self._cookie = np.frombuffer(os.urandom(COOKIE_BYTES), dtype=np.uint8).copy()
        return msgspec.msgpack.encode(
            PeerExport(
                mechanism=MECHANISM,
                version=VERSION,
                boot_id=boot_id(),
                pid=os.getpid(),
                cookie_addr=int(self._cookie.ctypes.data),
                cookie=self._cookie.tobytes(),
                spans=tuple((int(b), int(s)) for b, s in spans),
            )
        )


class Opener:
    """P's side: opens D's blobs, logging each reason a D is out of reach once (a D re-handshakes often)."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def _out_of_reach(self, why: str) -> None:
        if why not in self._logged:
            self._logged.add(why)
            log.info("peer copy not used: %s", why)

    def open(self, blob: bytes, layout: KVLayout) -> PeerHandle | None:
        """A handle through which ``copy`` writes ``layout``'s regions in D, or None when D is out of reach.

        Raises ``BackendError`` for a blob that names this mechanism but does not decode."""
        try:
            head = msgspec.msgpack.decode(blob, type=_Header)
        except msgspec.DecodeError as exc:
            raise BackendError(f"host peer blob: not a peer-copy blob ({exc})") from None
        if head.mechanism != MECHANISM:
            self._out_of_reach(f"D's peer blob is for {head.mechanism!r}, this backend copies by {MECHANISM!r}")
            return None
        if head.version != VERSION:
            self._out_of_reach(f"D's {MECHANISM} blob is version {head.version}, this kvpush reads {VERSION}")
            return None
        try:
            exp = msgspec.msgpack.decode(blob, type=PeerExport)
        except msgspec.DecodeError as exc:
            raise BackendError(f"host peer blob: malformed {MECHANISM} v{VERSION} blob ({exc})") from None
        if not available():
            self._out_of_reach("this platform has no process_vm_writev")
            return None
        if exp.boot_id != boot_id():
            self._out_of_reach(f"D (pid {exp.pid}) runs on another host (boot id {exp.boot_id})")
            return None
        lo, hi = merge_spans(list(exp.spans))
        if layout.regions:
            start = np.array([r.base for r in layout.regions], dtype=np.uint64)
            end = start + np.array([r.size for r in layout.regions], dtype=np.uint64)
            bad = np.flatnonzero(~inside(lo, hi, start, end))
            if bad.size:
                r = layout.regions[int(bad[0])]
                self._out_of_reach(
                    f"D (pid {exp.pid}) region {int(bad[0])} [{r.base:#x}, +{r.size}) lies outside what it exported"
                )
                return None
        got = np.zeros(COOKIE_BYTES, dtype=np.uint8)
        err = _transfer(_readv, exp.pid, [int(got.ctypes.data)], [exp.cookie_addr], [COOKIE_BYTES])
        if err in (errno.EPERM, errno.ESRCH, errno.EFAULT):
            why = {errno.EPERM: "may not write it", errno.ESRCH: "no such process", errno.EFAULT: "no cookie there"}
            self._out_of_reach(f"D (pid {exp.pid}) is out of reach: {why[err]}")
            return None
        if err:
            raise BackendError(f"host peer: probing pid {exp.pid} failed: {os.strerror(err)}")
        if got.tobytes() != exp.cookie:
            self._out_of_reach(
                f"pid {exp.pid} is not the D that exported (another pid namespace, or D exited and the pid was reused)"
            )
            return None
        return PeerHandle(exp.pid, lo, hi)


def _transfer(fn: Any, pid: int, local: list[int], remote: list[int], lens: list[int]) -> int:
    """One small ``process_vm_readv``/``writev`` of parallel ranges; 0 or the errno (a short count: EFAULT)."""
    n = len(lens)
    lv = (_Iovec * n)(*[_Iovec(a, ln) for a, ln in zip(local, lens, strict=True)])
    rv = (_Iovec * n)(*[_Iovec(a, ln) for a, ln in zip(remote, lens, strict=True)])
    done = fn(pid, lv, n, rv, n, 0)
    if done < 0:
        return ctypes.get_errno()
    return 0 if done == sum(lens) else errno.EFAULT


def copy(peer: PeerHandle, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray) -> None:
    """Write every region pair's pieces (``(n, 3)``: source offset, destination offset, length) from this
    process into D's, synchronously; ``BackendError`` for a piece outside D's exported spans (checked for
    all before any byte moves) or a write the kernel cut short.

    Local and remote iovecs are parallel, piece for piece, so a batch of ``IOV_MAX`` pieces is one call and
    its expected count is the batch's bytes."""
    if len(src_bases) != len(dst_bases):
        raise BackendError(f"host peer copy: {len(src_bases)} source regions for {len(dst_bases)} destinations")
    p = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    if p.size == 0 or not src_bases:
        return
    if (p < 0).any():
        raise BackendError("host peer copy: negative offset or length in the pieces")
    p = p.astype(np.uint64)
    soff, doff, lens = p[:, 0], p[:, 1], p[:, 2]
    src = (np.array(src_bases, dtype=np.uint64)[:, None] + soff[None, :]).reshape(-1)
    dst = (np.array(dst_bases, dtype=np.uint64)[:, None] + doff[None, :]).reshape(-1)
    ln = np.tile(lens, len(src_bases))
    bad = np.flatnonzero(~inside(peer.lo, peer.hi, dst, dst + ln))
    if bad.size:
        i = int(bad[0])
        raise BackendError(
            f"host peer copy: piece [{int(dst[i]):#x}, +{int(ln[i])}) of region {i // len(lens)} lies outside "
            f"what D (pid {peer.pid}) exported; P writes only memory D offered"
        )
    keep = ln > 0
    local = np.empty((int(keep.sum()), 2), dtype=np.uint64)
    local[:, 0], local[:, 1] = src[keep], ln[keep]
    remote = np.empty_like(local)
    remote[:, 0], remote[:, 1] = dst[keep], ln[keep]
    for at in range(0, len(local), IOV_MAX):
        lv, rv = local[at : at + IOV_MAX], remote[at : at + IOV_MAX]
        want = int(lv[:, 1].sum())
        done = _writev(peer.pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
        if done != want:
            why = os.strerror(ctypes.get_errno()) if done < 0 else "short write"
            raise BackendError(
                f"host peer copy: process_vm_writev into pid {peer.pid} wrote {max(done, 0)} of {want} bytes ({why})"
            )
