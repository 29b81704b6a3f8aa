"""The vLLM connector under vLLM-Neuron: backend, options and layout come from the Neuron hooks.

The caches are made the way vLLM-Neuron's ``NeuronModelRunner.initialize_kv_cache``
makes them: one device allocation per vLLM ``KVCacheTensor`` (shared by the
layers it lists), viewed per layer as ``[2, num_blocks, kv_heads, block_size,
head_dim]`` and handed to the connector as ``{layer: tensor}``; here the
allocations come from the stand-in runtime. The connector's own code path runs
(``platform_backend``, ``KVPushConnector.register_kv_caches``) with a platform
object shaped like vLLM-Neuron's ``NeuronPlatform`` and the parts of vLLM's
configs the hooks read.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_neuron_backend import NeuronPlatformLike, NxdiPlatformLike

pytest.importorskip("vllm")

from kvpush.config import Config
from kvpush.core.errors import ConfigError
from kvpush.core.layout import TokenOrder
from kvpush.integrations.vllm import connector as conn
from kvpush.integrations.vllm.startup import platform_backend
from kvpush.integrations.vllm.worker_side import WorkerSide
from kvpush_neuron import NeuronBackend
from kvpush_neuron import vllm_neuron as hooks
from kvpush_neuron.tensor import NeuronTensor

HEADS, HEAD_DIM, BLOCK, BLOCKS = 4, 16, 32, 10


def vllm_config(
    *, block_size: int = BLOCK, dcp: int = 1, cache_dtype: str = "auto", neuron_config: dict | None = None
) -> SimpleNamespace:
    """The parts of a VllmConfig the hooks read, as vLLM-Neuron leaves them."""
    mc = SimpleNamespace(
        max_model_len=4096, dtype="float16", get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HEAD_DIM
    )
    return SimpleNamespace(
        model_config=mc,
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        additional_config={"neuron_config": neuron_config or {}},
    )


def kv_cache_config(groups: list[list[str]]) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names) for names in groups])


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn"


@pytest.fixture()
def on_platform(monkeypatch: pytest.MonkeyPatch):
    import vllm.platforms

    def use(platform: object) -> None:
        monkeypatch.setattr(vllm.platforms, "current_platform", platform, raising=False)

    return use


@pytest.mark.parametrize("platform", [NeuronPlatformLike, NxdiPlatformLike], ids=["vllm-neuron", "nxdi-plugin"])
def test_neuron_platform_gives_the_neuron_backend_and_its_options(on_platform, platform: type) -> None:
    import vllm.platforms

    cpu = vllm.platforms.current_platform  # this machine's: vLLM's CPU platform
    on_platform(platform())
    name, options, neuron = platform_backend(Config.from_dict({"nixl_backends": ["LIBFABRIC"]}))
    assert (name, options, neuron) == ("neuron", {"mode": "direct", "mem": "VRAM"}, hooks)
    with pytest.raises(ConfigError, match="LIBFABRIC"):
        platform_backend(Config.from_dict({"nixl_backends": ["UCX"]}))
    on_platform(cpu)
    assert platform_backend(Config.from_dict({})) == ("host", {}, None)


def connector(backend: NeuronBackend, cfg: SimpleNamespace, kvc: Any = None) -> conn.KVPushConnector:
    """A worker-side connector with what its ``__init__`` sets, minus vLLM's engine (no engine threads)."""
    c = conn.KVPushConnector.__new__(conn.KVPushConnector)
    c._vllm_config = cfg
    c._kv_cache_config = kvc
    c._neuron = hooks
    c.worker = WorkerSide(Config.from_dict({}), backend, "e", 1, 2, producer=False, consumer=False)
    return c


def runner_caches(backend: NeuronBackend, shared_by: list[list[str]], local: int) -> tuple[dict, list[NeuronTensor]]:
    """vLLM-Neuron's caches: one allocation per KVCacheTensor, ``(2, blocks, heads, block, dim)`` for each layer."""
    shape = (2, BLOCKS, local, BLOCK, HEAD_DIM)
    allocs = [NeuronTensor(backend.runtime, shape, "float16", 0) for _ in shared_by]
    kv = {name: t for t, names in zip(allocs, shared_by, strict=True) for name in names}
    return kv, allocs


def test_connector_describes_vllm_neuron_caches(nrt_lib: str) -> None:
    """TP rank 1 of 2: each layer is K then V, head-major blocks, and every element sits where the runner has it."""
    backend = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    local = HEADS // 2
    kv, allocs = runner_caches(backend, [[layer(i)] for i in range(3)], local)
    try:
        c = connector(backend, vllm_config(), kv_cache_config([list(kv)]))
        c.register_kv_caches(dict(reversed(kv.items())))  # vLLM's dict order is not the model's
        lay = c.worker.layout
        assert lay is not None and [r.layer for r in lay.regions] == [0, 0, 1, 1, 2, 2]
        assert (lay.block_size, lay.head_start, lay.local_heads, lay.order) == (BLOCK, local, local, TokenOrder.HND)
        shape = (2, BLOCKS, local, BLOCK, HEAD_DIM)
        rng = np.random.default_rng(0)
        for _ in range(200):
            li, kvi, b, h, tok = (int(rng.integers(n)) for n in (3, 2, BLOCKS, local, BLOCK))
            want = allocs[li].va + int(np.ravel_multi_index((kvi, b, h, tok, 0), shape)) * 2
            region = lay.regions[2 * li + kvi]
            assert region.base + b * lay.block_stride + (h * BLOCK + tok) * lay.head_bytes == want
        assert [(r.addr, r.size) for r in backend.registrations(lay)] == sorted((t.va, t.size) for t in allocs)
    finally:
        for t in allocs:
            t.free()
        backend.close()


def test_hybrid_kv_cache_groups_follow_vllms_kv_cache_config(nrt_lib: str) -> None:
    """Sliding-window beside full attention: each layer's regions carry its group, layers of two groups share one
    allocation (as vLLM's hybrid allocator lays them out), and each allocation is registered once."""
    backend = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    shared_by = [[layer(0), layer(1)], [layer(2), layer(3)]]
    kv, allocs = runner_caches(backend, shared_by, HEADS // 2)
    groups = [[layer(0), layer(2)], [layer(1), layer(3)]]  # full attention, sliding window
    try:
        c = connector(backend, vllm_config(), kv_cache_config(groups))
        c.register_kv_caches(kv)
        lay = c.worker.layout
        assert lay is not None
        assert [r.group for r in lay.regions] == [0, 0, 1, 1, 0, 0, 1, 1]
        assert [r.base for r in lay.regions[:2]] == [r.base for r in lay.regions[2:4]]
        assert [(r.addr, r.size) for r in backend.registrations(lay)] == sorted((t.va, t.size) for t in allocs)
    finally:
        for t in allocs:
            t.free()
        backend.close()


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        (vllm_config(dcp=2), ["decode_context_parallel_size=2", "NeuronNixlConnector"]),
        (vllm_config(cache_dtype="fp8", neuron_config={"fp8_packed_kv": True}), ["fp8_packed_kv", "token pairs"]),
    ],
    ids=["dcp", "fp8-packed-k"],
)
def test_settings_kvpush_cannot_push_are_refused_at_registration(nrt_lib: str, cfg: Any, words: list[str]) -> None:
    backend = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    kv, allocs = runner_caches(backend, [[layer(0)]], HEADS // 2)
    try:
        with pytest.raises(ConfigError) as info:
            connector(backend, cfg, kv_cache_config([list(kv)])).register_kv_caches(kv)
        assert all(w in str(info.value) for w in words), info.value
    finally:
        for t in allocs:
            t.free()
        backend.close()


def test_vllm_cache_spec_reads_vllm_neurons_settings() -> None:
    spec = hooks.vllm_cache_spec(vllm_config(block_size=64, cache_dtype="fp8"), 3, 8)
    assert (spec.axes, spec.block_size, spec.num_heads, spec.head_dim) == ("KBHNC", 64, 4, 16)
    assert spec.dtype == "float8_e4m3fn"
    assert (spec.local_heads, spec.head_start, spec.layer_groups) == (1, 1, ())
    assert hooks.vllm_cache_spec(vllm_config(), 0, 1).dtype == "float16"  # cache_dtype auto: the model's dtype
    fp8_plain = vllm_config(cache_dtype="fp8_e5m2", neuron_config={"fp8_packed_kv": True})  # packing is e4m3 only
    assert hooks.vllm_cache_spec(fp8_plain).dtype == "float8_e5m2"
    with pytest.raises(ConfigError, match="no KV-cache group"):
        hooks.vllm_cache_spec(vllm_config(), 0, 1, kv_cache_config([[layer(0)]]), [layer(0), layer(1)])


def test_a_cache_the_neuron_backend_refuses_names_shape_and_supported_layouts(nrt_lib: str) -> None:
    backend = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    t = NeuronTensor(backend.runtime, (2, BLOCKS, 3, BLOCK, HEAD_DIM), "float16", 0)  # 3 heads, 2 expected
    try:
        with pytest.raises(Exception) as info:
            connector(backend, vllm_config()).register_kv_caches({layer(0): t})
        msg = str(info.value)
        assert "(2, 10, 3, 32, 16)" in msg and "vLLM-Neuron paged" in msg and "H=3, expected 2" in msg, msg
    finally:
        t.free()
        backend.close()
