"""Staging in rounds: a push of any size through a small ring of staging slots (pure, shared by P and D).

A staged push packs the request's bytes into one staging slot, one WRITE
moves them, D unpacks: few large WRITEs, which is what every transport
does best. A slot holding the whole payload does not scale (a 32k-token
prompt of an 8B model is gigabytes), so a push larger than a ring goes
through a *ring*: D grants ``slots`` slots of ``part_bytes`` each
(``protocol.StagingGrant``), P cuts the payload into *parts* of at most
``part_bytes`` and writes part ``j`` into slot ``j % slots``; D unpacks each
part as it lands and *credits* it (``protocol.Credit``); P posts part ``j``
only once parts ``[0, j - slots]`` are credited, so a slot is written again
only after D has emptied it. P packs the next part while one is on the wire
and D unpacks the one before: pack, wire and unpack overlap.

The payload is region-major (``kvpush.core.payload``): each region's stream
of ``region_bytes`` bytes, one region after the other. A part is a *tile* of
it: regions ``[r0, r1)`` and, of each, stream bytes ``[q0, q1)``; in the slot,
region ``r0``'s bytes then ``r0 + 1``'s and so on, which is exactly what a
backend's ``pack(bases[r0:r1], slice_pieces(pack, q0, q1), slot)`` writes and
``unpack`` reads back, so backends need nothing new. Both sides derive the
same cut from the grant and the region size (``cut_tiles``): a part is a
number of whole regions when a region fits a slot, else a chunk of one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

RING_MIN_PART_BYTES = 64 << 10
"""The smallest part a ring is granted with: far below it a part's fixed costs (its post, notification,
unpack launch and credit) outweigh its bytes on every transport; a D whose region cannot spare two such
slots grants none (the push goes direct)."""
CUT_ALIGN = 512
"""Chunks of one region are cut at multiples of this many bytes of its stream (device copies vectorise)."""


@dataclass(frozen=True)
class Tile:
    """One part of a push in rounds: regions ``[r0, r1)``, stream bytes ``[q0, q1)`` of each."""

    r0: int
    r1: int
    q0: int
    q1: int

    @property
    def nbytes(self) -> int:
        return (self.r1 - self.r0) * (self.q1 - self.q0)


@dataclass(frozen=True)
class Ring:
    """The ring a push in rounds goes through, as both sides see it.

    ``part_bytes``: each slot's size; ``d_slots``: D's slots (the grant's); ``p_slots``: P's own (P packs
    part ``j`` into its slot ``j % p_slots``, reused once part ``j - p_slots``'s WRITE has ended: P needs no
    credit for its own slots); ``tiles``: the parts, in order.
    """

    part_bytes: int
    d_slots: int
    p_slots: int
    tiles: tuple[Tile, ...]

    @property
    def parts(self) -> int:
        return len(self.tiles)

    def d_offset(self, j: int) -> int:
        """Where part ``j`` lands in D's ring (from its start)."""
        return (j % self.d_slots) * self.part_bytes

    def p_offset(self, j: int) -> int:
        """Where part ``j`` is packed in P's ring (from its start)."""
        return (j % self.p_slots) * self.part_bytes

    def may_post(self, j: int, credited: int) -> bool:
        """Part ``j`` may be written once D has credited every part before ``j - d_slots + 1``: its slot is
        then empty (D unpacked the part that was there)."""
        return j < credited + self.d_slots

    def slices(self) -> dict[tuple[int, int], None]:
        """The distinct stream ranges ``(q0, q1)`` of the tiles, in order (a side slices its list once per range)."""
        return dict.fromkeys((t.q0, t.q1) for t in self.tiles)


def cut_tiles(nregions: int, region_bytes: int, part_bytes: int) -> tuple[Tile, ...]:
    """The parts of a payload of ``nregions`` regions of ``region_bytes`` each, through slots of ``part_bytes``.

    Whole regions, as many as fit a slot, when a region fits one; otherwise each region in the fewest
    chunks of at most ``part_bytes`` (cut at ``CUT_ALIGN``, as even as that allows). Every byte of the
    payload is in exactly one tile, and no tile is larger than a slot.
    """
    if nregions <= 0 or region_bytes <= 0:
        return ()
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    if region_bytes <= part_bytes:
        k = part_bytes // region_bytes
        return tuple(Tile(r, min(r + k, nregions), 0, region_bytes) for r in range(0, nregions, k))
    if part_bytes < CUT_ALIGN:
        raise ValueError(f"part_bytes {part_bytes} below the cut alignment {CUT_ALIGN} cannot hold a chunk")
    n = -(-region_bytes // part_bytes)
    while True:
        chunk = -(-region_bytes // n)
        chunk = -(-chunk // CUT_ALIGN) * CUT_ALIGN
        if chunk <= part_bytes:
            break
        n += 1
    cuts = [min(i * chunk, region_bytes) for i in range(n + 1)]
    bounds = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return tuple(Tile(r, r + 1, a, b) for r in range(nregions) for a, b in bounds)


def make_ring(nregions: int, region_bytes: int, part_bytes: int, d_slots: int, p_slots: int) -> Ring:
    """The ring of a push: its geometry and its cut (``cut_tiles``)."""
    if d_slots < 1 or p_slots < 1:
        raise ValueError(f"a ring needs a slot on each side, got {d_slots} on D and {p_slots} on P")
    return Ring(part_bytes, d_slots, p_slots, cut_tiles(nregions, region_bytes, part_bytes))


def ring_sizes(slots: int, part_bytes: int) -> list[tuple[int, int]]:
    """The rings D tries to grant, as ``(slots, part_bytes)``, the preferred first: ``slots`` slots of
    ``part_bytes`` (aligned), then of half as much, down to ``RING_MIN_PART_BYTES``, then two of the
    smallest.

    Halving rather than refusing: under many concurrent pushes each gets a smaller ring (more parts, each
    with its fixed costs), never the direct plan a fragmented push pays per descriptor.
    """
    part = _align(max(part_bytes, 1))
    out = [(slots, part)]
    while part > RING_MIN_PART_BYTES:
        part = max(RING_MIN_PART_BYTES, _align(part // 2))
        out.append((slots, part))
    if slots > 2:
        out.append((2, part))
    return out


def _align(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


def slice_pieces(pieces: np.ndarray, q0: int, q1: int) -> np.ndarray:
    """The ``(offset, length)`` pieces moving stream bytes ``[q0, q1)`` of a region, from a side's list of the
    whole stream (``pieces`` in stream order, as ``payload.pack_pieces``/``unpack_pieces`` make them): the
    pieces that overlap, the first and last trimmed. The whole list itself when the range is all of it."""
    if pieces.shape[0] == 0:
        return pieces
    lens = pieces[:, 1]
    ends = np.cumsum(lens)
    if q0 == 0 and q1 >= int(ends[-1]):
        return pieces
    starts = ends - lens
    i0 = int(np.searchsorted(ends, q0, side="right"))
    i1 = int(np.searchsorted(starts, q1, side="left"))
    out = pieces[i0:i1].copy()
    if out.shape[0] == 0:
        return out
    head = q0 - int(starts[i0])
    out[0, 0] += head
    out[0, 1] -= head
    tail = int(ends[i1 - 1]) - q1
    if tail > 0:
        out[-1, 1] -= tail
    return out
