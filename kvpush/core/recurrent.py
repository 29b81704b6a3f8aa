"""Recurrent state (Mamba, GDN and other state-space or linear-attention layers): the pure rules of its push.

Attention KV is per token, so D can take any prefix of it; a recurrent layer
keeps one state per request, the fold of every token computed so far. vLLM's
D recomputes the last prompt token itself, so it needs the state after
``n - 1`` tokens while P, computing the whole prompt, ends with the state
after ``n``. The rule (vLLM's own NIXL connector follows the same one): when
the model has state layers, P drops the last prompt token of a request it
prefills for a remote D (its state is then the one after ``n - 1`` tokens,
and its one answer token, which routers discard, comes from ``n - 1``
tokens), and D loads ``n - 1`` tokens and computes the last one. Every
attention group then carries ``n - 1`` tokens too; models without state
layers keep a backoff of 0 and every rule here is the identity.

A state group's blocks are not ``block_size`` tokens: each request holds its
running state in one block of the group (the last of its list, before any
speculative scratch blocks), and that block's state bytes go to D's.
Functions take and return plain values, so they are tested exhaustively.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError

HOLE = -1
"""A block id a side no longer holds (``kvpush.core.plan.HOLE``)."""


class StateGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV-cache group of recurrent-state layers, as one rank holds it.

    Each of the group's regions keeps block ``b``'s state in ``nbytes``
    bytes from ``b * block_stride`` (vLLM packs a layer's states, e.g. conv
    then ssm, at the start of the block's page; the page may be padded to
    the attention page size). ``spec_blocks``: trailing speculative scratch
    blocks of a request's list, never the running state.
    """

    group: int
    block_stride: int
    nbytes: int
    spec_blocks: int = 0

    def validate(self) -> StateGroup:
        """Raise ``LayoutError`` naming the first bad field; return self."""
        if self.group < 0 or self.nbytes <= 0 or self.spec_blocks < 0:
            raise LayoutError(
                f"state group {self.group}: group must be >= 0, nbytes > 0 and spec_blocks >= 0 "
                f"(got nbytes={self.nbytes}, spec_blocks={self.spec_blocks})"
            )
        if self.block_stride < self.nbytes:
            raise LayoutError(f"state group {self.group}: block_stride {self.block_stride} < state bytes {self.nbytes}")
        return self


def prefill_backoff(has_state_layers: bool) -> int:
    """Trailing prompt tokens P does not compute and D computes itself: 1 with state layers, else 0."""
    return 1 if has_state_layers else 0


def loaded_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """Prompt tokens D loads from P (D's side of the rule).

    A prompt no longer than the backoff loads nothing: P cannot stop short of
    it, so its state would be one token ahead; D computes such a prompt
    itself and tells P to drop its prefill.
    """
    if num_prompt_tokens < 0 or backoff < 0:
        raise ValueError(f"num_prompt_tokens ({num_prompt_tokens}) and backoff ({backoff}) must be >= 0")
    if backoff == 0:
        return num_prompt_tokens
    return num_prompt_tokens - backoff if num_prompt_tokens > backoff else 0


def dropped_tokens(num_prompt_tokens: int, backoff: int, already_dropped: bool) -> int:
    """Trailing prompt tokens P removes from a request it prefills for a remote D (P's side of the rule).

    Once per request (a preempted request comes back already shortened),
    and never the whole prompt: a prompt no longer than the backoff is
    computed whole, and D, which loads none of it, cancels the transfer.
    P's ``n - dropped`` always equals D's ``loaded_tokens`` when D loads any.
    """
    if already_dropped or backoff == 0 or num_prompt_tokens <= backoff:
        return 0
    return backoff


def state_block(block_ids: tuple[int, ...] | list[int], spec_blocks: int = 0) -> int:
    """The block holding a request's running state: the last of its list, its speculative scratch blocks aside.

    Raises ``LayoutError`` when the list is empty or that block is one the side no longer holds.
    """
    if not block_ids:
        raise LayoutError("a state group's block list is empty: the request holds no state block")
    scratch = min(spec_blocks, len(block_ids) - 1)
    block = int(block_ids[len(block_ids) - 1 - scratch])
    if block == HOLE:
        raise LayoutError("a state group's running-state block is a placeholder: the side holds no state")
    return block


def state_pieces(
    src: StateGroup,
    dst: StateGroup,
    src_blocks: tuple[int, ...] | list[int],
    dst_blocks: tuple[int, ...] | list[int],
    src_num_blocks: int,
    dst_num_blocks: int,
) -> np.ndarray:
    """The one piece ``(src offset, dst offset, length)`` moving a request's state from P's block to D's.

    Offsets are relative to each region's base, as ``kvpush.core.pieces.map_pieces``
    gives them; the same piece serves every region of the group.
    """
    check_state_compatible(src, dst)
    sb, db = state_block(src_blocks, src.spec_blocks), state_block(dst_blocks, dst.spec_blocks)
    for side, b, n in (("P", sb, src_num_blocks), ("D", db, dst_num_blocks)):
        if not 0 <= b < n:
            raise LayoutError(f"state group {src.group}: {side}'s state block {b} outside [0, {n})")
    return np.array([[sb * src.block_stride, db * dst.block_stride, src.nbytes]], dtype=np.int64)


def check_state_compatible(src: StateGroup, dst: StateGroup) -> None:
    """Raise ``LayoutError`` unless P's and D's state groups hold the same state (group, bytes per request)."""
    if src.group != dst.group:
        raise LayoutError(f"incompatible state groups: P's is group {src.group}, D's group {dst.group}")
    if src.nbytes != dst.nbytes:
        raise LayoutError(
            f"incompatible state in KV-cache group {src.group}: P holds {src.nbytes} bytes per request, D "
            f"{dst.nbytes} (a different model, state dtype or TP size: a state is sharded by TP rank)"
        )


def check_states_compatible(
    src: tuple[StateGroup, ...], dst: tuple[StateGroup, ...], src_heads: tuple[int, int], dst_heads: tuple[int, int]
) -> None:
    """Raise ``LayoutError`` unless P and D have the same state groups and, when they have any, one TP slice.

    A recurrent state is sharded over TP ranks by its own heads, which the
    attention head slices do not show: P rank ``r`` can fill D rank ``r``'s
    state only when both run the same TP size, i.e. hold the same KV heads.
    """
    if [s.group for s in src] != [s.group for s in dst]:
        raise LayoutError(
            f"incompatible KV layouts: state groups differ: P has {[s.group for s in src]}, D {[s.group for s in dst]}"
        )
    for a, b in zip(src, dst, strict=True):
        check_state_compatible(a, b)
    if src and src_heads != dst_heads:
        raise LayoutError(
            f"a model with recurrent-state layers needs the same TP size on P and D (its state is sharded by TP "
            f"rank): P rank holds KV heads {list(src_heads)}, D rank {list(dst_heads)}"
        )
