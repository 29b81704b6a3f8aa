"""KV-cache layouts: where every byte of every token of every KV head lives (pure).

A layout says where every byte of every token of every KV head lives, so that
P and D can differ in block size, TP degree (head slices) and in-block order
and still agree on which byte goes where. Nothing here touches memory, NIXL or
a device: functions take block ids and return numpy arrays of byte ranges,
which is what makes them testable exhaustively.

Vocabulary:
- *region*: one registered buffer holding ``num_blocks`` blocks of one layer's
  K or V (or a whole layer, if K and V share a block). Region ``i`` of P maps to
  region ``i`` of D, so both sides list regions in the same order.
- *piece*: a (src offset, dst offset, length) triple relative to the bases of a
  region pair; the same pieces apply to every region pair because every region
  has the same shape.
- *descriptor*: a piece made absolute (base address added); one NIXL entry.
"""

from __future__ import annotations

import bisect
import enum
import functools
from dataclasses import dataclass

import msgspec

from kvpush.core.errors import LayoutError
from kvpush.core.recurrent import StateGroup, check_states_compatible


class MemKind(enum.StrEnum):
    """Memory kinds as NIXL names them."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class TokenOrder(enum.StrEnum):
    """Order of tokens and heads inside one block.

    NHD: ``[block_size, heads, head_dim]`` (token-major; FlashAttention style).
    HND: ``[heads, block_size, head_dim]`` (head-major; FlashInfer/CPU style).
    """

    NHD = "NHD"
    HND = "HND"
    BLOCK = "BLOCK"
    """Head-major with opaque heads: a block is ``local_heads`` chunks of
    ``block_size * head_bytes``, one per head, and the attention kernel packs
    each chunk its own way (vLLM's CPU backend keeps a head's K rows, then
    its V rows, in its own tiling), so only whole (block, head) chunks can be
    copied: both sides must share the block size; head slices may differ."""


@dataclass(frozen=True)
class CacheSpec:
    """What the engine knows about its KV cache; the backend reads the rest from the tensors.

    ``axes`` names each tensor's logical dimensions, outermost first: ``B``
    blocks, ``H`` KV heads of this rank, ``N`` tokens of a block, ``C`` one
    head's content for one token (``head_dim`` elements), ``K`` a leading
    K/V axis of size 2 (two regions per layer); without ``H`` a tensor holds
    one head. vLLM (0.29 and later) hands every attention backend's cache as
    ``BHNC`` views whose strides say the physical order; earlier vLLM hands
    each backend's own shape (``BKNHC``, ``KBNHC``, CPU's ``BHNC``, MLA's
    ``BNC``), NxDI ``BNHC``. ``num_heads`` counts the model's KV head slots (1 for MLA's
    latent, which every TP rank holds whole). ``attention`` is the engine's
    attention backend name (``CPU_ATTN``, ``FLASH_ATTN``, ``CPU_MLA``...):
    some kernels pack a head's tokens their own way, which strides cannot
    show. ``layer_groups`` gives the KV-cache group of each tensor, in
    order (empty: all in group 0). ``tensors_per_layer``: 2 where K and V
    are separate tensors of one layer (NxDI), listed K then V.
    """

    block_size: int
    num_heads: int
    head_dim: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    axes: str = "KBNHC"
    attention: str = ""
    layer_groups: tuple[int, ...] = ()
    tensors_per_layer: int = 1

    @property
    def local_heads(self) -> int:
        """KV heads one rank holds (vLLM replicates a head on several ranks when there are more ranks)."""
        return max(1, self.num_heads // self.tp_size)

    @property
    def head_start(self) -> int:
        """First model head this rank holds, as vLLM shards KV heads (``QKVParallelLinear``)."""
        return self.tp_rank * self.num_heads // self.tp_size


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One contiguous buffer of blocks.

    ``base`` is the address of block 0 and ``size`` the bytes NIXL registers
    from ``base``; ``size >= num_blocks * block_stride`` is checked by
    ``KVLayout.validate``. ``layer`` is the model layer whose KV the region
    holds (K and V of one layer are two regions of the same layer): the
    forward writes the KV layer by layer, so "layer L is written" is how a
    layer-wise push learns which regions it may send.
    """

    base: int
    size: int
    device_id: int = 0
    group: int = 0
    layer: int = 0


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, dict=True):
    """Shape of one rank's KV cache: every region shares block geometry.

    ``head_bytes`` is one head of one token (``head_dim * dtype size``); the
    rank holds heads ``[head_start, head_start + local_heads)`` of the model's
    ``num_heads`` KV heads. ``block_stride`` is the distance between two
    consecutive blocks in a region, at least ``block_bytes`` (it is larger when
    K and V of a block are interleaved in one tensor).

    What is read off the regions (their groups, ``hybrid``, ``token_group``) is
    computed once per layout and kept (``dict=True`` gives the frozen struct a
    ``__dict__`` for those ``cached_property`` values; it is not encoded): a
    registration's checks and plan ask for them several times on each side, and
    walking a hundred region objects after the host copies have evicted them
    from the caches costs tens of microseconds each time.
    """

    block_size: int
    num_blocks: int
    block_stride: int
    head_bytes: int
    num_heads: int
    head_start: int
    local_heads: int
    order: TokenOrder
    mem: MemKind
    dtype: str
    regions: tuple[Region, ...]
    direct: bool = True
    """Whether NIXL may read and write the regions in place; False (a backend that cannot register its KV
    memory) means every transfer to or from this rank goes through staging. Peers learn it from the layout."""
    states: tuple[StateGroup, ...] = ()
    """KV-cache groups of recurrent-state layers (Mamba, GDN): their regions hold one state per block
    (``kvpush.core.recurrent``), not ``block_size`` tokens; the geometry above is the attention groups'."""

    @functools.cached_property
    def region_groups(self) -> tuple[int, ...]:
        """Each region's KV-cache group, in region order."""
        return tuple(r.group for r in self.regions)

    @functools.cached_property
    def num_groups(self) -> int:
        """KV-cache groups the regions hold (groups are numbered from 0)."""
        return 1 + max(self.region_groups)

    @functools.cached_property
    def hybrid(self) -> bool:
        """Several KV-cache groups, or recurrent state: such a push is planned group by group, direct, never staged."""
        return len(set(self.region_groups)) > 1 or bool(self.states)

    @functools.cached_property
    def compatible_with(self) -> dict[int, KVLayout]:
        """Layouts that passed ``check_compatible`` as D's against this one as P's, by ``id`` (the entry holds
        the layout, so its id is not reused while it is here): both are immutable, so the same pair passes
        again, and each registration's checks and plan on either side ask for its peer's pair again."""
        return {}

    @functools.cached_property
    def token_group(self) -> int:
        """The first KV-cache group holding per-token KV (0 unless state groups come first)."""
        held = {s.group for s in self.states}
        return next((g for g in self.region_groups if g not in held), 0)

    def state_of(self, group: int) -> StateGroup | None:
        """The state group ``group``, or None when it holds attention KV."""
        return next((s for s in self.states if s.group == group), None)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's heads held by this rank."""
        return self.local_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (excluding stride padding)."""
        return self.block_size * self.token_bytes

    @property
    def head_end(self) -> int:
        return self.head_start + self.local_heads

    @property
    def num_layers(self) -> int:
        """Model layers the regions hold (regions are listed layer by layer, from layer 0)."""
        return self.regions[-1].layer + 1 if self.regions else 0

    def regions_through(self, layer: int) -> int:
        """How many leading regions hold layers ``0..layer``: what "layer ``layer`` is written" makes ready."""
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer} outside the layout's {self.num_layers} layers")
        return bisect.bisect_right([r.layer for r in self.regions], layer)

    def validate(self) -> KVLayout:
        """Raise ``LayoutError`` naming the first inconsistency; return self."""
        checks = [
            (self.block_size > 0, f"block_size must be > 0, got {self.block_size}"),
            (self.num_blocks > 0, f"num_blocks must be > 0, got {self.num_blocks}"),
            (self.head_bytes > 0, f"head_bytes must be > 0, got {self.head_bytes}"),
            (self.local_heads > 0, f"local_heads must be > 0, got {self.local_heads}"),
            (
                self.head_start >= 0 and self.head_end <= self.num_heads,
                f"heads [{self.head_start}, {self.head_end}) outside model's {self.num_heads}",
            ),
            (
                self.block_stride >= self.block_bytes,
                f"block_stride {self.block_stride} < block bytes {self.block_bytes}",
            ),
            (len(self.regions) > 0, "layout has no regions"),
            (self.order in {o.value for o in TokenOrder}, f"order must be NHD or HND, got {self.order!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise LayoutError(msg)
        need = (self.num_blocks - 1) * self.block_stride + self.block_bytes
        state_need = {s.group: (self.num_blocks - 1) * s.validate().block_stride + s.nbytes for s in self.states}
        for i, r in enumerate(self.regions):
            prev = self.regions[i - 1].layer if i else -1
            if r.layer not in ((prev, prev + 1) if i else (0,)):
                raise LayoutError(
                    f"region {i} holds layer {r.layer} after layer {prev}: regions must list layers in order from 0"
                )
            want = state_need.get(r.group, need)
            if r.size < want:
                raise LayoutError(f"region {i} has {r.size} bytes, {want} needed for {self.num_blocks} blocks")
            if r.base <= 0:
                raise LayoutError(f"region {i} has invalid base address {r.base}")
        return self


COMPATIBLE_KEPT = 64
"""The most peer layouts one layout remembers as compatible (``KVLayout.compatible_with``); past it, it
forgets them all."""


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise ``LayoutError`` naming the first difference that makes a push impossible.

    A pair that passed is remembered on ``src`` (``KVLayout.compatible_with``) and not checked again.
    """
    seen = src.compatible_with
    if seen.get(id(dst)) is dst:
        return
    diffs = [
        ("dtype", src.dtype, dst.dtype),
        ("head_bytes (head_dim x dtype size)", src.head_bytes, dst.head_bytes),
        ("num_heads (model KV heads)", src.num_heads, dst.num_heads),
        ("number of regions (layers x K/V)", len(src.regions), len(dst.regions)),
    ]
    for what, a, b in diffs:
        if a != b:
            raise LayoutError(f"incompatible KV layouts: {what} differs: P has {a}, D has {b}")
    if src.region_groups != dst.region_groups:
        raise LayoutError("incompatible KV layouts: region groups differ between P and D")
    check_states_compatible(src.states, dst.states, (src.head_start, src.head_end), (dst.head_start, dst.head_end))
    if max(src.head_start, dst.head_start) >= min(src.head_end, dst.head_end):
        raise LayoutError(
            f"P heads [{src.head_start}, {src.head_end}) and D heads "
            f"[{dst.head_start}, {dst.head_end}) do not overlap: this P rank does not write to this D rank"
        )
    if len(seen) >= COMPATIBLE_KEPT:
        seen.clear()
    seen[id(dst)] = dst


def heads_overlap(src: KVLayout, dst: KVLayout) -> tuple[int, int]:
    """Model head range both ranks hold (empty when ``lo >= hi``)."""
    return max(src.head_start, dst.head_start), min(src.head_end, dst.head_end)
