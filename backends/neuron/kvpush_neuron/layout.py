"""The KV-cache layouts found on Neuron, expressed as kvpush ``CacheSpec``s.

Three layouts occur, and all three are exact ``KVLayout``s, so the core's
``map_pieces`` maps any of them to any other (block sizes, head slices and
in-block order may all differ between P and D):

1. vLLM-Neuron's paged cache, one tensor per layer, ``[2, num_blocks,
   kv_heads, block_size, head_dim]`` (K/V leading, HND blocks): ``paged_spec``.
   vLLM-Neuron's model runner allocates each layer's bytes as one tensor,
   views it with that shape and hands exactly that tensor to the KV
   connector; the model reads ``[0]`` as K and ``[1]`` as V.
2. NxDI block KV layout (``is_block_kv_layout``, used with prefix caching or
   chunked prefill): separate K and V tensors per layer, ``[num_blocks,
   block_size, kv_heads, head_dim]``: ``nxdi_block_spec``.
3. NxDI per-sequence cache (the default): separate K and V tensors per layer,
   ``[batch_slots, kv_heads, max_seq_len, head_dim]`` (BHSD): ``nxdi_bhsd_spec``.

Why BHSD maps with one *block per sequence slot*: inside a slot, head ``h``
starts ``max_seq_len * head_dim`` elements after head ``h-1``. Cutting the slot
into ``max_seq_len / block_size`` smaller blocks would need a block whose heads
are ``max_seq_len`` tokens apart, while ``KVLayout`` (like every paged kernel)
keeps a block's ``[heads, block_size, head_dim]`` contiguous with one block
stride. A slot *is* such a block when ``block_size == max_seq_len`` (HND order,
block stride ``kv_heads * max_seq_len * head_dim * itemsize``), which is also
what the older NxDI-based vLLM-Neuron plugin configured when the block layout
was off (``block_size = max_model_len``). So a BHSD request is "block id = its slot";
the mapping onto another side's smaller blocks is the core's ordinary
different-block-size mapping, which moves only tokens ``[start, num_tokens)``.
``virtual_blocks``/``slot_of`` translate for callers that count a slot in
smaller virtual blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpush.backends.base import CacheSpec
from kvpush.core.errors import LayoutError


def paged_spec(
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_groups: tuple[int, ...] = (),
) -> CacheSpec:
    """vLLM-Neuron's paged cache: ``[2, num_blocks, kv_heads, block_size, head_dim]`` per layer.

    K/V is the outermost axis, so each layer is two regions (K, then V) of
    ``num_blocks`` dense head-major blocks; ``num_heads`` counts the model's
    KV heads (each rank holds ``max(1, num_heads // tp_size)``).
    ``layer_groups`` gives each layer's KV-cache group when vLLM runs several
    (sliding-window layers beside full-attention ones).
    """
    return CacheSpec(block_size, num_heads, head_dim, dtype, tp_rank, tp_size, axes="KBHNC", layer_groups=layer_groups)


def nxdi_block_spec(
    block_size: int, num_heads: int, head_dim: int, dtype: str, tp_rank: int = 0, tp_size: int = 1
) -> CacheSpec:
    """NxDI block KV layout: K and V tensors ``[num_blocks, block_size, kv_heads, head_dim]``."""
    return CacheSpec(block_size, num_heads, head_dim, dtype, tp_rank, tp_size, axes="BNHC", tensors_per_layer=2)


def nxdi_bhsd_spec(
    max_seq_len: int, num_heads: int, head_dim: int, dtype: str, tp_rank: int = 0, tp_size: int = 1
) -> CacheSpec:
    """NxDI per-sequence cache: K and V tensors ``[slots, kv_heads, max_seq_len, head_dim]``, one block per slot."""
    return CacheSpec(max_seq_len, num_heads, head_dim, dtype, tp_rank, tp_size, axes="BHNC", tensors_per_layer=2)


def nxdi_kv_caches(past_key_values: Sequence[Any], prefix: str = "layers") -> dict[str, Any]:
    """Name NxDI's flat ``[k0, v0, k1, v1, ...]`` cache list in the order ``describe`` needs.

    kvpush pairs region ``i`` of P with region ``i`` of D, so both sides must
    list layers, and K before V, identically; NxDI's KV cache manager keeps
    its caches in exactly this interleaved order.
    """
    if len(past_key_values) % 2:
        raise LayoutError(f"expected K and V per layer, got an odd number ({len(past_key_values)}) of caches")
    out: dict[str, Any] = {}
    for i, t in enumerate(past_key_values):
        out[f"{prefix}.{i // 2}.{'kv'[i % 2]}"] = t
    return out


def virtual_blocks(slot: int, num_tokens: int, max_seq_len: int, block_size: int) -> list[int]:
    """Ids of the ``block_size``-token virtual blocks covering a slot's first ``num_tokens`` tokens.

    Virtual block ``slot * (max_seq_len // block_size) + j`` holds tokens
    ``[j * block_size, (j + 1) * block_size)`` of the slot.
    """
    if max_seq_len % block_size:
        raise LayoutError(f"max_seq_len {max_seq_len} is not a multiple of block_size {block_size}")
    if not 0 <= num_tokens <= max_seq_len:
        raise LayoutError(f"{num_tokens} tokens do not fit a slot of {max_seq_len}")
    per = max_seq_len // block_size
    return [slot * per + j for j in range(-(-num_tokens // block_size))]


def slot_of(block_ids: Sequence[int], max_seq_len: int, block_size: int) -> int:
    """Inverse of ``virtual_blocks``: the slot, checking the ids are its leading blocks in order."""
    if max_seq_len % block_size:
        raise LayoutError(f"max_seq_len {max_seq_len} is not a multiple of block_size {block_size}")
    per = max_seq_len // block_size
    if not block_ids:
        raise LayoutError("no block ids")
    slot = block_ids[0] // per
    want = list(range(slot * per, slot * per + len(block_ids)))
    if list(block_ids) != want or len(block_ids) > per:
        raise LayoutError(
            f"block ids {list(block_ids)[:8]} are not the leading virtual blocks of one slot "
            f"(slot {slot} would be {want[:8]}); a BHSD slot cannot hold scattered blocks"
        )
    return slot
