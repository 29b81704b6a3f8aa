"""Neuron device tensors as the backend sees them: a runtime handle plus shape.

``NeuronTensor`` is memory allocated through libnrt (what NxDI's KV cache and
nixlbench's buffers are underneath). It exposes the few torch-like methods
``kvpush.backends.tensors.tensor_info`` reads (``data_ptr``, ``element_size``,
``stride``, ``device``), so the core's paged-layout description applies to it
unchanged. ``ForeignTensor`` is the same view of memory the backend did not
allocate (a torch-neuronx tensor): address only, no runtime handle, so it can
be registered with NIXL but not copied through the runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.core.errors import BackendError
from kvpush.core.geometry import DTYPE_BYTES
from kvpush_neuron.runtime import Placement, Runtime

DEVICE_TYPE = "neuron"


@dataclass(frozen=True)
class Device:
    """torch.device look-alike: ``type`` and ``index`` (the Neuron core)."""

    type: str
    index: int


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class _Shaped:
    """Shape, dtype and element strides of a contiguous view of device memory."""

    shape: tuple[int, ...]
    dtype: str
    vnc: int

    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def stride(self) -> tuple[int, ...]:
        return _contiguous_strides(self.shape)

    @property
    def device(self) -> Device:
        return Device(DEVICE_TYPE, self.vnc)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_size()


class NeuronTensor(_Shaped):
    """A contiguous tensor allocated through the Neuron runtime.

    The handle is what ``nrt_tensor_read/write/copy`` take; the virtual address
    (``nrt_tensor_get_va``) is what NIXL registers.
    """

    def __init__(
        self,
        runtime: Runtime,
        shape: tuple[int, ...],
        dtype: str,
        vnc: int,
        placement: Placement = Placement.DEVICE,
        name: str = "kvpush",
    ) -> None:
        if dtype not in DTYPE_BYTES:
            raise BackendError(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        self.runtime = runtime
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.vnc = vnc
        self.placement = placement
        self.handle: int | None = runtime.allocate(self.nbytes, vnc, placement, name)
        self.va = runtime.va(self.handle)
        self.size = runtime.size(self.handle)

    def data_ptr(self) -> int:
        return self.va

    def _live(self) -> int:
        if self.handle is None:
            raise BackendError("Neuron tensor was freed")
        return self.handle

    def write_bytes(self, data: np.ndarray | bytes, offset: int = 0) -> None:
        """Copy host bytes into the tensor through ``nrt_tensor_write``."""
        buf = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data)
        self.runtime.write(self._live(), int(buf.ctypes.data), offset, buf.nbytes)

    def read_bytes(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """The tensor's bytes on the host, through ``nrt_tensor_read``."""
        n = self.nbytes - offset if nbytes is None else nbytes
        out = np.empty(n, dtype=np.uint8)
        self.runtime.read(self._live(), int(out.ctypes.data), offset, n)
        return out

    def free(self) -> None:
        if self.handle is not None:
            self.runtime.free(self.handle)
            self.handle = None

    def __repr__(self) -> str:
        return f"NeuronTensor(shape={self.shape}, dtype={self.dtype}, vnc={self.vnc}, va={self.va:#x})"


class ForeignTensor(_Shaped):
    """Device memory the backend did not allocate (e.g. torch-neuronx): address, shape, byte strides."""

    handle = None

    def __init__(
        self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, itemsize: int, vnc: int
    ) -> None:
        self.va = addr
        self.shape = shape
        self._strides = strides  # in elements, as torch gives them
        self.dtype = dtype
        self._itemsize = itemsize
        self.vnc = vnc
        self.size = itemsize + sum((n - 1) * st * itemsize for n, st in zip(shape, strides, strict=True) if n > 0)

    def data_ptr(self) -> int:
        return self.va

    def element_size(self) -> int:
        return self._itemsize

    def stride(self) -> tuple[int, ...]:
        return self._strides


def torch_device(t: Any) -> tuple[str, int] | None:
    """``(type, index)`` of a torch tensor, without importing torch; None for anything else."""
    if not (hasattr(t, "data_ptr") and hasattr(t, "device") and hasattr(t, "stride")):
        return None
    dev = t.device
    return str(getattr(dev, "type", dev)), int(getattr(dev, "index", 0) or 0)
