"""Recurrent-state (Mamba, GDN) rules without NIXL: the backoff, the state block, the state piece.

The backoff is checked exhaustively over prompt lengths and as a state
machine over the scheduler's hooks (P's arrivals, repeated ones, D's
matched tokens): P's computed prompt and D's loaded prompt always agree,
and a model without state layers is untouched. The state piece is checked
against a reference that copies a page by numpy indexing of the block
arrays, never ``kvpush.core.recurrent``'s offsets.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpush.config import Config
from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.plan import build_plan, group_tokens, part_descriptors
from kvpush.core.recurrent import (
    HOLE,
    StateGroup,
    check_states_compatible,
    dropped_tokens,
    loaded_tokens,
    prefill_backoff,
    state_block,
    state_pieces,
)
from kvpush.integrations.vllm.scheduler_side import TRUNCATED, SchedulerSide


def test_the_backoff_agrees_on_both_sides_for_every_prompt_length() -> None:
    """P computes ``n - dropped``, D loads ``loaded``: equal whenever D loads anything; D loads nothing only
    for a prompt no longer than the backoff (then P computed it whole and D's cancel frees it); a model
    without state layers is the identity."""
    assert (prefill_backoff(False), prefill_backoff(True)) == (0, 1)
    for backoff in (0, 1, 2):
        for n in range(0, 600):
            drop, load = dropped_tokens(n, backoff, False), loaded_tokens(n, backoff)
            assert dropped_tokens(n - drop, backoff, True) == 0  # once per request
            if backoff == 0:
                assert (drop, load) == (0, n)
            elif n > backoff:
                assert (drop, load) == (backoff, n - backoff) and n - drop == load
            else:
                assert (drop, load) == (0, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        loaded_tokens(-1, 1)


class BackoffMachine(RuleBasedStateMachine):
    """P's and D's scheduler halves of one model over any sequence of arrivals (vLLM may hand a preempted
    request back, its params dict kept) and D's lookups: P's prompt and D's loaded tokens always agree."""

    @initialize(backoff=st.sampled_from([0, 1]))
    def start(self, backoff: int) -> None:
        self.backoff = backoff
        self.p, self.d = SchedulerSide(backoff=backoff), SchedulerSide(backoff=backoff)
        self.reqs: dict[str, tuple[dict, int, int]] = {}  # id -> (P params, original n, P's current n)

    @rule(n=st.integers(0, 80), disagg=st.booleans(), whole=st.booleans())
    def arrive(self, n: int, disagg: bool, whole: bool) -> None:
        """``whole``: prompt logprobs (no prefix cache read); D then loads nothing and P keeps every token."""
        rid = f"r{len(self.reqs)}"
        params = {"do_remote_decode": True, "transfer_id": rid} if disagg else None
        drop = self.p.prefill_drop(rid, params, n, whole)
        assert drop == 0 or (disagg and self.backoff and n > self.backoff and not whole)
        if whole:
            params = None  # D skips the load: nothing to agree on
        self.reqs[rid] = (params or {}, n, n - drop)

    @rule(data=st.data())
    def arrive_again(self, data: st.DataObject) -> None:
        if not self.reqs:
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        params, _, now = self.reqs[rid]
        assert self.p.prefill_drop(rid, params or None, now) == 0

    @invariant()
    def sides_agree(self) -> None:
        for rid, (params, n, now) in self.reqs.items():
            if not params:
                assert now == n
                continue
            d_params = {"do_remote_prefill": True, "transfer_id": rid, "remote_host": "h", "remote_port": 1}
            count, is_async = self.d.matched_tokens(rid, d_params, n, 0)
            if count:
                assert is_async and count == now, (n, now, count)
            else:
                assert n <= self.backoff and now == n
            assert bool(params.get(TRUNCATED)) == (now != n)


TestBackoff = BackoffMachine.TestCase


@given(ids=st.lists(st.integers(0, 50), min_size=1, max_size=12), spec=st.integers(0, 4))
def test_the_state_block_is_the_last_before_the_scratch_blocks(ids: list[int], spec: int) -> None:
    want = ids[max(0, len(ids) - 1 - spec)]
    assert state_block(ids, spec) == want


def test_an_empty_or_dropped_state_block_is_refused() -> None:
    with pytest.raises(LayoutError, match="empty"):
        state_block([], 0)
    with pytest.raises(LayoutError, match="placeholder"):
        state_block([3, HOLE], 0)


@given(
    nblocks=st.integers(2, 12),
    pad=st.integers(0, 64),
    nbytes=st.integers(1, 200),
    data=st.data(),
)
def test_the_state_piece_copies_p_s_page_into_d_s(nblocks: int, pad: int, nbytes: int, data: st.DataObject) -> None:
    """Reference: pages as a ``[blocks, stride]`` array; D's state block's first ``nbytes`` become P's."""
    stride = nbytes + pad
    sb = data.draw(st.lists(st.integers(0, nblocks - 1), min_size=1, max_size=4))
    db = data.draw(st.lists(st.integers(0, nblocks - 1), min_size=1, max_size=4))
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, (nblocks, stride), dtype=np.uint8)
    dst = np.full((nblocks, stride), 0xA5, dtype=np.uint8)
    want = dst.copy()
    want[db[-1], :nbytes] = src[sb[-1], :nbytes]
    g = StateGroup(2, stride, nbytes)
    for so, do, ln in state_pieces(g, g, sb, db, nblocks, nblocks).tolist():
        dst.reshape(-1)[do : do + ln] = src.reshape(-1)[so : so + ln]
    assert np.array_equal(dst, want)


def test_state_groups_p_and_d_cannot_share_are_refused() -> None:
    a = StateGroup(0, 4096, 1000)
    with pytest.raises(LayoutError, match="P holds 1000 bytes per request, D 900"):
        state_pieces(a, StateGroup(0, 4096, 900), [1], [2], 8, 8)
    with pytest.raises(LayoutError, match="state groups differ"):
        check_states_compatible((a,), (), (0, 2), (0, 2))
    with pytest.raises(LayoutError, match="same TP size"):
        check_states_compatible((a,), (a,), (0, 2), (0, 1))
    check_states_compatible((), (), (0, 2), (0, 1))  # attention alone: TP mismatch is the head mapping's
    with pytest.raises(LayoutError, match=r"outside \[0, 8\)"):
        state_pieces(a, a, [8], [2], 8, 8)
    with pytest.raises(LayoutError, match="block_stride 10 < state bytes 20"):
        StateGroup(0, 10, 20).validate()


BS, HEADS, HEAD, NB, PAGE = 4, 2, 8, 16, 128  # attention block bytes 64, pages padded to 128
STATE = 100  # bytes of one state (a conv part and an ssm part, packed)


def hybrid(buf: np.ndarray) -> KVLayout:
    """Layers 0-2 state (groups 0-2), layer 3 attention (group 3), all four over one pool of pages."""
    base = int(buf.ctypes.data)
    regions = tuple(Region(base, buf.nbytes, group=g, layer=g) for g in range(4))
    states = tuple(StateGroup(g, PAGE, STATE) for g in range(3))
    return KVLayout(
        BS, NB, PAGE, HEAD, HEADS, 0, HEADS, TokenOrder.NHD, MemKind.DRAM, "uint8", regions, states=states
    ).validate()


def test_a_hybrid_plan_moves_each_state_page_and_the_attention_tokens() -> None:
    """P's state pages of blocks 5, 9, 2 land in D's 11, 1, 6 (their state bytes only) and the attention
    group's ``n`` tokens in D's blocks; nothing else of D's pool changes (reference: numpy page indexing)."""
    rng = np.random.default_rng(1)
    src_buf = rng.integers(1, 256, (NB, PAGE), dtype=np.uint8)
    dst_buf = np.zeros((NB, PAGE), dtype=np.uint8)
    src, dst = hybrid(src_buf), hybrid(dst_buf)
    n = 7
    p_ids, d_ids = ((5,), (9,), (2,), (3, 7)), ((11,), (1,), (6,), (4, 8))
    plan = build_plan(Config(), src, dst, [], [], n, 0, groups=group_tokens(p_ids, dst, d_ids, 0, ()))
    loc, rem = part_descriptors(plan, src, dst, 0, 4)
    flat_s, flat_d = src_buf.reshape(-1), dst_buf.reshape(-1)
    for (la, ln, _), (ra, _, _) in zip(loc.tolist(), rem.tolist(), strict=True):
        flat_d[ra - dst_buf.ctypes.data : ra - dst_buf.ctypes.data + ln] = flat_s[
            la - src_buf.ctypes.data : la - src_buf.ctypes.data + ln
        ]
    want = np.zeros_like(dst_buf)
    for p, d in ((5, 11), (9, 1), (2, 6)):
        want[d, :STATE] = src_buf[p, :STATE]
    tok = BS * HEADS * HEAD // BS  # bytes of one token's heads
    want[4, : BS * tok] = src_buf[3, : BS * tok]
    want[8, : (n - BS) * tok] = src_buf[7, : (n - BS) * tok]
    assert np.array_equal(dst_buf, want)
    assert plan.nbytes == 3 * STATE + n * tok
