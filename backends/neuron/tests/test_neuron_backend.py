"""The backend's own work in one process: registration, staging copies, ordering, vLLM-Neuron hooks."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
from _kvmodel import Side, random_arrays
from _standin import delayed_write
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.backends import load_backend
from kvpush.core.errors import BackendError, ConfigError
from kvpush.core.layout import MemKind
from kvpush_neuron import Mode, NeuronBackend, NeuronTensor, ReadyMarker
from kvpush_neuron import vllm_neuron as hooks
from kvpush_neuron.runtime import Placement

SIDE = Side("paged", 2, 4, 0, 1, 8, "float16", 4, 6)


def make_cache(b: NeuronBackend, seed: int) -> tuple[list[NeuronTensor], list[np.ndarray]]:
    arrays = random_arrays(SIDE, seed)
    tensors = [NeuronTensor(b.runtime, a.shape, SIDE.dtype, 0) for a in arrays]
    for t, a in zip(tensors, arrays, strict=True):
        t.write_bytes(a.view(np.uint8).reshape(-1))
    return tensors, arrays


def host_view(t: NeuronTensor) -> np.ndarray:
    return t.read_bytes()


def test_entry_point_loads_the_neuron_backend(nrt_lib: str) -> None:
    b = load_backend("neuron", mode="host_staging", mem="DRAM", lib=nrt_lib)
    assert isinstance(b, NeuronBackend) and b.mode is Mode.HOST_STAGING and b.name == "neuron"


def test_registrations_per_mode(nrt_lib: str) -> None:
    for mode, mem in (("direct", "VRAM"), ("direct", "DRAM"), ("host_staging", "VRAM")):
        b = NeuronBackend(mode=mode, mem=mem, lib=nrt_lib)
        tensors, _ = make_cache(b, 0)
        try:
            lay = b.describe(SIDE.kv_caches(tensors), SIDE.spec())
            regs = b.registrations(lay)
            if mode == "host_staging":
                assert regs == [] and not b.capabilities.direct
            else:
                assert b.capabilities.direct
                assert sorted((r.addr, r.size) for r in regs) == sorted((t.va, t.nbytes) for t in tensors)
                assert {r.mem for r in regs} == {MemKind(mem)} and {r.device_id for r in regs} == {0}
            assert b.efa_bdfs[0]  # the EFA NIC the runtime reports for core 0
        finally:
            b.close()
            for t in tensors:
                t.free()


@settings(max_examples=25, deadline=None)
@given(data=st.data(), mode=st.sampled_from(["direct", "host_staging"]))
def test_pack_then_unpack_moves_the_pieces_through_the_runtime(nrt_lib: str, data: st.DataObject, mode: str) -> None:
    """P packs pieces of every region into staging; D unpacks them into its own cache: byte-exact."""
    b = NeuronBackend(mode=mode, mem="DRAM", lib=nrt_lib)
    src, src_arrays = make_cache(b, data.draw(st.integers(0, 1000)))
    dst, _ = make_cache(b, 7)
    try:
        ls = b.describe(SIDE.kv_caches(src), SIDE.spec())
        ld = b.describe(SIDE.kv_caches(dst), SIDE.spec())
        region_bytes = ls.num_blocks * ls.block_stride
        n = data.draw(st.integers(1, 12))
        starts = data.draw(st.lists(st.integers(0, region_bytes - 1), min_size=n, max_size=n))
        pieces = np.array([[s, data.draw(st.integers(1, region_bytes - s))] for s in starts], dtype=np.int64)
        total = int(pieces[:, 1].sum()) * len(ls.regions)
        staging = b.alloc_staging(total, 0)
        assert staging.mem == (MemKind.DRAM if mode == "host_staging" else b.mem)
        before = [host_view(t) for t in dst]
        b.pack([r.base for r in ls.regions], pieces, staging.addr)
        b.unpack([r.base for r in ld.regions], pieces, staging.addr)

        want = [x.copy() for x in before]
        region_ix = [(i // 2, (i % 2) * (SIDE.shapes()[0][1] * ls.block_stride)) for i in range(len(ls.regions))]
        src_bytes = [a.view(np.uint8).reshape(-1) for a in src_arrays]
        for tensor_i, base in region_ix:
            for off, ln in pieces.tolist():
                want[tensor_i][base + off : base + off + ln] = src_bytes[tensor_i][base + off : base + off + ln]
        got = [host_view(t) for t in dst]
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        b.close()
        for t in src + dst:
            t.free()


def test_close_frees_staging_tensors(nrt_lib: str, standin_only: None) -> None:
    b = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    live = b.runtime.symbol("kvpush_standin_live_tensors")
    live.restype = ctypes.c_size_t
    n0 = live()
    b.alloc_staging(1 << 16, 0)
    b.alloc_staging(1 << 16, 1)
    assert live() == n0 + 2
    b.close()
    assert live() == n0


def test_wait_ready_waits_for_the_device_work(backend: NeuronBackend, standin_only: None) -> None:
    t = NeuronTensor(backend.runtime, (4096,), "uint8", 0)
    try:
        data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        seq = delayed_write(t, data, 0.3)
        marker = backend.record_ready(seq=seq)
        assert not backend.runtime.is_completed(seq)
        assert not np.array_equal(t.read_bytes(), data), "the write landed before its delay"
        t0 = time.monotonic()
        backend.wait_ready(marker)
        assert time.monotonic() - t0 > 0.1
        assert np.array_equal(t.read_bytes(), data)
    finally:
        t.free()


def test_poll_ready_answers_without_waiting(backend: NeuronBackend, standin_only: None) -> None:
    t = NeuronTensor(backend.runtime, (4096,), "uint8", 0)
    try:
        data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        marker = backend.record_ready(seq=delayed_write(t, data, 0.3))
        t0 = time.monotonic()
        assert backend.poll_ready(marker) is False
        assert time.monotonic() - t0 < 0.1, "poll_ready waited"
        deadline = time.monotonic() + 5
        while not backend.poll_ready(marker):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert np.array_equal(t.read_bytes(), data)
        assert backend.poll_ready(None) is True
        with pytest.raises(BackendError, match="not a marker"):
            backend.poll_ready(object())
    finally:
        t.free()


def test_wait_ready_times_out_with_the_sequence(nrt_lib: str, standin_only: None) -> None:
    b = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib, ready_timeout_s=0.05)
    t = NeuronTensor(b.runtime, (64,), "uint8", 0)
    seq = delayed_write(t, np.ones(64, np.uint8), 0.5)
    with pytest.raises(BackendError, match=f"nrta sequence {seq:#x}.*did not complete within 0.05s"):
        b.wait_ready(b.record_ready(seq=seq))
    assert b.record_ready(seq=seq) == ReadyMarker(seq=seq)
    time.sleep(0.5)  # let the delayed write land before the tensor goes
    t.free()


def test_wait_ready_runs_the_fence_on_the_calling_thread(backend: NeuronBackend) -> None:
    seen: list[str] = []
    marker = backend.record_ready(fence=lambda: seen.append(threading.current_thread().name))
    th = threading.Thread(target=backend.wait_ready, args=(marker,), name="push-thread")
    th.start()
    th.join()
    assert seen == ["push-thread"]
    backend.wait_ready(None)
    with pytest.raises(BackendError, match=r"not a marker from NeuronBackend\.record_ready"):
        backend.wait_ready(object())


def test_efa_query_refuses_runtime_host_memory(backend: NeuronBackend) -> None:
    """Only HBM has an attached EFA NIC; runtime host tensors do not, so they never pass as device memory."""
    t = NeuronTensor(backend.runtime, (64,), "uint8", 0, placement=Placement.HOST)
    try:
        assert backend.runtime.efa_bdf(t.va) is None
    finally:
        t.free()


# -- vLLM-Neuron hooks ----------------------------------------------------------


class NeuronPlatformLike:
    """The attributes vLLM-Neuron's NeuronPlatform declares (vllm_neuron/vllm/platform.py)."""

    device_name = "neuron"
    device_type = "neuron"
    ray_device_key = "neuron_cores"
    device_control_env_var = "NEURON_VISIBLE_DEVICES"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"neuron:{device_id}"


class NeuronCpuModePlatformLike(NeuronPlatformLike):
    """vLLM-Neuron under VLLM_NEURON_CPU_MODE: device type ``cpu``, still the Neuron platform."""

    device_name = "cpu"
    device_type = "cpu"


class NxdiPlatformLike:
    """The older NxDI-based plugin's platform attributes."""

    device_name = "cpu"
    device_type = "cpu"
    ray_device_key = "neuron_cores"
    device_control_env_var = "NEURON_RT_VISIBLE_CORES"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "neuron"


class CpuPlatformLike:
    device_name = "cpu"
    device_type = "cpu"
    ray_device_key = ""
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"


class CudaPlatformLike(CpuPlatformLike):
    device_type = "cuda"


def test_select_backend_follows_the_platform() -> None:
    assert hooks.select_backend(NeuronPlatformLike()) == "neuron"
    assert hooks.select_backend(NeuronCpuModePlatformLike()) == "neuron"
    assert hooks.select_backend(NxdiPlatformLike()) == "neuron"
    assert hooks.select_backend("neuron") == "neuron"
    assert hooks.select_backend(CpuPlatformLike()) == "host"
    assert hooks.select_backend(CudaPlatformLike()) == "cuda"


@pytest.mark.parametrize("attr", ["device_type", "device_control_env_var", "ray_device_key", "get_device_name"])
def test_each_neuron_platform_attribute_alone_identifies_it(attr: str) -> None:
    """vLLM-Neuron is recognised from any one of its attributes (variants differ in the others)."""
    plat = CpuPlatformLike()
    value = getattr(NeuronPlatformLike, attr)
    setattr(plat, attr, value)
    assert hooks.is_neuron_platform(plat)


def test_backend_options_follow_the_nixl_transport() -> None:
    assert hooks.backend_options(["LIBFABRIC"], env={}) == {"mode": "direct", "mem": "VRAM"}
    assert hooks.backend_options(["UCX", "LIBFABRIC"], env={}) == {"mode": "direct", "mem": "VRAM"}
    env = {"KVPUSH_NEURON_MODE": "direct", "KVPUSH_NEURON_MEM": "DRAM"}
    assert hooks.backend_options(["UCX"], env=env) == {"mode": "direct", "mem": "DRAM"}
    assert hooks.backend_options(["UCX"], env={"KVPUSH_NEURON_MEM": "DRAM"}) == {"mode": "direct", "mem": "DRAM"}
    assert hooks.nixl_memory_type("direct") == "VRAM"
    assert hooks.nixl_memory_type(Mode.HOST_STAGING) == "DRAM"
    assert hooks.nixl_supported_devices() == {"neuron": ("cuda",)}


def test_backend_options_refuse_a_transport_that_cannot_register_neuron_memory() -> None:
    """vLLM-Neuron's caches are device tensors: without LIBFABRIC nothing could register them, so refuse at start."""
    with pytest.raises(ConfigError, match="LIBFABRIC") as info:
        hooks.backend_options(["UCX"], env={})
    assert "['UCX']" in str(info.value)


def test_cache_spec_from_neuron_config() -> None:
    bhsd = hooks.cache_spec(
        is_block_kv_layout=False, block_size=32, max_seq_len=2048, num_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    assert (bhsd.block_size, bhsd.axes) == (2048, "BHNC")
    blk = hooks.cache_spec(
        is_block_kv_layout=True, block_size=32, max_seq_len=2048, num_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    assert (blk.block_size, blk.axes) == (32, "BNHC")
