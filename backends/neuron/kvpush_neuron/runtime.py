"""ctypes binding to the few ``libnrt`` calls the Neuron backend needs.

Why ctypes and not torch-neuronx: the backend must run (and be tested) where
no Neuron framework is installed, and libnrt's C API is the one surface every
Neuron framework (torch-neuronx, NxDI, JAX) sits on, so it is also what NIXL's
LIBFABRIC plugin itself dlopens to pick the EFA rail of a buffer.

Signatures follow the Neuron runtime headers (``nrt/nrt.h``, ``nrt/nrt_async.h``,
runtime 2.x); every call returns an ``NRT_STATUS`` that is turned into an
``NrtError`` naming the call and status. The library is found through
``KVPUSH_NRT_LIB`` (tests point it at the stand-in runtime), else
``libnrt.so.1`` on the loader path, else the SDK's default install path.
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
from typing import Any

from kvpush.core.errors import BackendError

ENV_LIB = "KVPUSH_NRT_LIB"
DEFAULT_NAMES = ("libnrt.so.1", "/opt/aws/neuron/lib/libnrt.so.1")

NRT_FRAMEWORK_TYPE_NO_FW = 1


class Status(enum.IntEnum):
    """``NRT_STATUS`` values kvpush distinguishes (nrt_status.h); others print as numbers."""

    NRT_SUCCESS = 0
    NRT_FAILURE = 1
    NRT_INVALID = 2
    NRT_INVALID_HANDLE = 3
    NRT_RESOURCE = 4
    NRT_TIMEOUT = 5
    NRT_HW_ERROR = 6
    NRT_UNINITIALIZED = 13
    NRT_CLOSED = 14


class Placement(enum.IntEnum):
    """``nrt_tensor_placement_t``: where ``nrt_tensor_allocate`` puts memory."""

    DEVICE = 0
    HOST = 1
    VIRTUAL = 2


def status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return f"NRT_STATUS {code}"


class NrtError(BackendError):
    """A libnrt call returned a status other than ``NRT_SUCCESS``."""

    def __init__(self, call: str, status: int, detail: str = "") -> None:
        msg = f"Neuron runtime call {call} failed with {status_name(status)}"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.call = call
        self.status = status


_p = ctypes.c_void_p
_sz = ctypes.c_size_t
# name -> (restype, argtypes); restype None means void.
_REQUIRED: dict[str, tuple[Any, list[Any]]] = {
    "nrt_init": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "nrt_close": (None, []),
    "nrt_get_visible_vnc_count": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]),
    "nrt_tensor_allocate": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _sz, ctypes.c_char_p, ctypes.POINTER(_p)]),
    "nrt_tensor_free": (None, [ctypes.POINTER(_p)]),
    "nrt_tensor_get_va": (_p, [_p]),
    "nrt_tensor_get_size": (_sz, [_p]),
    "nrt_tensor_read": (ctypes.c_int, [_p, _p, _sz, _sz]),
    "nrt_tensor_write": (ctypes.c_int, [_p, _p, _sz, _sz]),
    "nrt_tensor_copy": (ctypes.c_int, [_p, _sz, _p, _sz, _sz]),
}
# Newer calls: looked up when used, so an older runtime still loads.
_OPTIONAL: dict[str, tuple[Any, list[Any]]] = {
    # runtime 2.31 (SDK 2.29): which EFA NIC serves this HBM address.
    "nrt_get_attached_efa_bdf": (ctypes.c_int, [_p, ctypes.c_char_p, ctypes.POINTER(_sz)]),
    # explicit async API (nrt_async.h): completion of a scheduled request.
    "nrta_is_completed": (ctypes.c_int, [ctypes.c_uint64, ctypes.POINTER(ctypes.c_bool)]),
}


def _bind(lib: ctypes.CDLL, name: str, sig: tuple[Any, list[Any]]) -> Any:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = sig
    return fn


class Runtime:
    """One loaded libnrt; every method is a thin, checked wrapper of one call."""

    def __init__(self, path: str, lib: ctypes.CDLL) -> None:
        self.path = path
        self._lib = lib
        missing = [n for n in _REQUIRED if not hasattr(lib, n)]
        if missing:
            raise BackendError(
                f"{path} is not a usable Neuron runtime: missing symbols {', '.join(missing)} "
                "(need libnrt 2.x from aws-neuronx-runtime-lib)"
            )
        self._fn = {n: _bind(lib, n, sig) for n, sig in _REQUIRED.items()}
        for n, sig in _OPTIONAL.items():
            if hasattr(lib, n):
                self._fn[n] = _bind(lib, n, sig)
        self._initialized = False
        self._lock = threading.Lock()

    def has(self, name: str) -> bool:
        return name in self._fn

    def _need(self, name: str, why: str) -> Any:
        fn = self._fn.get(name)
        if fn is None:
            raise BackendError(f"{self.path} lacks {name}, needed {why}; upgrade the Neuron runtime")
        return fn

    def _check(self, call: str, status: int, detail: str = "") -> None:
        if status != Status.NRT_SUCCESS:
            raise NrtError(call, status, detail)

    # -- lifecycle ---------------------------------------------------------
    def init(self) -> None:
        """``nrt_init`` once per process; a second call (e.g. after torch-neuronx) is harmless.

        It must run before NIXL creates a LIBFABRIC backend: libfabric's
        FI_HMEM_NEURON support needs an initialised runtime.
        """
        with self._lock:
            if self._initialized:
                return
            self._check("nrt_init", self._fn["nrt_init"](NRT_FRAMEWORK_TYPE_NO_FW, b"", b""))
            self._initialized = True

    def close(self) -> None:
        with self._lock:
            if self._initialized:
                self._fn["nrt_close"]()
                self._initialized = False

    def visible_vnc_count(self) -> int:
        n = ctypes.c_uint32(0)
        self._check("nrt_get_visible_vnc_count", self._fn["nrt_get_visible_vnc_count"](ctypes.byref(n)))
        return int(n.value)

    # -- tensors -----------------------------------------------------------
    def allocate(self, nbytes: int, vnc: int, placement: Placement = Placement.DEVICE, name: str = "kvpush") -> int:
        """A new runtime tensor of ``nbytes`` on core ``vnc``; returns the opaque handle."""
        out = _p()
        st = self._fn["nrt_tensor_allocate"](int(placement), vnc, nbytes, name.encode(), ctypes.byref(out))
        self._check("nrt_tensor_allocate", st, f"{nbytes} bytes, {placement.name.lower()}, vnc {vnc}")
        if not out.value:
            raise NrtError("nrt_tensor_allocate", Status.NRT_FAILURE, "returned a null tensor")
        return int(out.value)

    def free(self, handle: int) -> None:
        ref = _p(handle)
        self._fn["nrt_tensor_free"](ctypes.byref(ref))

    def va(self, handle: int) -> int:
        """Virtual address of a tensor's storage; the runtime answers NULL when it is not initialised."""
        addr = self._fn["nrt_tensor_get_va"](_p(handle))
        if not addr:
            raise NrtError("nrt_tensor_get_va", Status.NRT_FAILURE, "returned NULL (runtime not initialised?)")
        return int(addr)

    def size(self, handle: int) -> int:
        return int(self._fn["nrt_tensor_get_size"](_p(handle)))

    def read(self, handle: int, dst_addr: int, offset: int, nbytes: int) -> None:
        """Device (tensor) -> host buffer at ``dst_addr``; synchronous."""
        st = self._fn["nrt_tensor_read"](_p(handle), _p(dst_addr), offset, nbytes)
        self._check("nrt_tensor_read", st, f"offset {offset}, {nbytes} bytes")

    def write(self, handle: int, src_addr: int, offset: int, nbytes: int) -> None:
        """Host buffer at ``src_addr`` -> device (tensor); synchronous."""
        st = self._fn["nrt_tensor_write"](_p(handle), _p(src_addr), offset, nbytes)
        self._check("nrt_tensor_write", st, f"offset {offset}, {nbytes} bytes")

    def copy(self, src: int, src_off: int, dst: int, dst_off: int, nbytes: int) -> None:
        """Tensor -> tensor; device tensors must share a Neuron core (else NRT_INVALID)."""
        st = self._fn["nrt_tensor_copy"](_p(src), src_off, _p(dst), dst_off, nbytes)
        self._check("nrt_tensor_copy", st, f"{nbytes} bytes, src offset {src_off}, dst offset {dst_off}")

    # -- device memory facts --------------------------------------------------
    def efa_bdf(self, addr: int) -> str | None:
        """PCI address of the EFA NIC attached to the HBM holding ``addr``; None when ``addr`` is not HBM.

        The same question NIXL's LIBFABRIC plugin asks to choose a rail, so a
        buffer this accepts is one NIXL can route.
        """
        fn = self._need("nrt_get_attached_efa_bdf", "to check that a KV tensor is Neuron device memory")
        buf = ctypes.create_string_buffer(32)
        n = _sz(len(buf))
        st = fn(_p(addr), buf, ctypes.byref(n))
        if st == Status.NRT_RESOURCE:
            raise NrtError("nrt_get_attached_efa_bdf", st, "BDF does not fit 32 bytes")
        if st != Status.NRT_SUCCESS:
            return None
        return buf.value.decode(errors="replace")

    def is_completed(self, seq: int) -> bool:
        """Whether a request scheduled through the explicit async API (``nrta_*``) finished."""
        fn = self._need("nrta_is_completed", "to wait for an asynchronous prefill (record_ready(seq=...))")
        done = ctypes.c_bool(False)
        self._check("nrta_is_completed", fn(ctypes.c_uint64(seq), ctypes.byref(done)), f"sequence {seq:#x}")
        return bool(done.value)

    def symbol(self, name: str) -> Any:
        """A raw symbol of the library (tests use stand-in extras through this)."""
        return getattr(self._lib, name)


_cache: dict[str, Runtime] = {}
_cache_lock = threading.Lock()


def load_runtime(path: str | None = None) -> Runtime:
    """The process's runtime for ``path`` (or the env/default lookup), loaded once.

    Raises ``BackendError`` listing every place it looked when no library loads.
    """
    candidates = [path] if path else ([os.environ[ENV_LIB]] if os.environ.get(ENV_LIB) else list(DEFAULT_NAMES))
    errors: list[str] = []
    with _cache_lock:
        for cand in candidates:
            if cand in _cache:
                return _cache[cand]
            try:
                lib = ctypes.CDLL(cand)
            except OSError as exc:
                errors.append(f"{cand}: {exc}")
                continue
            rt = Runtime(cand, lib)
            _cache[cand] = rt
            return rt
    where = f"{ENV_LIB}={candidates[0]}" if (path is None and os.environ.get(ENV_LIB)) else ", ".join(candidates)
    raise BackendError(
        f"Neuron runtime library not found (tried {where}): {'; '.join(errors)}. "
        "Install aws-neuronx-runtime-lib (libnrt.so.1) or point KVPUSH_NRT_LIB at it."
    )
