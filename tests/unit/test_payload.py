"""The staged payload (pure): P packs from its own block ids, D unpacks from its own, and every byte lands in place.

P's pack list and D's unpack list are derived independently (``kvpush.core.payload``);
these tests pack P's simulated memory into a payload, unpack it into D's,
and compare with the reference that does not use ``kvpush.core.layout`` (numpy
views of each block as the tensor it is), for random block sizes, TP head
slices, in-block orders, strides, placements and prefix-cached starts.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_layout import Scenario, fill_random, make_side, mismatch_report, reference_dst, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.config import Config
from kvpush.core.errors import LayoutError
from kvpush.core.layout import TokenOrder, heads_overlap
from kvpush.core.payload import (
    PayloadOrder,
    block_runs,
    check_unpack,
    pack_pieces,
    payload_order,
    side_pieces,
    unpack_pieces,
)
from kvpush.core.pieces import coalesce, map_pieces
from kvpush.core.plan import build_plan, staged_bytes
from kvpush.decode.registration import staging_decided, wants_staging

PROPERTY = settings(max_examples=200, deadline=None)


def _gather(arena: np.ndarray, base: int, pieces: np.ndarray) -> bytes:
    return b"".join(arena[base + o : base + o + n].tobytes() for o, n in pieces.tolist())


def _scatter(arena: np.ndarray, base: int, pieces: np.ndarray, payload: bytes) -> None:
    pos = 0
    for o, n in pieces.tolist():
        assert base + o >= 0 and base + o + n <= arena.size, "unpack writes outside D's memory"
        arena[base + o : base + o + n] = np.frombuffer(payload[pos : pos + n], dtype=np.uint8)
        pos += n
    assert pos == len(payload), "the unpack list does not consume the whole payload"


def _staged_push(scn: Scenario, pack: np.ndarray, unpack: np.ndarray) -> np.ndarray:
    """D's arena after packing every region on P, moving the payload, and unpacking it on D."""
    out = scn.dst.arena.copy()
    for r in range(len(scn.src.layout.regions)):
        payload = _gather(scn.src.arena, scn.src.region_off(r), pack)
        _scatter(out, scn.dst.region_off(r), unpack, payload)
    return out


@PROPERTY
@given(scenarios())
def test_packed_bytes_land_where_d_unpacks_them(scn: Scenario) -> None:
    """Each side's list from its own block ids: D ends up exactly as the reference push leaves it."""
    sl, dl = scn.src.layout, scn.dst.layout
    pack = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, scn.start_token)
    unpack = unpack_pieces(sl, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    size = staged_bytes(sl, dl, scn.num_tokens, scn.start_token) // len(sl.regions)
    assert int(pack[:, 1].sum()) == int(unpack[:, 1].sum()) == size
    got = _staged_push(scn, pack, unpack)
    expected = reference_dst(scn)
    assert np.array_equal(got, expected), mismatch_report(got, expected)


@PROPERTY
@given(scenarios())
def test_lists_are_maximal_and_follow_p_order(scn: Scenario) -> None:
    """No two neighbours left joinable; a side whose order matches P's needs no piece per head and token."""
    sl, dl = scn.src.layout, scn.dst.layout
    lo, hi = heads_overlap(sl, dl)
    for side, lst in (
        (sl, pack_pieces(sl, (lo, hi), scn.src_blocks, scn.num_tokens, scn.start_token)),
        (dl, unpack_pieces(sl, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)),
    ):
        assert lst.dtype == np.int64 and (lst[:, 1] > 0).all()
        assert not (lst[:-1, 0] + lst[:-1, 1] == lst[1:, 0]).any(), "joinable neighbours left"
        ntok = scn.num_tokens - scn.start_token
        if side.order == sl.order and (side.order == TokenOrder.HND or hi - lo == side.local_heads):
            # runs of tokens: at most one piece per (block segment, head)
            assert lst.shape[0] <= (ntok // side.block_size + 2) * (hi - lo)
    assert payload_order(sl) is (PayloadOrder.TOKEN if sl.order == TokenOrder.NHD else PayloadOrder.HEAD)


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_staged_plan_packs_the_payload_and_accepts_it_built_ahead(scn: Scenario) -> None:
    """``build_plan`` packs with ``pack_pieces``; handed the same list built ahead, it plans the same."""
    sl, dl = scn.src.layout, scn.dst.layout
    cfg = Config.of(plan="staged")
    kw = {"staging_local": (1 << 20, 0), "staging_remote": (1 << 30, 1 << 40, 1)}
    plan = build_plan(cfg, *scn.call_args(), **kw)
    if plan.kind == "empty":
        return
    ahead = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, scn.start_token)
    assert plan.kind == "staged" and np.array_equal(plan.pack, ahead)
    again = build_plan(cfg, *scn.call_args(), **kw, pack=ahead)
    assert again.pack is ahead and again.nbytes == plan.nbytes
    assert (again.kind, again.pieces, again.descriptors) == (plan.kind, plan.pieces, plan.descriptors)
    # A staged plan decided before the direct plan is built does not carry the direct plan's pieces.
    assert again.merged.shape == (0, 3)


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.floats(1e-7, 1e-4), st.floats(1e8, 1e11), st.sampled_from([1e8, 5e9, 1e12]))
def test_plan_with_a_list_ahead_chooses_as_the_full_cost_model(scn: Scenario, desc_s, link, pack_bw) -> None:
    """The early choice (staging against a lower bound of direct's descriptors) never differs from the
    choice with the direct plan built: a registration arriving after the prefill is planned the same."""
    sl, dl = scn.src.layout, scn.dst.layout
    cfg = Config.of(plan="auto", descriptor_cost_us=desc_s * 1e6, link_gbps=link / 1e9)
    kw = {"staging_local": (1 << 20, 0), "staging_remote": (1 << 30, 1 << 40, 1), "pack_bw": pack_bw}
    full = build_plan(cfg, *scn.call_args(), **kw)
    if full.kind == "empty":
        return
    ahead = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, scn.start_token)
    early = build_plan(cfg, *scn.call_args(), **kw, pack=ahead)
    assert early.kind == full.kind and early.nbytes == full.nbytes and early.pieces == full.pieces
    if full.kind == "direct":
        assert np.array_equal(early.merged, full.merged) and early.descriptors == full.descriptors


@PROPERTY
@given(scenarios())
def test_block_runs_bound_every_list(scn: Scenario) -> None:
    """``block_runs`` is a lower bound on the pieces per region of the coalesced direct plan and of D's
    unpack list: the early choices rest on it."""
    sl, dl = scn.src.layout, scn.dst.layout
    pieces = map_pieces(*scn.call_args())
    if pieces.shape[0] == 0:
        return
    merged = coalesce(pieces[np.argsort(pieces[:, 1], kind="stable")])
    unpack = unpack_pieces(sl, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    runs_p = block_runs(sl, scn.src_blocks, scn.num_tokens, scn.start_token)
    runs_d = block_runs(dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    assert max(runs_p, runs_d) <= merged.shape[0]
    assert runs_d <= unpack.shape[0]


def test_block_runs_count_runs_of_the_set_not_of_the_order() -> None:
    """Blocks out of token order still coalesce when both sides hold them alike: one run, not three."""
    lay = _side(TokenOrder.NHD)
    pieces = map_pieces(lay, lay, [0, 2, 1], [0, 2, 1], 48, 0)
    merged = coalesce(pieces[np.argsort(pieces[:, 1], kind="stable")])
    assert merged.shape[0] == 1 and block_runs(lay, [0, 2, 1], 48, 0) == 1
    assert block_runs(lay, [5, 0, 2, 1], 64, 16) == 1 and block_runs(lay, [0, 3, 1], 48, 0) == 2


def test_block_runs_of_nothing_to_move_is_zero() -> None:
    """D already holds every token (``start_token == num_tokens``), also mid-block: no run, so the cheap
    staging rule never asks for a slot the full unpack list (empty) would not."""
    lay = _side(TokenOrder.NHD)
    assert block_runs(lay, [0, 3], 17, 17) == 0 and block_runs(lay, [0], 16, 16) == 0
    assert (
        staging_decided(Config.of(plan="auto", staging_bytes=1, staged_min_descriptors=1), lay, [0, 3], 17, 17) is None
    )


@PROPERTY
@given(scenarios(), st.integers(1, 5000), st.sampled_from(["auto", "staged", "direct"]))
def test_d_decides_staging_before_its_list_as_with_it(scn: Scenario, min_descs: int, plan: str) -> None:
    """D's choice made before its unpack list is built (to send the Register first) is the choice the
    list would make; and its checks reject exactly what building the list rejects."""
    sl, dl = scn.src.layout, scn.dst.layout
    cfg = Config.of(plan=plan, staged_min_descriptors=min_descs)
    unpack = unpack_pieces(sl, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    check_unpack(sl, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    early = staging_decided(cfg, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    assert early is None or early == wants_staging(cfg, sl, dl, unpack)


@st.composite
def block_pairs(draw) -> tuple:
    """Opaque (BLOCK) sides of one block size and head slice: whole blocks move."""
    bs = draw(st.sampled_from([4, 8, 16]))
    heads = draw(st.integers(1, 3))
    n = draw(st.integers(0, 5 * bs))
    start = draw(st.integers(0, n // bs)) * bs
    sides, ids = [], []
    for _ in range(2):
        need = max(1, -(-n // bs))
        nb = need + draw(st.integers(0, 3))
        side = make_side(
            block_size=bs,
            num_blocks=nb,
            head_bytes=2,
            num_heads=heads,
            head_start=0,
            local_heads=heads,
            order=TokenOrder.BLOCK,
            num_regions=draw(st.integers(1, 3)) if not sides else len(sides[0].layout.regions),
            pad=draw(st.sampled_from([0, 3])),
        )
        sides.append(side)
        ids.append(list(draw(st.permutations(range(nb)))))
    fill_random(sides[0], draw(st.integers(0, 2**32 - 1)))
    return Scenario(sides[0], sides[1], ids[0], ids[1], n, start)


@settings(max_examples=60, deadline=None)
@given(block_pairs())
def test_opaque_blocks_land_as_the_direct_push_puts_them(scn: Scenario) -> None:
    sl, dl = scn.src.layout, scn.dst.layout
    pack = pack_pieces(sl, heads_overlap(sl, dl), scn.src_blocks, scn.num_tokens, scn.start_token)
    unpack = unpack_pieces(sl, dl, scn.dst_blocks, scn.num_tokens, scn.start_token)
    expected = scn.dst.arena.copy()
    for r in range(len(sl.regions)):
        so, do = scn.src.region_off(r), scn.dst.region_off(r)
        for s, d, n in map_pieces(*scn.call_args()).tolist():
            expected[do + d : do + d + n] = scn.src.arena[so + s : so + s + n]
    got = _staged_push(scn, pack, unpack)
    assert np.array_equal(got, expected), mismatch_report(got, expected)


def _side(order: TokenOrder, local_heads: int = 2, head_start: int = 0, block_size: int = 16):
    return make_side(
        block_size=block_size,
        num_blocks=8,
        head_bytes=4,
        num_heads=4,
        head_start=head_start,
        local_heads=local_heads,
        order=order,
        num_regions=1,
    ).layout


def test_pack_list_needs_only_p_own_blocks() -> None:
    """The point of the payload order: P's list is the same whatever D's blocks, block size or order."""
    p = _side(TokenOrder.NHD)
    ds = [_side(TokenOrder.NHD), _side(TokenOrder.HND, block_size=32), _side(TokenOrder.NHD, block_size=8)]
    packs = {pack_pieces(p, heads_overlap(p, d), [3, 1, 6], 40, 5).tobytes() for d in ds}
    assert len(packs) == 1
    # a P rank whose blocks are consecutive packs one run per region
    assert pack_pieces(p, (0, 2), [2, 3, 4], 40, 0).tolist() == [[2 * 16 * 8, 40 * 8]]


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda p: side_pieces(p, PayloadOrder.TOKEN, [0], 16, 0, (1, 3), "D"), ["D holds heads [0, 2)", "[1, 3)"]),
        (lambda p: side_pieces(p, PayloadOrder.TOKEN, [0], 40, 0, (0, 2), "P"), ["P has 1 block ids, 3 needed"]),
        (lambda p: side_pieces(p, PayloadOrder.TOKEN, [0, 9, 1], 40, 0, (0, 2), "P"), ["out of range [0, 8)"]),
        (lambda p: side_pieces(p, PayloadOrder.TOKEN, [0], 8, 9, (0, 2), "P"), ["start_token 9 outside [0, 8]"]),
        (lambda p: side_pieces(p, PayloadOrder.BLOCK, [0], 8, 0, (0, 2), "D"), ["block payload", "D's NHD"]),
    ],
)
def test_bad_input_is_named(call, words: list[str]) -> None:
    with pytest.raises(LayoutError) as e:
        call(_side(TokenOrder.NHD))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_opaque_and_token_layouts_do_not_mix() -> None:
    with pytest.raises(LayoutError, match="opaque"):
        unpack_pieces(_side(TokenOrder.BLOCK), _side(TokenOrder.NHD), [0], 8, 0)
    with pytest.raises(LayoutError, match="opaque"):
        check_unpack(_side(TokenOrder.BLOCK), _side(TokenOrder.NHD), [0], 8, 0)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (([0], 40, 0), ["D has 1 block ids, 3 needed"]),
        (([0, 9, 1], 40, 0), ["out of range [0, 8)"]),
        (([0], 8, 9), ["start_token 9 outside [0, 8]"]),
    ],
)
def test_d_checks_before_sending_name_the_problem(args, words: list[str]) -> None:
    """What D checks before its Register leaves (its list is built after): the errors building it gives."""
    for call in (check_unpack, unpack_pieces):
        with pytest.raises(LayoutError) as e:
            call(_side(TokenOrder.NHD), _side(TokenOrder.NHD), *args)
        assert all(w in str(e.value) for w in words), str(e.value)


def test_nothing_to_move_is_an_empty_list() -> None:
    assert pack_pieces(_side(TokenOrder.HND), (0, 2), [0, 1], 20, 20).shape == (0, 2)
