"""What the connector tells the backend about vLLM's KV cache, and what it refuses at start.

Everything comes from vLLM's own declarations (its KV-cache group specs, the
real classes of vLLM 0.32 here), never from tensor shapes: a layout the
backend cannot describe, a model with state it cannot move, pipeline
parallelism and vLLM versions outside the supported range are refused with
an error naming the problem.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvpush.core.errors import BackendError, ConfigError  # noqa: E402
from kvpush.integrations.vllm import layout as vl  # noqa: E402


def config(kv_heads: int = 2) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads))


def groups(*specs_and_layers: tuple[object, list[str]]) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in specs_and_layers]
    )


FULL = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
SLIDING = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=64)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
L = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def test_pipeline_parallelism_is_refused_at_start() -> None:
    vl.check_parallelism(SimpleNamespace(pipeline_parallel_size=1))
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        vl.check_parallelism(SimpleNamespace(pipeline_parallel_size=2))


def test_data_parallel_engines_get_disjoint_side_channel_ports() -> None:
    """Engine k listens from base + k * tp_size: DP engines of one host never share a port."""
    ports = {
        (k, r): 5600 + vl.dp_port_offset(SimpleNamespace(data_parallel_index=k), 4) + r
        for k in range(3)
        for r in range(4)
    }
    assert len(set(ports.values())) == 12 and min(ports.values()) == 5600 and max(ports.values()) == 5611
    assert vl.dp_port_offset(SimpleNamespace(data_parallel_rank=2), 2) == 4  # vLLM before data_parallel_index


def test_caches_are_ordered_by_model_layer() -> None:
    """vLLM hands them grouped by KV-cache tensor (0, 2, 1, 3 for a two-group model): P and D order by layer."""
    kv = {L[0]: 0, L[2]: 2, L[1]: 1, L[3]: 3, "model.layers.10.self_attn.attn": 10}
    assert list(vl.in_model_order(kv).values()) == [0, 1, 2, 3, 10]


def test_dense_spec_from_vllm() -> None:
    spec = vl.vllm_cache_spec(config(2), groups((FULL, L)), L, dict.fromkeys(L, "CPU_ATTN"), 1, 2)
    assert (spec.block_size, spec.num_heads, spec.head_dim, spec.dtype) == (32, 2, 128, "float32")
    assert (spec.axes, spec.attention, spec.tp_rank, spec.tp_size, spec.layer_groups) == (
        "BHNC",
        "CPU_ATTN",
        1,
        2,
        (0, 0, 0, 0),
    )


def test_mla_is_one_head_slot_every_rank_holds() -> None:
    spec = vl.vllm_cache_spec(config(16), groups((MLA, L)), L, dict.fromkeys(L, "CPU_MLA"), 1, 2)
    assert (spec.num_heads, spec.head_dim, spec.local_heads, spec.head_start) == (1, 576, 1, 0)


def test_hybrid_groups_are_named_per_layer() -> None:
    kv = groups((SLIDING, [L[0], L[2]]), (FULL, [L[1], L[3]]))
    spec = vl.vllm_cache_spec(config(2), kv, L, dict.fromkeys(L, "CPU_ATTN"), 0, 1)
    assert spec.layer_groups == (0, 1, 0, 1)


def test_state_layers_are_described_apart_and_align_mode_is_refused() -> None:
    """GDN/Mamba groups (``MambaSpec``) are state groups, not attention: ``vllm_cache_spec`` takes the attention
    layers only; vLLM's ``align`` state mode (what prefix caching turns on) is refused at start, naming the
    layers and the way out, and a cache that is neither attention nor state is refused as before."""
    mamba = MambaSpec(block_size=32, shapes=((3, 256),), dtypes=(torch.float32,))
    kv = groups((mamba, [L[0]]), (FULL, [L[1]]))
    assert list(vl.state_groups(kv)) == [0] and vl.has_state_layers(kv) and not vl.has_state_layers(groups((FULL, L)))
    assert vl.vllm_cache_spec(config(2), kv, L[1:2], {}, 0, 1).layer_groups == (1,)
    with pytest.raises(ConfigError, match="recurrent state"):
        vl.vllm_cache_spec(config(2), kv, L[:2], {}, 0, 1)
    align = MambaSpec(block_size=32, shapes=((3, 256),), dtypes=(torch.float32,), mamba_cache_mode="align")
    with pytest.raises(ConfigError) as info:
        vl.state_groups(groups((align, [L[0]]), (FULL, [L[1]])))
    assert L[0] in str(info.value) and "'align'" in str(info.value) and "--no-enable-prefix-caching" in str(info.value)
    with pytest.raises(ConfigError, match="attention KV and recurrent"):
        vl.state_groups(groups((SimpleNamespace(), [L[0]]), (FULL, [L[1]])))


def test_state_bytes_are_the_declared_ones_or_the_spec_shapes_times_their_dtypes() -> None:
    """vLLM before 0.29 declares no ``state_content_size_bytes``: one block's state is then its ``shapes``
    times their ``dtypes``' sizes, packed from the page's start (what vLLM's unpadded page size counts)."""
    mamba = MambaSpec(block_size=32, shapes=((3, 256), (4, 16, 16)), dtypes=(torch.bfloat16, torch.float32))
    assert vl.state_bytes(mamba) == mamba.page_size_bytes == 3 * 256 * 2 + 4 * 16 * 16 * 4
    undeclared = SimpleNamespace(shapes=mamba.shapes, dtypes=mamba.dtypes)
    assert vl.state_bytes(undeclared) == 3 * 256 * 2 + 4 * 16 * 16 * 4
    padded = MambaSpec(block_size=32, shapes=((3, 256),), dtypes=(torch.bfloat16,), page_size_padded=4096)
    assert vl.state_bytes(padded) == 3 * 256 * 2


def test_the_axes_are_those_of_the_shape_vllm_hands() -> None:
    """vLLM's views ``[B, H, N, K|V]``, a layer's own ``[B, 2, N, H, head]`` or ``[2, B, N, H, head]``, MLA's
    ``[B, N, latent]``; a shape of neither, or two of them (two blocks), is refused naming it."""
    kv = dict.fromkeys(L, "FLASH_ATTN")

    def axes(shape: tuple[int, ...], spec: object = FULL, heads: int = 2) -> tuple[str, int]:
        caches = dict.fromkeys(L, torch.empty(shape))
        s = vl.vllm_cache_spec(config(heads), groups((spec, L)), L, kv, 1, 2, caches=caches)
        return s.axes, s.head_dim

    assert axes((7, 1, 32, 128)) == ("BHNC", 128)
    assert axes((7, 2, 32, 1, 64)) == ("BKNHC", 64)
    assert axes((2, 7, 32, 1, 64)) == ("KBNHC", 64)
    assert axes((7, 16, 576), MLA) == ("BNC", 576)
    assert axes((7, 1, 16, 576), MLA) == ("BHNC", 576)
    for bad in ((7, 2, 16, 1, 64), (2, 2, 32, 1, 64), (7, 32, 128)):
        with pytest.raises(BackendError, match=r"shape \(" + ", ".join(map(str, bad))):
            axes(bad)


def test_layers_of_different_geometry_or_attention_are_refused() -> None:
    other = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=128, dtype=torch.float32)
    with pytest.raises(BackendError, match="one geometry"):
        vl.vllm_cache_spec(config(2), groups((FULL, L[:2]), (other, L[2:])), L, dict.fromkeys(L, "X"), 0, 1)
    with pytest.raises(BackendError, match="FLASH_ATTN"):
        vl.vllm_cache_spec(config(2), groups((FULL, L)), L, {**dict.fromkeys(L, "X"), L[3]: "FLASH_ATTN"}, 0, 1)


def test_the_connector_declares_no_sleep_mode() -> None:
    """vLLM 0.33 asks ``supports_sleep_mode``; kvpush answers no (vLLM then refuses sleep mode at start), and
    would refuse to drop its registrations rather than keep stale ones."""
    from kvpush.integrations.vllm.connector import KVPushConnector

    assert KVPushConnector.supports_sleep_mode(None) is False
    c = KVPushConnector.__new__(KVPushConnector)
    for hook in (c.unregister_kv_caches, c.restore_kv_caches):
        with pytest.raises(ConfigError, match="sleep mode"):
            hook()
