"""How a push is cut into parts, and when each part is posted (pure, shared).

A *part* is a contiguous range of regions posted as one WRITE with its own
notification. P cuts a staged push into parts to pipeline it (pack, wire and
unpack overlap) and posts a layer-wise push part by part as the forward writes
its layers; D applies the same rule to guess P's cut when it prepares its
unpacks, which is why the rule is shared.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from kvpush.config import Config
from kvpush.core.layout import KVLayout

MIN_PART_BYTES = 16 << 20
"""The default of ``staging.min_part_bytes``: a staged push is pipelined only in parts at least this large."""


@dataclass(frozen=True)
class PartCosts:
    """What the part count is chosen from: the stages' throughputs and what each part costs on top.

    ``pack_bps``, ``wire_bps``, ``unpack_bps``: bytes per second of P's pack,
    the link and D's unpack; ``part_s``: the fixed host cost one more part
    adds (its post, its notification, its unpack's launch), paid in series;
    ``pack_overlaps``: P's packs run beside its posts (an asynchronous copy
    backend), not on the thread that posts.
    """

    pack_bps: float
    wire_bps: float
    unpack_bps: float
    part_s: float
    pack_overlaps: bool = True

    def stages(self, nbytes: int) -> tuple[float, ...]:
        """Seconds of each pipelined stage for ``nbytes`` in one part (stages that share a thread merged)."""
        pack, wire, unpack = (nbytes / max(bps, 1.0) for bps in (self.pack_bps, self.wire_bps, self.unpack_bps))
        return (pack, wire, unpack) if self.pack_overlaps else (pack + wire, unpack)

    def seconds(self, nbytes: int, parts: int) -> float:
        """The model's time for ``nbytes`` in ``parts`` equal parts: the first part through every stage,
        then one part per slowest stage, plus each part's fixed cost."""
        stages = self.stages(nbytes)
        k = max(1, parts)
        return sum(stages) / k + (k - 1) * max(stages) / k + k * self.part_s


def part_count(
    push_parts: int, nbytes: int, min_part_bytes: int = MIN_PART_BYTES, costs: PartCosts | None = None
) -> int:
    """How many WRITEs a staged push of ``nbytes`` is cut into.

    At most ``push_parts``, each at least ``min_part_bytes``; within that,
    the count the cost model (``costs``) says is fastest, the fewest on a tie,
    so more parts are chosen only where their overlap saves more than their
    fixed costs add (without ``costs``: the most allowed). D uses the same
    rule to guess P's cut when it prepares its unpacks.
    """
    most = max(1, min(push_parts, nbytes // max(1, min_part_bytes)))
    if costs is None:
        return most
    return min(range(1, most + 1), key=lambda k: (costs.seconds(nbytes, k), k))


def costs_of(cfg: Config, copy_bps: float, pack_overlaps: bool) -> PartCosts:
    """The cost model's inputs from the configuration and this side's backend (``copy_bps``: its pack
    bandwidth, taken for the other side's unpack or pack too: P and D usually run one device kind)."""
    st = cfg.staging
    return PartCosts(copy_bps, st.link_gbps * 1e9, copy_bps, st.part_cost_us * 1e-6, pack_overlaps)


def cut(cfg: Config, nbytes: int, costs: PartCosts | None) -> int:
    """``part_count`` with the configuration's bounds."""
    return part_count(cfg.staging.push_parts, nbytes, cfg.staging.min_part_bytes, costs)


@dataclass(frozen=True)
class PartSchedule:
    """When a push whose layers become ready one by one posts its parts, and with which layers.

    Ready layers are held back until at most ``lead_layers`` layers are left
    to compute: KV leaving P while the forward runs slows the forward when it
    is sent layer by layer, but not when sent in one burst during the last
    layers, so the push starts as late as still lets it finish with the
    forward (measurements: docs/cuda.md, "Engine defaults"). From then on, layers
    are grouped until a part holds ``min_part_bytes`` (a part's fixed host
    costs stay small next to its bytes). The group is also posted when one
    layer is left: then the last part, the only one whose pack, WRITE and
    unpack are not hidden behind the forward, is a single layer. A whole
    request reported ready at once is one part.

    ``layer_ends[i]`` is how many leading regions hold layers ``0..i``
    (``KVLayout.regions_through``); positions are counted in regions.
    """

    layer_ends: tuple[int, ...]
    region_bytes: int
    min_part_bytes: int
    lead_layers: int

    @classmethod
    def of(cls, layout: KVLayout, region_bytes: int, min_part_bytes: int, lead_layers: int) -> PartSchedule:
        ends = tuple(layout.regions_through(i) for i in range(layout.num_layers))
        return cls(ends, region_bytes, min_part_bytes, lead_layers)

    @property
    def total(self) -> int:
        return self.layer_ends[-1] if self.layer_ends else 0

    def layers_left(self, ready: int) -> int:
        """Layers not completely among the first ``ready`` regions."""
        return len(self.layer_ends) - bisect.bisect_right(self.layer_ends, ready)

    def part_end(self, sent: int, ready: int) -> int:
        """Where a part posted now ends, regions ``[0, ready)`` being ready; ``sent`` means: hold them back."""
        if ready <= sent:
            return sent
        left = self.layers_left(ready)
        if left <= 1:
            return ready
        if left <= self.lead_layers and (ready - sent) * self.region_bytes >= self.min_part_bytes:
            return ready
        return sent

    def wake_at(self, sent: int) -> int:
        """The fewest ready regions (a layer end) with which ``part_end`` posts a part after ``sent``.

        The forward reports every layer; only these reports can start a part,
        so only they need to wake the push thread (a wake-up takes the GIL
        from the forward's launches: ``Sender.layer_written``).
        """
        ends, n = self.layer_ends, len(self.layer_ends)
        if not n:
            return 0
        first = bisect.bisect_right(ends, sent)
        if self.min_part_bytes <= 0:
            by_bytes = first
        elif self.region_bytes <= 0:
            by_bytes = n  # no part ever holds enough bytes: only the one-layer-left rule posts
        else:
            by_bytes = bisect.bisect_left(ends, sent + -(-self.min_part_bytes // self.region_bytes))
        i = max(first, min(n - 2, max(by_bytes, n - 1 - self.lead_layers)))
        return ends[min(i, n - 1)]


def split_regions(r0: int, r1: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``[r0, r1)`` into at most ``parts`` contiguous ranges, the first and last half as large.

    In a pipelined staged push the first part's pack and the last part's
    unpack are not overlapped by anything (the wire waits for the first, D's
    result for the last), so they are made small; the middle parts hide
    behind the wire.
    """
    n = r1 - r0
    k = max(1, min(parts, n))
    weights = [1.0] * k if k <= 2 else [1.0] + [2.0] * (k - 2) + [1.0]
    total = sum(weights)
    cuts = [r0 + round(n * sum(weights[:i]) / total) for i in range(k + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
