"""Direct parts posted by index into NIXL's prepared descriptor lists, or built per strip (pure).

A direct WRITE can name its bytes two ways. *Built for the request* (today's
way, ``plan.part_descriptors``): one (address, length, device) row per
coalesced piece and region, which NIXL turns into a descriptor list and checks
against the registrations on every WRITE. *By index*: NIXL prepares a list once
(``prep_xfer_dlist``) over every block of every strip, for P's own KV when it
is registered and for a D rank's when that rank's metadata is loaded, and a
WRITE then names entries of both lists by position (``make_prepped_xfer``).
Nothing of the lists is built per request; what a by-index WRITE still costs is
its indices and, as for any WRITE, the transport's post of each descriptor,
which is most of a post (docs/benchmarks-log.md, section 15).

**Granularity: one entry per block of a strip.** A *strip* is a run of
consecutive regions of one layer whose blocks sit back to back in memory: K and
V of a layer in a blocks-first cache (``[blocks, 2, tokens, heads, dim]``), where
region V's block ``b`` starts where region K's block ``b`` ends. One entry
covers the whole strip's share of a block, so such a cache posts one descriptor
per block and layer where one per region posts two (a region of its own is a
strip of one). NIXL merges entries named one after the other when they are
consecutive in a dense list (a strip whose block stride is its entry's length,
on both sides), so a run of contiguous blocks still posts one descriptor.

**Which pairs.** Both sides hold the same tokens and heads of a block in the same
order (equal block size, order, head slice and head size) and cut their regions
into the same strips; both are written in place (``KVLayout.direct``) and hold
one KV-cache group of attention KV (a hybrid layout's groups have their own
pieces). Then a whole block of P is a whole block of D byte for byte. Other
pairs (a TP or block-size difference) keep today's path.

**Which pieces.** A piece that is whole blocks on both sides can be named by
index. One that is not (a request's partial last block, a first block D partly
holds) cannot: its bytes are a prefix or suffix of an entry, and writing the
whole entry would overwrite bytes D holds or carry bytes P never computed for
this request. A part with such pieces is therefore one WRITE built for the
request, its whole blocks at the strips' granularity (``strip_descriptors``):
never two WRITEs, because D takes a part's notification to mean all its bytes
are in place, and NIXL orders a notification only after the bytes of the WRITE
that carries it (over LIBFABRIC a WRITE that ended on P may still be landing on
D).

**Which way** (``choose``): the cheapest of today's WRITE, the strips' WRITE
built for the request and (a part of whole blocks only) the WRITE by index,
under the transport's per-descriptor cost plus the host work of a descriptor
built for the request or of an index. A fragmented part of whole blocks goes by
index; a contiguous one (few descriptors from many indices) is built for the
request; strips win wherever they merge a layer's K and V.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from kvpush.core.layout import KVLayout
from kvpush.core.outcome import PlanKind
from kvpush.core.pieces import descriptors, merge_descriptors
from kvpush.core.plan import Plan

BUILD_US = 0.05
"""Host work per descriptor of a WRITE built for the request, besides its post: its row made absolute and
handed to NIXL, which makes it a descriptor and checks it against the registrations (docs/benchmarks-log.md,
section 15)."""
INDEX_US = 0.02
"""Host work per index of a by-index WRITE: the index computed and its entry read from NIXL's prepared list,
where NIXL holds a list as strides (NIXL 1.4 and later: a few rows a list, always in cache)."""
INDEX_US_ENTRIES = 0.06
"""The same where NIXL holds a list entry by entry (before 1.4): each index reads an entry of a list far larger
than the cache, which costs more than building the descriptor (docs/benchmarks-log.md, section 15)."""
MAX_EXPANDED_ENTRIES = 1 << 22
"""Most entries of a prepared list given to NIXL row by row (a NIXL without strided lists holds each entry);
a KV cache with more keeps today's path. NIXL's strided form (one row per strip) has no such bound."""


@dataclass(frozen=True)
class Strips:
    """A layout's regions cut into strips: strip ``i`` is regions ``[bounds[i], bounds[i + 1])``."""

    bounds: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def index_of(self, region: int) -> int | None:
        """The strip starting at ``region`` (the number of strips for the region count), None mid-strip."""
        try:
            return self.bounds.index(region)
        except ValueError:
            return None


def strips_of(layout: KVLayout) -> Strips:
    """Consecutive regions of one layer and device join a strip while each starts where the previous one's
    block ends and the strip's share of a block still fits in the block stride (entries never overlap)."""
    bb, bounds = layout.block_bytes, [0]
    regions = layout.regions
    for i in range(1, len(regions)):
        first = regions[bounds[-1]]
        width = i - bounds[-1]
        joins = (
            regions[i].layer == first.layer
            and regions[i].device_id == first.device_id
            and regions[i].base == first.base + width * bb
            and (width + 1) * bb <= layout.block_stride
        )
        if not joins:
            bounds.append(i)
    bounds.append(len(regions))
    return Strips(tuple(bounds))


def list_rows(layout: KVLayout, strips: Strips) -> np.ndarray:
    """A side's prepared list in NIXL's strided form: one row per strip, (first entry's address, entry bytes,
    device, block stride, blocks). Entry ``i * num_blocks + b`` is strip ``i``'s share of block ``b``."""
    rows = np.empty((strips.count, 5), dtype=np.int64)
    for i in range(strips.count):
        first = layout.regions[strips.bounds[i]]
        width = strips.bounds[i + 1] - strips.bounds[i]
        rows[i] = (first.base, width * layout.block_bytes, first.device_id, layout.block_stride, layout.num_blocks)
    return rows


def expand(rows: np.ndarray) -> np.ndarray:
    """The same list one (address, bytes, device) row per entry, in entry order (for a NIXL without strided
    lists)."""
    counts = rows[:, 4]
    strip = np.repeat(np.arange(rows.shape[0]), counts)
    block = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((strip.size, 3), dtype=np.int64)
    out[:, 0] = rows[strip, 0] + block * rows[strip, 3]
    out[:, 1] = rows[strip, 1]
    out[:, 2] = rows[strip, 2]
    return out


def list_fits(rows: np.ndarray, strided: bool) -> bool:
    """Whether NIXL can hold this list: indices are 32-bit, and a list given row by row has at most
    ``MAX_EXPANDED_ENTRIES``."""
    entries = int(rows[:, 4].sum()) if rows.size else 0
    return 0 < entries < (1 << 31) and (strided or entries <= MAX_EXPANDED_ENTRIES)


@dataclass(frozen=True)
class IndexedPair:
    """A P layout and a D layout whose direct parts can go by index, the strips both cut into, and both
    sides' prepared lists (strided form)."""

    src: KVLayout
    dst: KVLayout
    strips: Strips
    local_rows: np.ndarray
    remote_rows: np.ndarray

    @property
    def dense(self) -> bool:
        """Each side's entries tile its strips (block stride = entry bytes): NIXL merges consecutive entries."""
        return bool((self.local_rows[:, 1] == self.local_rows[:, 3]).all()) and bool(
            (self.remote_rows[:, 1] == self.remote_rows[:, 3]).all()
        )


def pair_of(src: KVLayout, dst: KVLayout) -> IndexedPair | None:
    """The by-index pairing of P's layout ``src`` with D's ``dst``; None where a whole block of one is not a
    whole block of the other byte for byte, or their strips differ (today's path then)."""
    same = (
        src.direct
        and dst.direct
        and not src.hybrid
        and not dst.hybrid
        and src.order == dst.order
        and src.block_size == dst.block_size
        and src.head_bytes == dst.head_bytes
        and src.head_start == dst.head_start
        and src.local_heads == dst.local_heads
        and len(src.regions) == len(dst.regions)
    )
    if not same:
        return None
    strips = strips_of(src)
    if strips_of(dst) != strips:
        return None
    return IndexedPair(src, dst, strips, list_rows(src, strips), list_rows(dst, strips))


@dataclass(frozen=True)
class Split:
    """One direct part ``[r0, r1)`` (strips ``[s0, s1)``) cut into the blocks named by index and the rest.

    ``src_blocks``/``dst_blocks``: P's and D's block of each whole block, in post order (the same in every
    strip); ``rest``: the pieces (relative to region bases) that are not whole blocks; ``runs``: descriptors
    NIXL posts per strip for the whole blocks once it merged consecutive entries.
    """

    r0: int
    r1: int
    s0: int
    s1: int
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    rest: np.ndarray
    runs: int

    @property
    def indices(self) -> int:
        """Entries the by-index WRITE names on each side."""
        return self.src_blocks.size * (self.s1 - self.s0)

    @property
    def posted(self) -> int:
        """Descriptors the by-index WRITE posts (NIXL merges consecutive entries of a dense list)."""
        return self.runs * (self.s1 - self.s0)

    @property
    def rest_count(self) -> int:
        """Descriptors of the WRITE built for the rest (at most; cross-region merges can only lower it)."""
        return self.rest.shape[0] * (self.r1 - self.r0)


def split(pair: IndexedPair, plan: Plan, r0: int, r1: int) -> Split | None:
    """Cut part ``[r0, r1)`` of a direct plan between ``pair``'s layouts; None where it cannot go by index (not
    a direct single-group plan, or the part starts or ends inside a strip)."""
    if plan.kind is not PlanKind.DIRECT or plan.group_merged or not 0 <= r0 < r1 <= plan.nregions:
        return None
    s0, s1 = pair.strips.index_of(r0), pair.strips.index_of(r1)
    if s0 is None or s1 is None:
        return None
    src, dst = pair.src, pair.dst
    so, do, ln = plan.merged[:, 0], plan.merged[:, 1], plan.merged[:, 2]
    bb = src.block_bytes
    whole = (so % src.block_stride == 0) & (do % dst.block_stride == 0) & (ln % bb == 0) & (ln > 0)
    # A whole piece of several blocks was coalesced from blocks adjacent on both sides: consecutive ids there.
    count = ln[whole] // bb
    first = np.cumsum(count) - count
    step = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
    src_blocks = np.repeat(so[whole] // src.block_stride, count) + step
    dst_blocks = np.repeat(do[whole] // dst.block_stride, count) + step
    if src_blocks.size and pair.dense:
        joins = (src_blocks[1:] == src_blocks[:-1] + 1) & (dst_blocks[1:] == dst_blocks[:-1] + 1)
        runs = src_blocks.size - int(joins.sum())
    else:
        runs = int(src_blocks.size)
    return Split(r0, r1, s0, s1, src_blocks, dst_blocks, plan.merged[~whole], runs)


def today_suffices(pair: IndexedPair, plan: Plan) -> bool:
    """Whether today's WRITE is the cheapest for every part of ``plan`` without cutting any: each strip is one
    region (the strips' rows are today's) and some piece is not whole blocks (no part goes by index). Checked
    before ``split``, whose work such a plan would only waste on the path to the post."""
    if pair.strips.count != len(pair.src.regions):
        return False
    so, do, ln = plan.merged[:, 0], plan.merged[:, 1], plan.merged[:, 2]
    whole = (so % pair.src.block_stride == 0) & (do % pair.dst.block_stride == 0) & (ln % pair.src.block_bytes == 0)
    return not bool(whole.all())


def indices(pair: IndexedPair, part: Split) -> tuple[np.ndarray, np.ndarray]:
    """The part's entries of P's and D's prepared lists (int32), strip by strip, each strip's blocks in post
    order, so that consecutive entries stand next to each other and NIXL merges them."""
    strips = np.arange(part.s0, part.s1, dtype=np.int64)
    local = (strips[:, None] * pair.src.num_blocks + part.src_blocks[None, :]).ravel()
    remote = (strips[:, None] * pair.dst.num_blocks + part.dst_blocks[None, :]).ravel()
    return local.astype(np.int32), remote.astype(np.int32)


def rest_descriptors(pair: IndexedPair, part: Split) -> tuple[np.ndarray, np.ndarray]:
    """Absolute (address, bytes, device) rows of the pieces that are not whole blocks, for the WRITE built for
    the request: as ``plan.part_descriptors`` builds them, for those pieces only."""
    return merge_descriptors(*descriptors(part.rest, pair.src, pair.dst, part.r0, part.r1))


def strip_descriptors(pair: IndexedPair, part: Split) -> tuple[np.ndarray, np.ndarray]:
    """Absolute (address, bytes, device) rows of the part for one WRITE built for the request: the whole blocks
    as the strips' entries (the rows of what ``indices`` names), merged where adjacent on both sides, then
    the rest as ``rest_descriptors``."""
    rows = []
    for side_rows, blocks in ((pair.local_rows, part.src_blocks), (pair.remote_rows, part.dst_blocks)):
        strips = side_rows[part.s0 : part.s1]
        out = np.empty((strips.shape[0] * blocks.size, 3), dtype=np.int64)
        out[:, 0] = (strips[:, 0:1] + blocks[None, :] * strips[:, 3:4]).ravel()
        out[:, 1] = np.repeat(strips[:, 1], blocks.size)
        out[:, 2] = np.repeat(strips[:, 2], blocks.size)
        rows.append(out)
    local, remote = merge_descriptors(rows[0], rows[1])
    rl, rr = rest_descriptors(pair, part)
    return np.concatenate([local, rl]), np.concatenate([remote, rr])


class Way(enum.Enum):
    """How a direct part's WRITE is made: today's rows (``plan.part_descriptors``), the strips' rows built for
    the request (``strip_descriptors``), or by index into the prepared lists (``indices``)."""

    TODAY = "today"
    STRIPS = "strips"
    BY_INDEX = "by_index"


@dataclass(frozen=True)
class PostCosts:
    """What a WRITE costs P's thread, in seconds: the transport's post per descriptor (``descriptor_s``), and
    besides it per descriptor built for the request (``build_s``) or per index (``index_s``)."""

    descriptor_s: float
    index_s: float = INDEX_US * 1e-6
    build_s: float = BUILD_US * 1e-6


def choose(part: Split, today: int, costs: PostCosts) -> Way:
    """The cheapest way to post ``part``, against today's WRITE of ``today`` descriptors; a tie keeps today's.
    By index needs every piece whole (``part.rest`` empty)."""
    built = costs.build_s + costs.descriptor_s
    cost = {Way.TODAY: today * built, Way.STRIPS: (part.posted + part.rest_count) * built}  # ties: the first
    if part.indices and not part.rest.shape[0]:
        cost[Way.BY_INDEX] = part.indices * costs.index_s + part.posted * costs.descriptor_s
    return min(cost, key=cost.__getitem__)
