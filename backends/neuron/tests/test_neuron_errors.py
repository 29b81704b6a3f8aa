"""Missing runtime, wrong device, memory not from the runtime: each a clear BackendError."""

from __future__ import annotations

import ctypes.util
from dataclasses import dataclass

import numpy as np
import pytest
from _standin import compile_standin

from kvpush.backends import load_backend
from kvpush.core.errors import BackendError, ConfigError
from kvpush_neuron import NeuronBackend, NeuronTensor, paged_spec
from kvpush_neuron.runtime import NrtError, Placement, Status, load_runtime

SPEC = paged_spec(block_size=4, num_heads=2, head_dim=8, dtype="float16")
SHAPE = (2, 3, 2, 4, 8)  # vLLM-Neuron paged: K/V, 3 blocks, 2 heads, 4 tokens, 8 dims


@dataclass
class _Dev:
    type: str
    index: int = 0


class FrameworkTensor:
    """Shaped like a torch tensor (what torch-neuronx hands over), over any address."""

    def __init__(self, addr: int, device: str, shape: tuple[int, ...] = SHAPE) -> None:
        self._addr, self.device, self.shape, self.dtype = addr, _Dev(device), shape, "torch.float16"

    def data_ptr(self) -> int:
        return self._addr

    def element_size(self) -> int:
        return 2

    def stride(self) -> tuple[int, ...]:
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))


def test_missing_runtime_names_what_was_tried(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = str(tmp_path / "libnrt.so.1")
    monkeypatch.setenv("KVPUSH_NRT_LIB", missing)
    with pytest.raises(BackendError, match=r"Neuron runtime library not found \(tried KVPUSH_NRT_LIB=.*aws-neuronx"):
        NeuronBackend()
    with pytest.raises(BackendError, match="not found"):
        load_backend("neuron", mode="direct")


def test_library_without_nrt_symbols_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    libm = ctypes.util.find_library("m")
    assert libm, "libm not found"
    with pytest.raises(BackendError, match=r"not a usable Neuron runtime: missing symbols nrt_init"):
        load_runtime(libm)


def test_bad_options_are_config_errors(nrt_lib: str) -> None:
    with pytest.raises(ConfigError, match="mode 'gpu'"):
        NeuronBackend(mode="gpu", lib=nrt_lib)
    with pytest.raises(ConfigError, match="mem 'HBM'"):
        NeuronBackend(mem="HBM", lib=nrt_lib)


def test_numpy_array_is_host_memory(backend: NeuronBackend) -> None:
    with pytest.raises(BackendError, match=r"layer l0: KV tensor is a numpy array \(host memory\).*backend 'host'"):
        backend.describe({"l0": np.zeros(SHAPE, np.float16)}, SPEC)


def test_tensor_on_another_device_type(backend: NeuronBackend) -> None:
    arr = np.zeros(SHAPE, np.float16)
    with pytest.raises(BackendError, match=r"layer l0: tensor is on device 'cuda', not a Neuron device"):
        backend.describe({"l0": FrameworkTensor(arr.ctypes.data, "cuda")}, SPEC)


def test_neuron_typed_tensor_not_from_the_runtime(backend: NeuronBackend) -> None:
    """A tensor claiming the neuron device but backed by ordinary host memory."""
    arr = np.zeros(SHAPE, np.float16)
    with pytest.raises(BackendError, match=r"is not Neuron device memory \(nrt_get_attached_efa_bdf refused it\)"):
        backend.describe({"l0": FrameworkTensor(arr.ctypes.data, "neuron")}, SPEC)


def test_framework_tensor_on_device_memory_registers_directly(backend: NeuronBackend) -> None:
    """torch-neuronx style tensors (address, no runtime handle) describe and register, but cannot be packed."""
    t = NeuronTensor(backend.runtime, SHAPE, "float16", 0)
    try:
        lay = backend.describe({"l0": FrameworkTensor(t.va, "privateuseone")}, SPEC)
        assert [r.addr for r in backend.registrations(lay)] == [t.va]
        staging = backend.alloc_staging(4096, 0)
        with pytest.raises(BackendError, match="no Neuron runtime handle"):
            backend.pack([lay.regions[0].base], np.array([[0, 64]]), staging.addr)
    finally:
        t.free()


def test_framework_tensor_without_mapped_address(backend: NeuronBackend) -> None:
    with pytest.raises(BackendError, match=r"data_ptr\(\) == 0.*NEURON_RT_MAP_HBM"):
        backend.describe({"l0": FrameworkTensor(0, "privateuseone")}, SPEC)


def test_runtime_host_memory_is_not_device_memory(backend: NeuronBackend) -> None:
    t = NeuronTensor(backend.runtime, SHAPE, "float16", 0, placement=Placement.HOST)
    try:
        with pytest.raises(BackendError, match="runtime host memory, not on a Neuron device"):
            backend.describe({"l0": t}, SPEC)
    finally:
        t.free()


def test_freed_tensor(backend: NeuronBackend) -> None:
    t = NeuronTensor(backend.runtime, SHAPE, "float16", 0)
    t.free()
    with pytest.raises(BackendError, match="already freed"):
        backend.describe({"l0": t}, SPEC)


def test_wrong_shape_names_the_layer(backend: NeuronBackend) -> None:
    t = NeuronTensor(backend.runtime, (2, 3, 4, 4, 8), "float16", 0)
    try:
        with pytest.raises(BackendError, match=r"layer l0: shape \(2, 3, 4, 4, 8\) .*H=4, expected 2"):
            backend.describe({"l0": t}, SPEC)
    finally:
        t.free()


def test_core_out_of_range_is_an_nrt_error(backend: NeuronBackend) -> None:
    vncs = backend.runtime.visible_vnc_count()
    with pytest.raises(NrtError, match=f"nrt_tensor_allocate failed with NRT_INVALID.*vnc {vncs}") as err:
        NeuronTensor(backend.runtime, (16,), "uint8", vncs)
    assert err.value.status == Status.NRT_INVALID


def test_pack_outside_described_memory(backend: NeuronBackend) -> None:
    staging = backend.alloc_staging(4096, 0)
    arr = np.zeros(4096, np.uint8)
    with pytest.raises(BackendError, match="not inside a Neuron tensor this backend described or allocated"):
        backend.pack([arr.ctypes.data], np.array([[0, 64]]), staging.addr)


def test_host_staging_refuses_framework_tensors(nrt_lib: str) -> None:
    """Host staging copies through runtime handles, which framework tensors do not carry."""
    b = NeuronBackend(mode="host_staging", mem="DRAM", lib=nrt_lib)
    t = NeuronTensor(b.runtime, SHAPE, "float16", 0)
    try:
        with pytest.raises(BackendError, match="host staging copies through Neuron runtime tensor handles"):
            b.describe({"l0": FrameworkTensor(t.va, "neuron")}, SPEC)
    finally:
        t.free()
        b.close()


def test_calls_before_nrt_init_fail_like_the_runtime(tmp_path, standin_only) -> None:
    """The stand-in enforces nrt_init first (NRT_UNINITIALIZED), so the backend's init ordering is exercised."""
    fresh = load_runtime(str(compile_standin(tmp_path, "libnrt-fresh.so.1")))
    with pytest.raises(NrtError, match="NRT_UNINITIALIZED"):
        fresh.allocate(64, 0)
    fresh.init()
    h = fresh.allocate(64, 0)
    fresh.free(h)
    fresh.close()
    with pytest.raises(NrtError, match="NRT_CLOSED"):
        fresh.allocate(64, 0)


def test_cross_core_device_copy_is_refused(nrt_lib: str) -> None:
    """nrt_tensor_copy between device tensors needs one core: packing into another core's staging fails loudly."""
    b = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    t = NeuronTensor(b.runtime, SHAPE, "float16", 0)
    try:
        lay = b.describe({"l0": t}, SPEC)
        staging = b.alloc_staging(4096, 1)
        with pytest.raises(NrtError, match="nrt_tensor_copy failed with NRT_INVALID"):
            b.pack([lay.regions[0].base], np.array([[0, 64]]), staging.addr)
    finally:
        b.close()
        t.free()
