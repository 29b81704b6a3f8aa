"""The vLLM connector under the Neuron platform: backend, options and layout come from the Neuron hooks.

vllm-neuron's ``NeuronPlatform`` reports ``device_type == "cpu"``; the
connector must still pick the Neuron backend, with the options its hooks give
for the NIXL transport, and describe NxDI's caches with the layout the hooks
derive from vLLM's config (per-sequence BHSD when vllm-neuron set the block
size to the model length, else the block layout). Checked with a platform
object shaped like vllm-neuron's (its ``platform.py``), NxDI-shaped caches
allocated through the stand-in runtime, and the connector's own code path
(``platform_backend``, ``KVPushConnector.register_kv_caches``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_neuron_backend import NeuronPlatformLike

pytest.importorskip("vllm")

from kvpush.config import Config
from kvpush.integrations.vllm import connector as conn
from kvpush.integrations.vllm.worker_side import WorkerSide
from kvpush.layout import TokenOrder
from kvpush_neuron import NeuronBackend
from kvpush_neuron import vllm_neuron as hooks
from kvpush_neuron.layout import nxdi_kv_caches
from kvpush_neuron.tensor import NeuronTensor

HEADS, HEAD_DIM, MAX_LEN, SLOTS = 4, 16, 256, 3


def vllm_config(block_size: int) -> SimpleNamespace:
    """The parts of a VllmConfig the Neuron hook reads (as vllm-neuron leaves them)."""
    mc = SimpleNamespace(
        max_model_len=MAX_LEN, dtype="float16", get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HEAD_DIM
    )
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(block_size=block_size))


@pytest.fixture()
def on_platform(monkeypatch: pytest.MonkeyPatch):
    import vllm.platforms

    def use(platform: object) -> None:
        monkeypatch.setattr(vllm.platforms, "current_platform", platform, raising=False)

    return use


def test_neuron_platform_gives_the_neuron_backend_and_its_options(on_platform) -> None:
    import vllm.platforms

    cpu = vllm.platforms.current_platform  # this machine's: vLLM's CPU platform
    on_platform(NeuronPlatformLike())
    name, options, neuron = conn.platform_backend(Config.from_dict({"nixl_backends": ["UCX"]}))
    assert (name, options, neuron) == ("neuron", {"mode": "host_staging", "mem": "DRAM"}, hooks)
    name, options, neuron = conn.platform_backend(Config.from_dict({"nixl_backends": ["LIBFABRIC"]}))
    assert (name, options) == ("neuron", {"mode": "direct", "mem": "VRAM"})
    on_platform(cpu)
    assert conn.platform_backend(Config.from_dict({})) == ("host", {}, None)


def connector(backend: NeuronBackend, block_size: int) -> conn.KVPushConnector:
    """A worker-side connector with what its ``__init__`` sets, minus vLLM's engine (no engine threads)."""
    c = conn.KVPushConnector.__new__(conn.KVPushConnector)
    c._vllm_config = vllm_config(block_size)
    c._kv_cache_config = None
    c._neuron = hooks
    c.worker = WorkerSide(Config.from_dict({}), backend, "e", 1, 2, producer=False, consumer=False)
    return c


@pytest.mark.parametrize("block_size", [MAX_LEN, 32], ids=["per-sequence", "block-layout"])
def test_connector_describes_nxdi_caches_with_the_hooks_layout(nrt_lib: str, block_size: int) -> None:
    """TP rank 1 of 2: the layout is the hooks' (BHSD: a slot a block, HND; block layout: NHD), and every
    token of every head sits where NxDI keeps it."""
    backend = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    local = HEADS // 2
    per_seq = block_size == MAX_LEN
    shape = (SLOTS, local, MAX_LEN, HEAD_DIM) if per_seq else (24, block_size, local, HEAD_DIM)
    tensors = [NeuronTensor(backend.runtime, shape, "float16", 0) for _ in range(4)]  # k0, v0, k1, v1
    try:
        c = connector(backend, block_size)
        c.register_kv_caches(nxdi_kv_caches(tensors))
        lay = c.worker.layout
        assert lay is not None and len(lay.regions) == 4 and [r.layer for r in lay.regions] == [0, 0, 1, 1]
        assert (lay.block_size, lay.head_start, lay.local_heads) == (block_size, local, local)
        assert lay.order is (TokenOrder.HND if per_seq else TokenOrder.NHD)
        rng = np.random.default_rng(0)
        for _ in range(50):
            r, b, tok, h = (int(rng.integers(n)) for n in (4, shape[0], block_size, local))
            idx = (b, h, tok, 0) if per_seq else (b, tok, h, 0)
            want = tensors[r].va + int(np.ravel_multi_index(idx, shape)) * 2
            inner = (h * block_size + tok) if per_seq else (tok * local + h)
            assert lay.regions[r].base + b * lay.block_stride + inner * lay.head_bytes == want
    finally:
        for t in tensors:
            t.free()
        backend.close()


def test_a_cache_the_neuron_backend_refuses_names_shape_and_supported_layouts(nrt_lib: str) -> None:
    backend = NeuronBackend(mode="direct", mem="DRAM", lib=nrt_lib)
    t = NeuronTensor(backend.runtime, (SLOTS, 3, MAX_LEN, HEAD_DIM), "float16", 0)  # 3 heads, 2 expected
    try:
        with pytest.raises(Exception) as info:
            connector(backend, MAX_LEN).register_kv_caches({"layers.0.k": t, "layers.0.v": t})
        msg = str(info.value)
        assert "(3, 3, 256, 16)" in msg and "NxDI per-sequence" in msg and "H=3, expected 2" in msg, msg
    finally:
        t.free()
        backend.close()
