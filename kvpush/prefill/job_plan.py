"""What a push job is given when it starts: its plan and how its parts are cut, or the pack made at hand-over.

A ``PushJob`` (``kvpush.prefill.push_job``) is decided by the rendezvous
and then told, once, what to write and how: the plan of the transfer
(direct or staged, its regions and their bytes), how a run of ready regions
is cut into parts and when they are due (``JobPlan``), and, when P packed
the job's staging slot at hand-over (``kvpush.prefill.prepack``), that pack
(``Prepacked``). These are values, fixed for the job's life, kept apart
from the job's state machine so the engine that builds them and the tests
that vary them read them without the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.core.outcome import PlanKind
from kvpush.core.parts import MIN_PART_BYTES, PartCosts, PartSchedule, part_count
from kvpush.core.plan import Plan


@dataclass(frozen=True)
class Prepacked:
    """The job's slot was packed at hand-over (``kvpush.prefill.prepack``): ``marker`` ends that pack, queued behind
    the KV's ``after`` (None: reached). Every part of the job comes from it; the job starts no pack."""

    marker: Any
    after: Any


@dataclass(frozen=True)
class JobPlan:
    """A job's plan and how its parts are cut and scheduled.

    ``push_parts``: most parts a staged run of ready regions is cut into, each
    at least ``min_part_bytes``, as many as ``costs`` says is fastest
    (``parts.part_count``; None: the most); ``chain``: the backend queues packs behind the KV's
    marker on the device, so a staged job need not see the marker reached.
    """

    plan: Plan
    schedule: PartSchedule
    push_parts: int = 1
    chain: bool = False
    min_part_bytes: int = MIN_PART_BYTES
    costs: PartCosts | None = None
    slices: dict[tuple[int, int], Any] | None = None
    """A push in rounds: P's pack list cut to each stream range its parts take (``rounds.slice_pieces``), made
    once per job (and, being the same objects for every part of a range, handed to the backend as such)."""

    @property
    def kind(self) -> PlanKind:
        return self.plan.kind

    @property
    def nregions(self) -> int:
        return self.plan.nregions

    @property
    def region_bytes(self) -> int:
        return self.plan.region_bytes

    def parts(self, nregions: int) -> int:
        """How many WRITEs a run of ``nregions`` ready regions is cut into."""
        if self.kind is not PlanKind.STAGED:
            return 1
        return part_count(self.push_parts, nregions * self.region_bytes, self.min_part_bytes, self.costs)
