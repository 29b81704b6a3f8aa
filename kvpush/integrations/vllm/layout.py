"""What the connector tells the backend about vLLM's KV cache, read from vLLM's own declarations.

The backend reads the tensors (``Backend.describe``: shapes and strides); this
module supplies what tensors do not say, from vLLM's KV-cache config: the
block size, the model's KV head slots, one head's content per token, the
dtype, the attention backend of each layer and each layer's KV-cache group.
Which of vLLM's allocations the caches come from is told by which declared
shape the tensors have (``cache_axes``), never by a version number: vLLM
0.29 and later hand every cache as ``[blocks, heads, tokens, K|V]`` views
(``axes="BHNC"``); earlier vLLM allocates each layer in its attention
backend's ``get_kv_cache_shape``: CPU attention ``[blocks, heads, tokens,
K|V]`` too, FlashAttention, FlashInfer and Triton ``[blocks, 2, tokens,
heads, head]`` (``BKNHC``, NHD or HND strides), ROCm's ``[2, blocks, ...]``
(``KBNHC``) and MLA ``[blocks, tokens, latent]`` (``BNC``: one head). Under
the Neuron platform the Neuron backend's own hooks
(``kvpush_neuron.vllm_neuron``) say the layout and the backend options
instead. Recurrent-state layers (Mamba, GDN: vLLM's ``MambaSpec`` groups)
are described here as state regions (``state_layout``); what kvpush cannot
push is refused at start, naming the layers. Objects are duck-typed, so this
runs without a vLLM engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from msgspec.structs import replace

from kvpush.backends.base import CacheSpec
from kvpush.core.errors import BackendError, ConfigError
from kvpush.core.layout import KVLayout, Region
from kvpush.core.recurrent import StateGroup

VLLM_AXES = "BHNC"
"""vLLM 0.29 and later: each layer's cache is a ``[blocks, heads, tokens, content]`` view (vLLM RFC #42082); the
axes assumed when the connector gives no tensors."""

CACHE_AXES = {
    "BHNC": "[blocks, heads, tokens, K|V] (vLLM's KV-cache views; CPU attention's own shape)",
    "BKNHC": "[blocks, 2, tokens, heads, head] (FlashAttention, FlashInfer, Triton attention; NHD or HND strides)",
    "KBNHC": "[2, blocks, tokens, heads, head] (attention backends that put K/V outermost)",
    "BNC": "[blocks, tokens, latent] (MLA: one latent row a token)",
}
"""The per-layer cache shapes vLLM's allocations give the connector, by ``CacheSpec.axes``."""


def check_parallelism(parallel_config: Any) -> None:
    """Refuse pipeline parallelism at start: each stage holds only its layers, and kvpush pushes whole models."""
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ConfigError(
            f"KVPushConnector does not support pipeline parallelism (pipeline_parallel_size={pp}): a stage holds "
            "only its own layers, and kvpush pushes and counts a whole model's layers per TP rank; use tensor "
            "parallelism (P and D may differ in TP) or data parallelism"
        )


def dp_port_offset(parallel_config: Any, tp_size: int) -> int:
    """Side-channel port offset of this engine among the data-parallel engines of one host.

    vLLM's NIXL connector offsets ``VLLM_NIXL_SIDE_CHANNEL_PORT`` by the DP
    index (one listener per engine); kvpush listens once per TP rank
    (``side_channel_port + tp_rank``), so engine ``k`` takes the ports from
    ``side_channel_port + k * tp_size``.
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0) * tp_size


def layer_index(name: str) -> int:
    """The model layer a cache belongs to, from vLLM's layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if not nums:
        raise ConfigError(f"KV cache layer name {name!r} holds no layer index")
    return nums[0]


def in_model_order(kv_caches: Mapping[str, Any]) -> dict[str, Any]:
    """``kv_caches`` sorted by model layer: vLLM groups them by KV-cache tensor, P and D must agree on layers."""
    return dict(sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0])))


def _spec_kind(spec: Any) -> str:
    return type(spec).__name__


def _group_of_layers(kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
    out: dict[str, tuple[int, Any]] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            out[name] = (g, group.kv_cache_spec)
    return out


def is_state_spec(spec: Any) -> bool:
    """Whether a KV-cache group's spec is vLLM's ``MambaSpec`` (Mamba, GDN and other recurrent-state layers)."""
    return hasattr(spec, "shapes") and hasattr(spec, "mamba_cache_mode")


def has_state_layers(kv_cache_config: Any) -> bool:
    """Whether any KV-cache group holds recurrent state: P and D then back off one prompt token."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return any(is_state_spec(g.kv_cache_spec) for g in groups)


def state_groups(kv_cache_config: Any) -> dict[int, Any]:
    """The KV-cache groups of recurrent-state layers (index -> spec), refusing what kvpush cannot push.

    Refused at start, naming the layers: caches that are neither attention
    nor ``MambaSpec``, and vLLM's ``align`` state mode (prefix caching of
    state, which keeps a request's state in a block that moves with the
    token count; push needs one running-state block per request).
    """
    out: dict[int, Any] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = list(group.layer_names)[:4]
        if is_state_spec(spec):
            if spec.mamba_cache_mode != "none":
                raise ConfigError(
                    f"KVPushConnector pushes the state of layers {names} ({_spec_kind(spec)}, "
                    f"{getattr(spec, 'mamba_type', '?')}) only with mamba_cache_mode 'none' (one running-state "
                    f"block per request); this server runs {spec.mamba_cache_mode!r}, which prefix caching turns "
                    "on: start P and D with --no-enable-prefix-caching (or --mamba-cache-mode none)"
                )
            out[g] = spec
        elif not hasattr(spec, "num_kv_heads"):
            raise ConfigError(
                f"KVPushConnector cannot move the cache of layers {names} ({_spec_kind(spec)}): it pushes "
                "attention KV and recurrent (Mamba, GDN) state only; serve this model without kvpush"
            )
    return out


def vllm_cache_spec(
    vllm_config: Any,
    kv_cache_config: Any,
    layer_names: list[str],
    attention: Mapping[str, str],
    rank: int,
    tp: int,
    *,
    caches: Mapping[str, Any] | None = None,
) -> CacheSpec:
    """The ``CacheSpec`` of vLLM's caches ``layer_names`` (in model order), from its KV-cache groups.

    ``attention`` maps each layer to its attention backend's name. Every
    layer must share one geometry (block size, heads, content, dtype) and one
    attention backend: regions of one layout share a piece list. ``caches``
    (layer -> tensor, as vLLM hands them) says which allocation they come
    from (``cache_axes``); without it the caches are taken as vLLM's
    ``[blocks, heads, tokens, K|V]`` views.
    """
    groups = _group_of_layers(kv_cache_config)
    missing = [n for n in layer_names if n not in groups]
    if missing:
        raise ConfigError(f"KV cache layers {missing[:4]} are in no KV-cache group of vLLM's config")
    state = [n for n in layer_names if is_state_spec(groups[n][1])]
    if state:
        raise ConfigError(f"layers {state[:4]} hold recurrent state, not attention KV: describe them with_states")
    facts = {_facts(vllm_config, groups[n][1]) for n in layer_names}
    names = {attention.get(n, "") for n in layer_names}
    if len(facts) != 1 or len(names) != 1:
        raise BackendError(
            f"kvpush needs one geometry and one attention backend for every layer; this model's layers have "
            f"{sorted(facts)} (block size, KV heads, K|V content, head size, dtype) and attention backends "
            f"{sorted(names)}"
        )
    block_size, heads, content, head_size, dtype = facts.pop()
    name = names.pop()
    axes = VLLM_AXES
    if caches is not None:
        local = max(1, heads // tp)
        found = {
            cache_axes(n, caches[n], name, block_size, local, content, head_size) for n in layer_names if n in caches
        }
        if len(found) > 1:
            raise BackendError(f"kvpush needs one cache shape for every layer; this model's caches have {found}")
        if found:
            axes, content = found.pop()
    return CacheSpec(
        block_size,
        heads,
        content,
        dtype,
        rank,
        tp,
        axes=axes,
        attention=name,
        layer_groups=tuple(groups[n][0] for n in layer_names),
    )


def cache_axes(
    name: str, cache: Any, attention: str, block_size: int, local_heads: int, content: int, head_size: int
) -> tuple[str, int]:
    """``(axes, content per head and token)`` of one layer's cache: which of ``CACHE_AXES`` its shape is.

    The shape is matched against what vLLM declared (block size, this rank's
    heads, K|V content, head size); a cache matching none, or two (K/V and
    blocks both of size 2), is refused naming its shape, strides and
    attention backend: guessing would move the wrong bytes.
    """
    shape = tuple(int(s) for s in getattr(cache, "shape", ()))
    bs, h, d = block_size, local_heads, head_size
    found = []
    if len(shape) == 4 and shape[1:] == (h, bs, content):
        found.append(("BHNC", content))
    if len(shape) == 5 and shape[1] == 2 and shape[2:] == (bs, h, d) and content == 2 * d:
        found.append(("BKNHC", d))
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d) and content == 2 * d:
        found.append(("KBNHC", d))
    if len(shape) == 3 and h == 1 and content == d and shape[1:] == (bs, d):  # a latent: no V beside it
        found.append(("BNC", content))
    if len(found) == 1:
        return found[0]
    stride = tuple(cache.stride()) if hasattr(cache, "stride") else ()
    what = "matches several of" if found else "is none of"
    raise BackendError(
        f"kvpush cannot move the KV cache of layer {name}: shape {shape}, strides {stride}, attention backend "
        f"{attention or 'unknown'!r} {what} the shapes it knows for block size {bs}, {h} local heads, head size "
        f"{d}, K|V content {content}: " + "; ".join(f"{a} {w}" for a, w in CACHE_AXES.items())
    )


def _facts(vllm_config: Any, spec: Any) -> tuple[int, int, int, int, str]:
    """(block size, model KV head slots, K|V content of one head and token, head size, dtype) of a group's spec.

    MLA's content is its latent (``head_size``). Otherwise it is K then V:
    ``head_size + head_size_v``, or twice ``head_size`` for specs that
    declare no ``head_size_v`` (K and V of one size).
    """
    if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
        raise BackendError(
            f"{_spec_kind(spec)} packs its cache ({spec!r}); kvpush moves plain per-head, per-token content only"
        )
    mla = "MLA" in _spec_kind(spec)
    # MLA's latent is one head slot every TP rank holds whole; otherwise the model's KV heads, sharded by TP.
    heads = 1 if mla else int(vllm_config.model_config.get_total_num_kv_heads())
    head = int(spec.head_size)
    head_v = getattr(spec, "head_size_v", None)
    content = head if mla else head + int(head if head_v is None else head_v)
    dtype = str(spec.dtype).removeprefix("torch.")
    return int(spec.block_size), heads, content, head, dtype


def describe_error(exc: Exception, kv_caches: Mapping[str, Any], spec: CacheSpec, supported: list[str]) -> BackendError:
    """The error a cache the backend refused gets at start: shape, strides, attention backend, what is supported."""
    name, first = next(iter(kv_caches.items()))
    shape = tuple(getattr(first, "shape", ()))
    stride = tuple(first.stride()) if hasattr(first, "stride") else ()
    return BackendError(
        f"kvpush cannot move this KV cache: {exc}. First layer {name}: shape {shape}, strides {stride}, "
        f"dtype {spec.dtype}, attention backend {spec.attention or 'unknown'!r}. Supported: "
        + ("; ".join(supported) or "see the backend's documentation")
    )


def state_tensor(cache: Any) -> Any:
    """The tensor whose first byte is block 0's state: vLLM's raw ``[B, 1, 1, C]`` page view, or the first of
    a layer's state tensors (conv, ssm: what earlier vLLM hands, and the bound views), which starts at the page."""
    return cache[0] if isinstance(cache, (list, tuple)) else cache


def state_bytes(spec: Any) -> int:
    """Bytes of one block's state: ``state_content_size_bytes`` where vLLM declares it, else the sum of its
    ``shapes`` times their ``dtypes``' sizes (vLLM places the states one after another from the page's start)."""
    declared = getattr(spec, "state_content_size_bytes", None)
    if declared is not None:
        return int(declared)
    return sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        raise ConfigError(f"cannot tell the size of state dtype {dtype!r}")
    return int(size)


def with_states(
    layout: KVLayout, names: list[str], attention_names: list[str], caches: Mapping[str, Any], kv_cache_config: Any
) -> KVLayout:
    """``layout`` (the backend's description of the attention caches ``attention_names``) with the state
    regions of the other caches of ``names`` (model order), every region numbered by its model layer.

    A state layer's region starts at its block 0's page: block ``b``'s state is
    ``state_bytes`` long, at ``b`` times the cache's block stride (read from
    the tensor, or the first of the layer's state tensors). Raises ``ConfigError`` when the
    backend described nothing to place them beside.
    """
    specs = state_groups(kv_cache_config)
    if not specs:
        return layout
    group_of = _group_of_layers(kv_cache_config)
    model_index = {n: i for i, n in enumerate(names)}
    device = layout.regions[0].device_id if layout.regions else 0
    regions = [replace(r, layer=model_index[attention_names[r.layer]]) for r in layout.regions]
    states: dict[int, StateGroup] = {}
    for n in names:
        g, spec = group_of[n]
        if g not in specs:
            continue
        t = state_tensor(caches[n])
        stride = int(t.stride(0)) * int(t.element_size())
        nbytes = state_bytes(spec)
        group = StateGroup(g, stride, nbytes, int(getattr(spec, "num_speculative_blocks", 0) or 0)).validate()
        if states.setdefault(g, group) != group:
            raise ConfigError(f"state layers of KV-cache group {g} differ in layout: {states[g]} and {group} ({n})")
        size = (layout.num_blocks - 1) * stride + nbytes
        regions.append(Region(int(t.data_ptr()), size, device, g, model_index[n]))
    regions.sort(key=lambda r: r.layer)
    return replace(layout, regions=tuple(regions), states=tuple(states[g] for g in sorted(states))).validate()
