"""Layout mapping: every byte of every pushed token lands where D's attention will read it.

The property tests run the whole pure pipeline (``map_pieces`` → ``coalesce`` /
``coalesce_in_dst_order`` → ``descriptors`` / ``merge_descriptors``) on simulated memory
and compare against a reference that views blocks as tensors with numpy
(``helpers_layout``), because a wrong offset here corrupts KV silently: the
decode still runs, it just attends to the wrong numbers.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from helpers_layout import (
    ORDERS,
    Scenario,
    apply_descriptors,
    byte_map,
    fill_random,
    make_side,
    mismatch_report,
    reference_dst,
    scenarios,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core import layout as layout_mod
from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder, check_compatible, heads_overlap
from kvpush.core.pieces import coalesce, coalesce_in_dst_order, descriptors, map_pieces, merge_descriptors

PROPERTY = settings(max_examples=120, deadline=None)


def _run(scn: Scenario, pieces: np.ndarray, merge: bool = False) -> np.ndarray:
    local, remote = descriptors(pieces, scn.src.layout, scn.dst.layout)
    if merge:
        local, remote = merge_descriptors(local, remote)
    out = scn.dst.arena.copy()
    apply_descriptors(local, remote, scn.src, out, scn.dst)
    return out


# -- end to end on simulated memory ------------------------------------------------


@PROPERTY
@given(scenarios())
def test_every_byte_lands_in_place(scn: Scenario) -> None:
    """Each pipeline variant writes exactly the reference bytes and leaves every other D byte untouched."""
    expected = reference_dst(scn)
    pieces = map_pieces(*scn.call_args())
    variants = {
        "raw": _run(scn, pieces),
        "coalesce": _run(scn, coalesce(pieces)),
        "coalesce_in_dst_order": _run(scn, coalesce_in_dst_order(pieces)),
        "merged": _run(scn, coalesce_in_dst_order(pieces), merge=True),
        "merged_raw": _run(scn, pieces, merge=True),
    }
    for name, got in variants.items():
        assert np.array_equal(got, expected), f"{name}: {mismatch_report(got, expected)}"


@PROPERTY
@given(scenarios())
def test_pieces_are_disjoint_and_coalescing_preserves_them(scn: Scenario) -> None:
    """Coalescing may only join ranges contiguous on both sides: the byte-level map must not change."""
    pieces = map_pieces(*scn.call_args())
    sl, dl = scn.src.layout, scn.dst.layout
    lo, hi = heads_overlap(sl, dl)
    assert pieces.dtype == np.int64 and pieces.shape[1] == 3
    assert (pieces[:, 2] > 0).all()
    exact = byte_map(pieces)
    assert exact.shape[0] == (scn.num_tokens - scn.start_token) * (hi - lo) * sl.head_bytes
    assert np.unique(exact[:, 0]).size == exact.shape[0], "a P byte is read twice"
    assert np.unique(exact[:, 1]).size == exact.shape[0], "a D byte is written twice"
    for name, fn in (("coalesce", coalesce), ("coalesce_in_dst_order", coalesce_in_dst_order)):
        merged = fn(pieces)
        assert merged.shape[0] <= pieces.shape[0], name
        assert merged[:, 2].sum() == pieces[:, 2].sum(), name
        assert np.array_equal(byte_map(merged), exact), f"{name} changed which bytes move where"
        # Maximal: no two neighbours left that were joinable.
        so, do, ln = merged[:-1, 0], merged[:-1, 1], merged[:-1, 2]
        joinable = (so + ln == merged[1:, 0]) & (do + ln == merged[1:, 1])
        assert not joinable.any(), f"{name} left joinable neighbours"
    assert coalesce_in_dst_order(pieces).shape[0] <= coalesce(pieces).shape[0]


@settings(max_examples=60, deadline=None)
@given(scenarios(max_tokens=96))
def test_descriptors_cover_every_region(scn: Scenario) -> None:
    """One descriptor per (region, piece), region-major, with each side's device id; merging keeps the byte map."""
    pieces = coalesce(map_pieces(*scn.call_args()))
    sl, dl = scn.src.layout, scn.dst.layout
    local, remote = descriptors(pieces, sl, dl)
    n, r = pieces.shape[0], len(sl.regions)
    assert local.shape == remote.shape == (r * n, 3)
    for i in range(r):
        chunk = slice(i * n, (i + 1) * n)
        assert np.array_equal(local[chunk, 0], sl.regions[i].base + pieces[:, 0])
        assert np.array_equal(remote[chunk, 0], dl.regions[i].base + pieces[:, 1])
        assert np.array_equal(local[chunk, 1], pieces[:, 2])
        assert (local[chunk, 2] == sl.regions[i].device_id).all()
        assert (remote[chunk, 2] == dl.regions[i].device_id).all()
    as_pieces = np.stack([local[:, 0], remote[:, 0], local[:, 1]], axis=1)
    ml, mr = merge_descriptors(local, remote)
    assert ml.shape[0] <= local.shape[0]
    assert np.array_equal(ml[:, 1], mr[:, 1])
    assert np.array_equal(byte_map(np.stack([ml[:, 0], mr[:, 0], ml[:, 1]], axis=1)), byte_map(as_pieces))


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 2), (2, 1), (1, 4), (4, 2), (2, 4), (2, 2)])
@pytest.mark.parametrize(("order_p", "order_d"), list(itertools.product(ORDERS, repeat=2)))
def test_tp_splits(tp_p: int, tp_d: int, order_p: TokenOrder, order_d: TokenOrder) -> None:
    """Every (P rank, D rank) pair with overlapping heads, as TP sharding produces them (4 KV heads)."""
    heads = 4
    for rp, rd in itertools.product(range(tp_p), range(tp_d)):
        p_heads = range(rp * heads // tp_p, (rp + 1) * heads // tp_p)
        d_heads = range(rd * heads // tp_d, (rd + 1) * heads // tp_d)
        if not set(p_heads) & set(d_heads):
            continue
        src = make_side(
            block_size=16,
            num_blocks=6,
            head_bytes=4,
            num_heads=heads,
            head_start=p_heads.start,
            local_heads=len(p_heads),
            order=order_p,
            num_regions=2,
        )
        dst = make_side(
            block_size=8,
            num_blocks=12,
            head_bytes=4,
            num_heads=heads,
            head_start=d_heads.start,
            local_heads=len(d_heads),
            order=order_d,
            num_regions=2,
            interleaved=True,
        )
        fill_random(src, rp * 10 + rd)
        scn = Scenario(src, dst, [5, 0, 3, 1, 4, 2], [11, 2, 7, 0, 9, 1, 3, 5, 4, 6, 8, 10], 70, 13)
        got = _run(scn, coalesce(map_pieces(*scn.call_args())))
        expected = reference_dst(scn)
        assert np.array_equal(got, expected), f"P rank {rp}/{tp_p} -> D rank {rd}/{tp_d}: " + mismatch_report(
            got, expected
        )


def test_order_given_as_plain_string() -> None:
    """A layout built with ``order="NHD"`` (not the enum, e.g. from JSON or a CLI) must map like the enum."""
    side = make_side(
        block_size=8, num_blocks=3, head_bytes=2, num_heads=2, head_start=0, local_heads=2, order=TokenOrder.NHD,
        num_regions=1,
    )  # fmt: skip
    other = make_side(
        block_size=8, num_blocks=3, head_bytes=2, num_heads=2, head_start=0, local_heads=2, order=TokenOrder.HND,
        num_regions=1,
    )  # fmt: skip
    as_str = KVLayout(**{**_fields(side.layout), "order": "NHD"})
    want = map_pieces(side.layout, other.layout, [0, 1], [1, 2], 12, 3)
    got = map_pieces(as_str, other.layout, [0, 1], [1, 2], 12, 3)
    assert np.array_equal(got, want)


# -- coalescing granularity --------------------------------------------------------


def _identical_pair(order: TokenOrder, num_regions: int = 1, back_to_back: bool = False):
    kw = dict(
        block_size=16, num_blocks=8, head_bytes=4, num_heads=4, head_start=0, local_heads=4, order=order,
        num_regions=num_regions, gaps=[0 if back_to_back else 32] * num_regions,
    )  # fmt: skip
    return make_side(**kw), make_side(**kw)


@pytest.mark.parametrize(
    ("num_tokens", "start_token", "nhd", "hnd"),
    [(64, 0, 1, 1), (50, 0, 1, 4), (64, 17, 1, 4), (1, 0, 1, 4), (64, 48, 1, 1)],
)
def test_consecutive_ids_identical_layouts_coalesce(num_tokens, start_token, nhd, hnd) -> None:
    """Same layout, consecutive blocks: NHD is one run per region; HND too, except each head of a partial block.

    HND keeps a head's tokens of one block together, so a partial block leaves
    one piece per head (the last head's piece joins the following full blocks).
    """
    for order, want in ((TokenOrder.NHD, nhd), (TokenOrder.HND, hnd)):
        src, dst = _identical_pair(order, num_regions=3)
        pieces = coalesce(map_pieces(src.layout, dst.layout, [2, 3, 4, 5], [4, 5, 6, 7], num_tokens, start_token))
        assert pieces.shape[0] == want, order
        local, _ = descriptors(pieces, src.layout, dst.layout)
        assert local.shape[0] == 3 * want


def test_hnd_partial_last_block_gives_one_piece_per_head() -> None:
    """HND with a partial last block: full blocks form one run, then one piece per head (the last joins it)."""
    src, dst = _identical_pair(TokenOrder.HND)
    pieces = coalesce(map_pieces(src.layout, dst.layout, [0, 1, 2], [3, 4, 5], 40))
    assert pieces.shape[0] == 4


def test_merge_descriptors_crosses_back_to_back_regions() -> None:
    """Whole back-to-back regions copied block for block merge into a single descriptor."""
    src, dst = _identical_pair(TokenOrder.NHD, num_regions=3, back_to_back=True)
    ids = list(range(8))
    pieces = coalesce(map_pieces(src.layout, dst.layout, ids, ids, 8 * 16))
    assert pieces.shape[0] == 1
    local, remote = merge_descriptors(*descriptors(pieces, src.layout, dst.layout))
    assert local.shape[0] == remote.shape[0] == 1
    assert local[0, 1] == 3 * src.layout.regions[0].size


def test_merge_descriptors_respects_devices() -> None:
    """Address-adjacent descriptors on different devices are different memories: never merged."""
    local = np.array([[100, 8, 0], [108, 8, 1], [116, 8, 1]], dtype=np.int64)
    remote = np.array([[200, 8, 0], [208, 8, 0], [216, 8, 0]], dtype=np.int64)
    ml, mr = merge_descriptors(local, remote)
    assert ml.tolist() == [[100, 8, 0], [108, 16, 1]]
    assert mr.tolist() == [[200, 8, 0], [208, 16, 0]]
    remote[2, 2] = 3
    ml, mr = merge_descriptors(local, remote)
    assert ml.shape[0] == 3


def test_coalesce_never_bridges_a_gap() -> None:
    """Contiguous on one side only (or a gap of one byte) is not joinable."""
    pieces = np.array([[0, 0, 4], [4, 5, 4], [8, 9, 4], [13, 13, 4], [17, 17, 4]], dtype=np.int64)
    assert coalesce(pieces).tolist() == [[0, 0, 4], [4, 5, 8], [13, 13, 8]]
    assert coalesce(pieces[:0]).shape == (0, 3)
    assert coalesce(pieces[:1]).tolist() == [[0, 0, 4]]
    shuffled = pieces[[4, 2, 0, 3, 1]]
    assert coalesce(shuffled).shape[0] == 5
    assert coalesce_in_dst_order(shuffled).tolist() == [[0, 0, 4], [4, 5, 8], [13, 13, 8]]


def test_nothing_to_push() -> None:
    """start_token == num_tokens (all prefix-cached) and num_tokens == 0 give no pieces and no descriptors."""
    src, dst = _identical_pair(TokenOrder.NHD)
    for n, s, ids in ((32, 32, [0, 1]), (0, 0, [])):
        pieces = map_pieces(src.layout, dst.layout, ids, ids, n, s)
        assert pieces.shape == (0, 3)
        local, remote = descriptors(coalesce(pieces), src.layout, dst.layout)
        assert local.shape == remote.shape == (0, 3)
        assert merge_descriptors(local, remote)[0].shape == (0, 3)


# -- errors -----------------------------------------------------------------------


def _fields(layout: KVLayout) -> dict:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}


def _layout(**changes) -> KVLayout:
    base = dict(
        block_size=16, num_blocks=4, block_stride=16 * 2 * 8, head_bytes=8, num_heads=4, head_start=0, local_heads=2,
        order=TokenOrder.NHD, mem=MemKind.DRAM, dtype="bfloat16",
        regions=(Region(base=4096, size=4 * 256), Region(base=8192, size=4 * 256)),
    )  # fmt: skip
    base.update(changes)
    return KVLayout(**base)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"dtype": "float16"}, ["dtype", "bfloat16", "float16"]),
        ({"head_bytes": 4, "block_stride": 128}, ["head_bytes", "8", "4"]),
        ({"num_heads": 8}, ["num_heads", "4", "8"]),
        ({"regions": (Region(base=4096, size=1024),)}, ["regions", "2", "1"]),
        ({"regions": (Region(4096, 1024, group=0), Region(8192, 1024, group=1))}, ["groups"]),
        ({"head_start": 2}, ["do not overlap", "[0, 2)", "[2, 4)"]),
    ],
)
def test_check_compatible_names_the_difference(changes: dict, words: list[str]) -> None:
    src, dst = _layout(), _layout(**changes)
    with pytest.raises(LayoutError) as info:
        check_compatible(src, dst)
    for w in words:
        assert w in str(info.value)
    with pytest.raises(LayoutError):
        map_pieces(src, dst, [0], [0], 1)


def test_a_compatible_pair_is_remembered_and_an_incompatible_one_still_refused() -> None:
    """``check_compatible`` remembers a pair that passed on P's layout (by identity), never a verdict for
    another layout, however many it saw."""
    src, ok = _layout(), _layout(block_size=8, block_stride=999, head_start=1, local_heads=3)
    check_compatible(src, ok)
    assert src.compatible_with[id(ok)] is ok
    for bad in (_layout(dtype="float16"), _layout(head_start=2), _layout(regions=(Region(4096, 1024),))):
        with pytest.raises(LayoutError):
            check_compatible(src, bad)
        assert id(bad) not in src.compatible_with
    for i in range(layout_mod.COMPATIBLE_KEPT + 1):
        check_compatible(src, _layout(num_blocks=5 + i))
    assert len(src.compatible_with) <= layout_mod.COMPATIBLE_KEPT
    with pytest.raises(LayoutError):
        check_compatible(src, _layout(num_heads=8))


def test_region_facts_are_kept_per_layout_and_not_sent() -> None:
    """``region_groups``, ``num_groups``, ``hybrid`` and ``token_group`` are read off each layout's own regions
    (a layout made from another by ``replace`` has its own), and what is kept is not on the wire."""
    two = _layout(regions=(Region(4096, 1024, group=0), Region(8192, 1024, group=1)))
    fresh = msgspec.msgpack.encode(two)
    assert (two.region_groups, two.num_groups, two.hybrid, two.token_group) == ((0, 1), 2, True, 0)
    check_compatible(two, two)
    one = msgspec.structs.replace(two, regions=(Region(4096, 1024), Region(8192, 1024)))
    assert (one.region_groups, one.num_groups, one.hybrid, one.token_group) == ((0, 0), 1, False, 0)
    assert msgspec.msgpack.encode(two) == fresh
    assert msgspec.msgpack.decode(fresh, type=KVLayout) == two


def test_compatible_layouts_pass() -> None:
    """Block size, order, stride, heads slice and addresses may all differ."""
    check_compatible(
        _layout(),
        _layout(block_size=8, block_stride=999, order=TokenOrder.HND, head_start=1, local_heads=3, num_blocks=9),
    )


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"block_size": 0}, ["block_size", "> 0"]),
        ({"num_blocks": 0}, ["num_blocks", "> 0"]),
        ({"head_bytes": 0}, ["head_bytes", "> 0"]),
        ({"local_heads": 0}, ["local_heads", "> 0"]),
        ({"head_start": 3}, ["heads [3, 5)", "4"]),
        ({"head_start": -1}, ["heads [-1, 1)"]),
        ({"block_stride": 255}, ["block_stride 255", "256"]),
        ({"regions": ()}, ["no regions"]),
        ({"regions": (Region(4096, 1024), Region(8192, 1023))}, ["region 1", "1023", "1024"]),
        ({"regions": (Region(0, 1024),)}, ["region 0", "base"]),
        ({"order": "NDH"}, ["order", "NDH"]),
    ],
)
def test_validate_names_the_problem(changes: dict, words: list[str]) -> None:
    with pytest.raises(LayoutError) as info:
        _layout(**changes).validate()
    for w in words:
        assert w in str(info.value), str(info.value)


def test_validate_accepts_tight_last_block() -> None:
    """The last block needs only its payload, not a whole stride (the stride pad may lie outside the region)."""
    lay = _layout(block_stride=300, regions=(Region(4096, 3 * 300 + 256),) * 2)
    assert lay.validate() is lay


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "num_tokens", "start", "words"),
    [
        ([0, 1], [0, 1, 2], 40, 0, ["P has 2 block ids, 3 needed"]),
        ([0, 1, 2], [0, 1], 40, 0, ["D has 2 block ids, 3 needed"]),
        ([0, 1, 4], [0, 1, 2], 40, 0, ["P block id out of range [0, 4)", "max 4"]),
        ([0, 1, 2], [0, -1, 2], 40, 0, ["D block id out of range [0, 4)", "min -1"]),
        ([], [], 1, 0, ["P has 0 block ids, 1 needed"]),
        ([0], [0], 5, 6, ["start_token 6 outside [0, 5]"]),
        ([0], [0], 5, -1, ["start_token -1"]),
    ],
)
def test_bad_block_ids(src_ids, dst_ids, num_tokens, start, words) -> None:
    """Too few or out-of-range ids are the caller's bug: say which side and what range."""
    lay = _layout()
    with pytest.raises(LayoutError) as info:
        map_pieces(lay, _layout(block_size=16), src_ids, dst_ids, num_tokens, start)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_unused_extra_ids_are_ignored() -> None:
    """Ids past the last needed block (D allocated ahead for decode) are not range-checked or used."""
    lay = _layout()
    pieces = map_pieces(lay, lay, [1, 99], np.array([2, -5]), 16)
    assert pieces.shape[0] > 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ids_beyond_needed_do_not_change_pieces(data) -> None:
    """Appending junk ids after the needed ones changes nothing (D lists blocks reserved for decode)."""
    scn = data.draw(scenarios(max_tokens=64))
    base = map_pieces(*scn.call_args())
    extra = data.draw(st.lists(st.integers(-5, 10**6), max_size=3))
    sb = scn.src_blocks[: -(-scn.num_tokens // scn.src.layout.block_size)] + extra
    db = scn.dst_blocks[: -(-scn.num_tokens // scn.dst.layout.block_size)] + extra
    got = map_pieces(scn.src.layout, scn.dst.layout, sb, db, scn.num_tokens, scn.start_token)
    assert np.array_equal(got, base)


def test_layers_are_in_the_layout() -> None:
    """A region knows its layer; "layer L written" maps to the leading regions through L, and layers out of
    order are refused at validation (a layer-wise push would otherwise send regions not yet written)."""
    regs = tuple(Region(4096 * (i + 1), 1024, layer=i // 2) for i in range(6))
    lay = _layout(regions=regs)
    assert lay.num_layers == 3
    assert [lay.regions_through(layer) for layer in range(3)] == [2, 4, 6]
    with pytest.raises(LayoutError, match="layer 3 outside"):
        lay.regions_through(3)
    skipped = (*regs[:2], Region(1 << 20, 1024, layer=2))
    with pytest.raises(LayoutError, match="region 2 holds layer 2 after layer 0"):
        _layout(regions=skipped).validate()
