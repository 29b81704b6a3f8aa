"""P's staging slots: who holds each, when a push gets one, when a parked slot is taken back or freed (pure).

P's staging region lends slots (``kvpush.core.staging.SlotAllocator``, the
real allocator the engine made for its region) to two kinds of holder: a
push job with a staged plan, from its pairing to its ``Done``, and a parked
prefill packed at hand-over (``kvpush.prefill.prepack``: the ledger of
those), until a push claims its slot or the prefill ends. The rules:

* **hand-over** (``wants_pack``, ``park``): a finished prefill that no
  registration waits for is packed now only when staging should win
  (``prepack.packs_at_hand_over``, given the kind of the last plan made with
  a staging slot on both sides) and a slot within the parked share is free
  at once; a pack that fails to start gives its slot back;
* **pairing** (``pair``): a push whose D reserved a slot plans with the
  prefill's packed slot when that slot packed this very list and fits D's
  slot; otherwise the packed slot is dropped, and the push takes a free
  slot, taking back parked slots whose pack has ended, the oldest first,
  before it goes without (a direct plan: always correct, never a wait);
  a push whose D granted a ring (``kvpush.core.rounds``) takes a ring of
  P's own with slots of the same size, as many as are free up to D's count
  (one will do: P's packs then wait for its WRITEs), parked slots taken back
  first as above;
* **planned** (``planned``): a staged plan keeps its slot and claims the
  packed one (the job frees it at ``Done``: ``job_done``); any other plan
  gives its slot back, a packed one dropped;
* a slot whose pack at hand-over may still run is freed only once that
  pack's marker is reached (``poll``), never taken back before;
* every slot comes back exactly once: at its job's ``Done``, its prefill's
  end (``prefill_ended``), a pack that failed to start, or shutdown (``close``).

Events in, a list of actions out (the project's one driving protocol); no
clocks, no device, no NIXL: markers are opaque, and the caller says which
are reached. The engine carries out the actions (packs, counters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.config import Config
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import PlanKind
from kvpush.core.staging import FreeSlot, SlotAllocator
from kvpush.prefill.prepack import Prepack, Prepacks, packs_at_hand_over

# -- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackParked:
    """Pack the parked prefill ``transfer_id`` into the slot at ``offset`` (``size`` bytes) now; answer
    ``parked_packed`` once the pack is started, ``park_failed`` when it could not be."""

    transfer_id: str
    offset: int
    size: int


@dataclass(frozen=True)
class Evicted:
    """The slot parked prefill ``transfer_id`` packed at hand-over was taken back for a registered push."""

    transfer_id: str


@dataclass(frozen=True)
class Grant:
    """The push plans with (``pair``) or keeps (``planned``) the slot at ``offset``; ``prepack``: the pack at
    hand-over it took with the slot (``planned`` only; None: the job packs its parts itself); ``slots``: a
    ring of that many slots (0: one slot for the whole payload)."""

    offset: int
    prepack: Prepack | None = None
    slots: int = 0


@dataclass(frozen=True)
class PackEnded:
    """Parked prefill ``transfer_id``'s pack at hand-over is seen ended (its ``packed`` stage time)."""

    transfer_id: str


SlotAction = PackParked | Evicted | Grant | PackEnded


class StagingSlots:
    """Every slot of one P rank's staging region: free, a push's, a parked prefill's, or set aside."""

    def __init__(self, allocator: SlotAllocator, cfg: Config, layout: KVLayout, ledger: Prepacks | None = None) -> None:
        self.allocator = allocator
        self.cfg = cfg
        self.layout = layout
        self.ledger = ledger if ledger is not None else Prepacks(allocator.capacity)
        self.pushes: set[int] = set()  # slots granted to pushes (at pairing), until planned or their job's Done
        self.last_staging_plan: PlanKind | None = None
        """The kind of the last plan made with a staging slot on both sides (``prepack.packs_at_hand_over``)."""

    # -- queries -------------------------------------------------------------
    def gauges(self) -> dict[str, int]:
        """Slots held by parked prefills, and their bytes."""
        return {"parked_staging_slots": len(self.ledger), "parked_staging_bytes": self.ledger.held_bytes}

    @property
    def in_use(self) -> int:
        """Slots allocated: pushes', parked prefills', and those set aside until their pack ends."""
        return self.allocator.slots_in_use

    def markers(self) -> list[Any]:
        """Markers of packs at hand-over not known ended: the engine waits for them off its thread."""
        return self.ledger.markers()

    def wants_pack(self, pack: np.ndarray, blocks: np.ndarray, num_tokens: int, pack_bw: float) -> bool:
        """Should a parked prefill with this pack list be packed at hand-over (``prepack.packs_at_hand_over``)?
        Never for a hybrid layout, or with packs at hand-over turned off (``pack_at_hand_over``)."""
        if not self.cfg.staging.pack_at_hand_over or self.layout.hybrid:
            return False
        return packs_at_hand_over(self.cfg, self.layout, blocks, num_tokens, pack, pack_bw, self.last_staging_plan)

    # -- hand-over -----------------------------------------------------------
    def park(self, transfer_id: str, size: int) -> list[SlotAction]:
        """A parked prefill the rule packs (``wants_pack``, its KV orderable): a slot when the parked share
        admits one that is free at once."""
        if not self.ledger.admits(size) or (offset := self.allocator.alloc(size)) is None:
            return []
        return [PackParked(transfer_id, offset, size)]

    def parked_packed(self, transfer_id: str, prepack: Prepack) -> list[SlotAction]:
        """The asked ``PackParked`` started (``prepack.marker`` ends it): the prefill holds the slot."""
        self._free(self.ledger.hold(transfer_id, prepack))
        return []

    def park_failed(self, offset: int) -> list[SlotAction]:
        """The asked ``PackParked`` could not start: its slot comes back."""
        self.allocator.free(offset)
        return []

    def poll(self, is_reached: Callable[[Any], bool]) -> list[SlotAction]:
        """Note the packs at hand-over whose markers are reached; slots set aside behind them are freed."""
        before = {tid for tid, p in self.ledger.held() if not p.reached}
        self._free(self.ledger.reached(is_reached))
        return [PackEnded(tid) for tid, p in self.ledger.held() if tid in before and p.reached]

    def prefill_ended(self, transfer_id: str) -> list[SlotAction]:
        """The prefill is released (pushed, expired, aborted, D dead, re-issued): its parked slot is dropped."""
        self._free(self.ledger.drop(transfer_id))
        return []

    # -- pushes --------------------------------------------------------------
    def pair(
        self, transfer_id: str, want: int | None, ahead: np.ndarray | None, ring: tuple[int, int] | None = None
    ) -> list[SlotAction]:
        """A push is planned: ``want``, D's slot size when both sides could stage (None: they cannot);
        ``ahead``: the pack list built at hand-over the plan will use (None: none fits); ``ring``: D granted
        a ring of ``(slots, part_bytes)``. ``Grant``: plan with that slot (or ring); none: plan without
        staging."""
        held = self.ledger.get(transfer_id)
        if held is not None and not (want is not None and ring is None and ahead is held.pack and held.size <= want):
            self._free(self.ledger.drop(transfer_id))  # packed for a push this is not
            held = None
        if want is None:
            return []
        if held is not None:
            return [Grant(held.slot)]
        sizes = [(0, want)] if ring is None else [(k, k * ring[1]) for k in range(ring[0], 0, -1)]
        out: list[SlotAction] = []
        for k, size in sizes:
            while (offset := self.allocator.alloc(size)) is None and size <= self.allocator.capacity:
                victim = self.ledger.evictable()
                if victim is None:
                    break
                self._free(self.ledger.drop(victim))
                out.append(Evicted(victim))
            if offset is not None:
                self.pushes.add(offset)
                return [*out, Grant(offset, slots=k)]
        return out

    def planned(
        self, transfer_id: str, offset: int | None, kind: PlanKind, pack: np.ndarray | None
    ) -> list[SlotAction]:
        """The push's plan is made with the slot ``pair`` granted (``offset``; None: without one): ``Grant``, the
        job's slot (and the pack at hand-over it takes); none: the job has no slot (its plan is not staged)."""
        if offset is not None:
            self.last_staging_plan = kind  # what the next parked prefill's pack at hand-over goes by
        took = self.ledger.claim(transfer_id, pack) if kind is PlanKind.STAGED else None
        held = self.ledger.get(transfer_id)
        if held is not None and held.slot == offset:
            # The plan did not take the packed slot it was granted: it stays the prefill's until dropped here.
            self._free(self.ledger.drop(transfer_id))
            return []
        if offset is None:
            return []
        if kind not in (PlanKind.STAGED, PlanKind.ROUNDS):
            self.pushes.discard(offset)
            self.allocator.free(offset)
            return []
        self.pushes.add(offset)
        return [Grant(offset, took)]

    def plan_failed(self, transfer_id: str, offset: int | None) -> list[SlotAction]:
        """Planning failed (a registration P cannot write): a slot ``pair`` took for the push comes back; a
        packed one stays the prefill's until it ends."""
        if offset is not None and offset in self.pushes:
            self.pushes.discard(offset)
            self.allocator.free(offset)
        return []

    def job_done(self, offset: int | None) -> list[SlotAction]:
        """A push job is over: its slot (a claimed packed one too) comes back."""
        if offset is not None:
            self.pushes.discard(offset)
            self.allocator.free(offset)
        return []

    def close(self) -> list[SlotAction]:
        """Shutdown, once every pack at hand-over has ended (the engine waited for ``markers``): parked and
        set-aside slots come back (pushes' slots end with their jobs)."""
        self._free(self.ledger.drop_all())
        return []

    def _free(self, frees: list[FreeSlot]) -> None:
        for f in frees:
            self.allocator.free(f.offset)
