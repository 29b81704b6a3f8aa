"""By-index and strip posts (pure, and the agent's lists with a stand-in for NIXL's agent object).

The property that matters: for any pair of layouts ``pair_of`` accepts and any
direct part ``split`` accepts, the entries the indices name plus the rest's
descriptors, and the strips' WRITE built for the request, each move exactly the
(P byte, D byte) pairs today's descriptors (``plan.part_descriptors``) move, no
byte more or less; and the descriptor count the split reports is what NIXL posts
once it merged entries adjacent on both sides (modelled here from the addresses,
not from the indices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers_layout import byte_map
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.config import Config
from kvpush.core.indexed import (
    BUILD_US,
    PostCosts,
    Way,
    choose,
    expand,
    indices,
    list_fits,
    list_rows,
    pair_of,
    rest_descriptors,
    split,
    strip_descriptors,
    strips_of,
    today_suffices,
)
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.outcome import XferState
from kvpush.core.parts import split_regions
from kvpush.core.plan import build_plan, part_descriptors
from kvpush.transport.nixl_agent import Agent

GAP = 64
"""Bytes between allocations: no entry of one allocation ends where one of another starts."""


@dataclass(frozen=True)
class Kind:
    """How one side lays out a layer: ``split`` (K and V apart), ``blocks_first`` (block b's K then its V, one
    allocation: vLLM's ``[blocks, 2, ...]``) or ``single`` (one region a layer)."""

    kv: str
    pad: int  # bytes of padding after each block's data: 0 makes the strips dense


def make_layout(
    kind: Kind,
    *,
    layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_bytes: int,
    order: TokenOrder,
    at: int,
) -> KVLayout:
    """A layout at virtual addresses from ``at`` (nothing is read or written: only addresses are compared)."""
    bb = block_size * heads * head_bytes
    per = 1 if kind.kv == "single" else 2
    stride = (per if kind.kv == "blocks_first" else 1) * bb + kind.pad
    size = (num_blocks - 1) * stride + bb
    regions, pos = [], at
    for layer in range(layers):
        if kind.kv == "blocks_first":
            regions += [Region(pos, size, layer=layer), Region(pos + bb, size, layer=layer)]
            pos += size + bb + GAP
        else:
            for _ in range(per):
                regions.append(Region(pos, size, layer=layer))
                pos += size + GAP
    return KVLayout(
        block_size=block_size,
        num_blocks=num_blocks,
        block_stride=stride,
        head_bytes=head_bytes,
        num_heads=heads,
        head_start=0,
        local_heads=heads,
        order=order,
        mem=MemKind.DRAM,
        dtype="float16",
        regions=tuple(regions),
    ).validate()


@dataclass(frozen=True)
class Case:
    src: KVLayout
    dst: KVLayout
    src_blocks: list[int]
    dst_blocks: list[int]
    num_tokens: int
    start_token: int


def _blocks(draw: Any, n: int, num_blocks: int) -> list[int]:
    """``n`` distinct ids: shuffled, contiguous, or runs of a few."""
    how = draw(st.sampled_from(["shuffled", "contiguous", "runs"]))
    if how == "contiguous":
        first = draw(st.integers(0, num_blocks - n))
        return list(range(first, first + n))
    perm = draw(st.permutations(range(num_blocks)))
    if how == "shuffled":
        return list(perm[:n])
    out: list[int] = []
    for b in sorted(perm[: -(-n // 3)]):
        out += [x for x in (b, b + 1, b + 2) if x < num_blocks and x not in out]
    return (out + [x for x in perm if x not in out])[:n]


@st.composite
def cases(draw: Any) -> Case:
    kv = draw(st.sampled_from(["split", "blocks_first", "single"]))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    heads, head_bytes = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    order = draw(st.sampled_from([TokenOrder.NHD, TokenOrder.HND]))
    layers = draw(st.integers(1, 3))
    num_tokens = draw(st.integers(1, 12 * block_size))
    start_token = draw(st.integers(0, num_tokens))
    need = -(-num_tokens // block_size)
    layouts, ids = [], []
    for at in (1 << 20, 1 << 32):
        num_blocks = need + draw(st.integers(0, 6))
        pad = draw(st.sampled_from([0, 0, head_bytes, 8]))
        layouts.append(
            make_layout(
                Kind(kv, pad),
                layers=layers,
                num_blocks=num_blocks,
                block_size=block_size,
                heads=heads,
                head_bytes=head_bytes,
                order=order,
                at=at,
            )
        )
        ids.append(_blocks(draw, need, num_blocks))
    return Case(layouts[0], layouts[1], ids[0], ids[1], num_tokens, start_token)


def _pairs(local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """(P byte, D byte) pairs of descriptor rows."""
    assert (local[:, 1] == remote[:, 1]).all()
    return byte_map(np.stack([local[:, 0], remote[:, 0], local[:, 1]], axis=1))


def _merged(local: np.ndarray, remote: np.ndarray) -> int:
    """Descriptors left once rows adjacent on both sides (and on one device each) are merged, in order: what
    NIXL posts for entries named in this order."""
    if local.shape[0] == 0:
        return 0
    joins = (
        (local[:-1, 0] + local[:-1, 1] == local[1:, 0])
        & (remote[:-1, 0] + remote[:-1, 1] == remote[1:, 0])
        & (local[:-1, 2] == local[1:, 2])
        & (remote[:-1, 2] == remote[1:, 2])
    )
    return local.shape[0] - int(joins.sum())


@settings(max_examples=300, deadline=None)
@given(cases(), st.integers(1, 4))
def test_indices_and_rest_move_exactly_the_bytes_of_todays_descriptors(case: Case, parts: int) -> None:
    pair = pair_of(case.src, case.dst)
    assert pair is not None
    plan = build_plan(
        Config.of(plan="direct"),
        case.src,
        case.dst,
        case.src_blocks,
        case.dst_blocks,
        case.num_tokens,
        case.start_token,
    )
    if plan.kind == "empty":
        return
    local_list, remote_list = expand(pair.local_rows), expand(pair.remote_rows)
    assert local_list.shape[0] == len(pair.strips.bounds[:-1]) * case.src.num_blocks
    for r0, r1 in split_regions(0, plan.nregions, parts):
        part = split(pair, plan, r0, r1)
        if part is None:  # a part that starts or ends inside a strip keeps today's path
            assert pair.strips.index_of(r0) is None or pair.strips.index_of(r1) is None
            continue
        want = _pairs(*part_descriptors(plan, case.src, case.dst, r0, r1))
        li, ri = indices(pair, part)
        assert li.dtype == ri.dtype == np.int32 and li.size == ri.size == part.indices
        named_l, named_r = local_list[li], remote_list[ri]
        rl, rr = rest_descriptors(pair, part)
        got = _pairs(np.concatenate([named_l, rl]), np.concatenate([named_r, rr]))
        np.testing.assert_array_equal(got, want)
        assert part.posted == _merged(named_l, named_r)
        assert rl.shape[0] <= part.rest_count
        sl, sr = strip_descriptors(pair, part)  # the same bytes in one WRITE built for the request
        np.testing.assert_array_equal(_pairs(sl, sr), want)
        assert sl.shape[0] <= part.posted + part.rest_count
        if today_suffices(pair, plan):  # the shortcut never skips a cheaper way
            for index_us in (0.0, 0.02, 1.0):
                costs = PostCosts(7e-6, index_us * 1e-6)
                assert choose(part, plan.merged.shape[0] * (r1 - r0), costs) is Way.TODAY


def test_strips_join_a_layers_regions_whose_blocks_sit_back_to_back() -> None:
    common = {"layers": 3, "num_blocks": 5, "block_size": 4, "heads": 2, "head_bytes": 2, "order": TokenOrder.NHD}
    first = make_layout(Kind("blocks_first", 0), at=1 << 20, **common)
    assert strips_of(first).bounds == (0, 2, 4, 6)
    rows = list_rows(first, strips_of(first))
    assert rows[:, 1].tolist() == [32] * 3 and rows[:, 3].tolist() == [32] * 3  # dense: two regions' block each
    padded = make_layout(Kind("blocks_first", 8), at=1 << 20, **common)
    assert strips_of(padded).bounds == (0, 2, 4, 6) and list_rows(padded, strips_of(padded))[0, 3] == 40
    assert strips_of(make_layout(Kind("split", 0), at=1 << 20, **common)).bounds == tuple(range(7))
    assert strips_of(make_layout(Kind("single", 0), at=1 << 20, **common)).bounds == (0, 1, 2, 3)
    # Two regions of one layer back to back but wider than the block stride would overlap: not a strip.
    bb = 16
    tight = KVLayout(
        block_size=4,
        num_blocks=4,
        block_stride=bb,
        head_bytes=2,
        num_heads=2,
        head_start=0,
        local_heads=2,
        order=TokenOrder.NHD,
        mem=MemKind.DRAM,
        dtype="float16",
        regions=(Region(1 << 20, 4 * bb), Region((1 << 20) + bb, 4 * bb)),
    )
    assert strips_of(tight).bounds == (0, 1, 2)
    expanded = expand(list_rows(first, strips_of(first)))
    assert expanded.shape == (15, 3)
    assert expanded[6].tolist() == [first.regions[2].base + 1 * 32, 32, 0]


def test_pairs_that_differ_in_a_block_are_not_indexed() -> None:
    common = {"layers": 2, "num_blocks": 6, "heads": 2, "head_bytes": 2, "order": TokenOrder.NHD}
    src = make_layout(Kind("split", 0), block_size=4, at=1 << 20, **common)
    assert pair_of(src, make_layout(Kind("split", 4), block_size=4, at=1 << 30, **common)) is not None
    assert pair_of(src, make_layout(Kind("split", 0), block_size=8, at=1 << 30, **common)) is None
    assert pair_of(src, make_layout(Kind("blocks_first", 0), block_size=4, at=1 << 30, **common)) is None
    hnd = {**common, "order": TokenOrder.HND}
    assert pair_of(src, make_layout(Kind("split", 0), block_size=4, at=1 << 30, **hnd)) is None
    other_heads = KVLayout(**{**_fields(src), "num_heads": 4, "head_start": 2})
    assert pair_of(src, other_heads) is None
    assert pair_of(src, KVLayout(**{**_fields(src), "direct": False})) is None


def _fields(layout: KVLayout) -> dict[str, Any]:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}


def _split_of(kv: str, src_blocks: list[int], dst_blocks: list[int], tokens: int) -> tuple[Any, int]:
    common = {"layers": 4, "block_size": 16, "heads": 1, "head_bytes": 256, "order": TokenOrder.NHD}
    src = make_layout(Kind(kv, 0), num_blocks=64, at=1 << 20, **common)
    dst = make_layout(Kind(kv, 0), num_blocks=64, at=1 << 40, **common)
    pair = pair_of(src, dst)
    assert pair is not None
    plan = build_plan(Config.of(plan="direct"), src, dst, src_blocks, dst_blocks, tokens, 0)
    part = split(pair, plan, 0, plan.nregions)
    assert part is not None
    return part, plan.merged.shape[0] * plan.nregions


def test_each_part_takes_the_cheapest_way_and_today_s_on_a_tie() -> None:
    costs = PostCosts(descriptor_s=7e-6)
    shuffled = list(np.random.default_rng(0).permutation(64)[:32])
    full, tail = 32 * 16, 32 * 16 - 5
    # Split K/V, every block whole: the same descriptors either way, the indices cost less than building them.
    part, today = _split_of("split", shuffled, shuffled[::-1], full)
    assert (part.posted, part.rest.shape[0]) == (today, 0) and choose(part, today, costs) is Way.BY_INDEX
    # A partial last block cannot be named by index, and the strips are today's descriptors: today's.
    part, today = _split_of("split", shuffled, shuffled[::-1], tail)
    assert part.rest.shape[0] == 1 and part.posted + part.rest_count == today
    assert choose(part, today, costs) is Way.TODAY
    # Blocks-first: one descriptor a block and layer instead of two; by index without a partial block.
    part, today = _split_of("blocks_first", shuffled, shuffled[::-1], full)
    assert part.posted <= today // 2 and choose(part, today, costs) is Way.BY_INDEX
    part, today = _split_of("blocks_first", shuffled, shuffled[::-1], tail)
    assert part.posted <= (today - 8) // 2 and choose(part, today, costs) is Way.STRIPS  # 8: the last block's pieces
    # Contiguous split K/V: one descriptor a region every way, from 32 indices a strip by index: today's.
    part, today = _split_of("split", list(range(32)), list(range(8, 40)), full)
    assert (part.posted, today) == (8, 8) and choose(part, today, costs) is Way.TODAY
    # Contiguous blocks-first: the dense strips' runs merge into one a layer, under today's one a block and
    # region; built for the request that is 4 descriptors, against 128 indices.
    part, today = _split_of("blocks_first", list(range(32)), list(range(8, 40)), full)
    assert (part.posted, today) == (4, 32 * 8) and choose(part, today, costs) is Way.STRIPS


def test_an_index_costs_more_than_a_descriptor_built_where_nixl_holds_lists_entry_by_entry() -> None:
    """NIXL 1.3 holds a list entry by entry: there a fragmented part of whole blocks is built for the request,
    from 1.4 (lists held as strides) it goes by index."""
    from kvpush.engine.by_index import costs_of
    from kvpush.transport.nixl_agent import index_cost_us

    assert index_cost_us("1.3.2") > BUILD_US >= index_cost_us("1.4.1") == index_cost_us("1.5.1")
    shuffled = list(np.random.default_rng(0).permutation(64)[:32])
    part, today = _split_of("blocks_first", shuffled, shuffled[::-1], 32 * 16)
    cfg = Config.of(plan="direct")
    assert choose(part, today, costs_of(cfg, "1.5.1")) is Way.BY_INDEX
    assert choose(part, today, costs_of(cfg, "1.3.2")) is Way.STRIPS


def test_lists_a_nixl_cannot_hold_are_refused() -> None:
    row = np.array([[1 << 20, 64, 0, 64, 1 << 22]], dtype=np.int64)
    assert list_fits(row, strided=False) and list_fits(row, strided=True)
    two = np.concatenate([row, row])
    assert not list_fits(two, strided=False) and list_fits(two, strided=True)
    assert not list_fits(np.array([[1, 64, 0, 64, 1 << 31]], dtype=np.int64), strided=True)
    assert not list_fits(np.zeros((0, 5), dtype=np.int64), strided=True)


# -- the agent's prepared lists and split WRITEs, with a stand-in for NIXL's agent object ---------------------


class _Inner:
    """NIXL's agent as far as the agent's lists and by-index WRITEs use it."""

    def __init__(self) -> None:
        self.prepared: list[tuple[str, tuple[int, ...], str]] = []
        self.released_lists: list[int] = []
        self.unloaded: list[str] = []
        self.sent: list[tuple[str, bytes]] = []
        self.made: list[tuple[int, int, bytes]] = []
        self.posted: list[Any] = []
        self.states: dict[int, list[str]] = {}
        self.released: list[Any] = []
        self.refuse = False

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return ["DRAM_SEG"]

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata.split(b":")[0]

    def remove_remote_agent(self, name: str) -> None:
        self.unloaded.append(name)

    def send_notif(self, name: str, msg: bytes) -> None:
        self.sent.append((name, msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def prep_xfer_dlist(self, name: str, rows: np.ndarray, mem: str) -> int:
        if self.refuse:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        self.prepared.append((name, rows.shape, mem))
        return len(self.prepared)

    def release_dlist_handle(self, handle: int) -> None:
        self.released_lists.append(handle)

    def make_prepped_xfer(self, op: str, lh: int, li: Any, rh: int, ri: Any, notif: bytes) -> object:
        self.made.append((lh, rh, notif))
        return object()

    def get_xfer_descs(self, rows: object, mem: str) -> object:
        return rows

    def initialize_xfer(self, *args: object) -> object:
        return object()

    def transfer(self, handle: object, notif: bytes = b"") -> str:
        self.posted.append(handle)
        return self.states.get(id(handle), ["PROC"]).pop(0) if self.states.get(id(handle)) else "PROC"

    def check_xfer_state(self, handle: object) -> str:
        left = self.states.get(id(handle))
        return left.pop(0) if left else "DONE"

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)


ROWS = np.array([[1 << 20, 64, 0, 128, 8], [1 << 24, 64, 0, 128, 8]], dtype=np.int64)


@pytest.mark.parametrize(("backend", "version"), [("UCX", "1.5.1"), ("UCX", "1.3.2"), ("LIBFABRIC", "1.4.1")])
def test_a_peers_list_lives_from_its_hello_to_its_give_up(backend: str, version: str) -> None:
    """A D rank's list is prepared once loaded and dropped as it is given up (declared dead, said hello again),
    whether or not the backend keeps its metadata loaded; each hello's list replaces any kept before, even one
    made from the same rows (a restarted peer's memory may sit at the same addresses); the agent's own list
    lives until close. A NIXL without strided lists is given one row per entry."""
    inner = _Inner()
    agent = Agent.over("P", inner, (backend,), version)
    strided = version >= "1.5"
    assert agent.strided_lists is strided
    assert agent.keep_list("", ROWS, "DRAM", "mine") and agent.kept("") == "mine"
    assert not agent.keep_list("D1", ROWS, "DRAM", "d1")  # not loaded
    agent.add_peer(b"D1:session1", "D1")
    assert agent.keep_list("D1", ROWS, "DRAM", "d1") and agent.kept("D1") == "d1"
    assert [p[1] for p in inner.prepared] == [(2, 5) if strided else (16, 3)] * 2
    assert inner.prepared[1][0] == "D1" and inner.prepared[0][0] == "NIXL_INIT_AGENT"
    assert agent.keep_list("D1", ROWS.copy(), "DRAM", "again") and agent.kept("D1") == "again"
    assert inner.released_lists == [2] and len(inner.prepared) == 3  # replaced, though made from equal rows
    agent.remove_peer("D1", 1.0)  # given up: the list goes even where the metadata stays loaded
    assert agent.kept("D1") is None and inner.released_lists == [2, 3]
    agent.add_peer(b"D1:session1", "D1")  # back (taken back where kept loaded): its hello prepares a list again
    assert agent.kept("D1") is None
    assert agent.keep_list("D1", ROWS, "DRAM", "back") and agent.kept("D1") == "back"
    agent.remove_peer("D1", 2.0)  # it restarted: said hello again (given up), then loads other metadata
    agent.add_peer(b"D1:session2", "D1")
    assert agent.kept("D1") is None and inner.released_lists == [2, 3, 4]
    inner.refuse = True
    assert not agent.keep_list("D1", ROWS, "DRAM", "refused") and agent.kept("D1") is None
    agent.close()
    assert agent.kept("") is None and inner.released_lists == [2, 3, 4, 1]


def test_a_by_index_write_carries_its_notification() -> None:
    inner = _Inner()
    agent = Agent.over("P", inner, ("UCX",), "1.5.1")
    agent.add_peer(b"D1:s", "D1")
    with pytest.raises(Exception, match="no prepared list"):
        agent.prepare_by_index("D1", np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int32), b"n")
    agent.keep_list("", ROWS, "DRAM", "mine")
    agent.keep_list("D1", ROWS, "DRAM", "d1")
    handle = agent.prepare_by_index("D1", np.arange(2, dtype=np.int32), np.arange(2, dtype=np.int32), b"n")
    assert inner.made == [(1, 2, b"n")] and agent.unreleased_writes() == 1
    assert agent.post(handle) is XferState.PROC and agent.state(handle) is XferState.DONE
    agent.release(handle)
    assert agent.unreleased_writes() == 0
