"""P's pack at hand-over: a parked prefill packed into a staging slot before any registration (pure).

Behind a sequential router D registers only after P's prefill finished, and
the staged payload follows P's own block order (``kvpush.core.payload``), so P can
pack it while the prefill is parked; the push at pairing then only plans D's
side and posts. This ledger keeps the rules about the slots such packs hold:

* a parked prefill takes a slot only when one is free at once, and only
  within ``PARKED_SHARE`` of P's staging bytes (or as the only parked slot,
  of any size: a staging region sized for one large request still serves
  the sequential order);
* a push whose D has registered (its pack is on a request's path now, a
  parked one's maybe never) that finds no free slot takes back parked slots,
  the oldest first (``evictable``), before it falls back to a direct plan;
* the slot is the parked prefill's until a push claims it (it then goes with
  that push's job, freed at its ``Done``) or the prefill ends unclaimed (paired
  with a direct plan, lease expiry, abort, D dead, shutdown): then it is freed;
* a slot whose pack may still be running is not freed until the pack's marker
  is reached (the device may still be writing it), only set aside (*draining*).

No clocks, no device: markers are opaque, and the caller says which are reached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.config import Config
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import PlanKind
from kvpush.core.payload import block_runs
from kvpush.core.plan import estimate
from kvpush.core.staging import FreeSlot

PARKED_SHARE = 0.5
"""Most of P's staging bytes that slots held by parked prefills may take."""


@dataclass
class Prepack:
    """A parked prefill's pack: its slot, the list it packed, the KV marker it is queued behind, its own marker."""

    slot: int
    size: int
    pack: np.ndarray
    after: Any
    marker: Any
    reached: bool = False  # the pack is known to have ended (a synchronous pack: at once)


class Prepacks:
    """Slots held by parked prefills, by transfer id, and slots set aside until their pack ends."""

    def __init__(self, capacity: int, share: float = PARKED_SHARE) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share of staging for parked prefills must be in [0, 1], got {share}")
        self.limit = int(capacity * share)
        self._held: dict[str, Prepack] = {}
        self._draining: list[tuple[int, Any]] = []

    # -- queries -------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        return sum(p.size for p in self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    @property
    def draining(self) -> int:
        return len(self._draining)

    def admits(self, size: int) -> bool:
        """May a parked prefill take a slot of ``size`` bytes (within the parked share, or as the only one)?"""
        return size > 0 and (not self._held or self.held_bytes + size <= self.limit)

    def evictable(self) -> str | None:
        """The parked prefill whose slot a registered push takes back first: the oldest whose pack has ended."""
        return next((tid for tid, p in self._held.items() if p.reached), None)

    def get(self, transfer_id: str) -> Prepack | None:
        return self._held.get(transfer_id)

    def held(self) -> list[tuple[str, Prepack]]:
        return list(self._held.items())

    def markers(self) -> list[Any]:
        """Markers of packs not known ended (held or draining): the engine waits for them off its thread."""
        held = [p.marker for p in self._held.values() if not p.reached and p.marker is not None]
        return held + [m for _, m in self._draining if m is not None]

    # -- events --------------------------------------------------------------
    def hold(self, transfer_id: str, prepack: Prepack) -> list[FreeSlot]:
        """A parked prefill packed into ``prepack.slot`` (the caller allocated it after ``admits``).

        A transfer holds one slot: an older one (a re-issued prefill) is dropped first.
        """
        out = self.drop(transfer_id)
        if prepack.marker is None:
            prepack.reached = True
        self._held[transfer_id] = prepack
        return out

    def reached(self, is_reached: Callable[[Any], bool]) -> list[FreeSlot]:
        """Note the packs whose markers are reached; the draining slots among them are freed."""
        for p in self._held.values():
            if not p.reached and is_reached(p.marker):
                p.reached = True
        keep, out = [], []
        for slot, marker in self._draining:
            if marker is None or is_reached(marker):
                out.append(FreeSlot(slot))
            else:
                keep.append((slot, marker))
        self._draining = keep
        return out

    def claim(self, transfer_id: str, pack: np.ndarray | None) -> Prepack | None:
        """A push takes the prefill's packed slot if it planned with that very list (its job frees it);
        else None, and the slot stays the prefill's (``drop`` ends it)."""
        p = self._held.get(transfer_id)
        if p is None or pack is None or pack is not p.pack:
            return None
        return self._held.pop(transfer_id)

    def drop(self, transfer_id: str) -> list[FreeSlot]:
        """The prefill's slot is not needed any more: free it now, or once its pack has ended."""
        p = self._held.pop(transfer_id, None)
        if p is None:
            return []
        if p.reached:
            return [FreeSlot(p.slot)]
        self._draining.append((p.slot, p.marker))
        return []

    def drop_all(self) -> list[FreeSlot]:
        """Every slot, held or draining, for a shutdown (the caller has waited for the packs)."""
        out = [FreeSlot(p.slot) for p in self._held.values()] + [FreeSlot(s) for s, _ in self._draining]
        self._held.clear()
        self._draining.clear()
        return out


def staged_on_p_alone(
    cfg: Config, src: KVLayout, src_blocks: np.ndarray | list[int], num_tokens: int, pack: np.ndarray, pack_bw: float
) -> bool:
    """Will staging win for any D, judged from P's side alone (P's pack at hand-over, before any registration)?

    A direct plan needs at least P's runs of consecutive block ids per region
    (``payload.block_runs``), whatever D's blocks are, so when staging beats
    that bound it beats the real count too: ``_staged_early`` then chooses the
    staged plan at pairing with this very pack list (given D's slot fits).
    """
    if cfg.staging.plan == "direct" or pack.shape[0] == 0:
        return False
    if cfg.staging.plan == "staged":
        return True
    nregions = len(src.regions)
    nbytes = int(pack[:, 1].sum()) * nregions
    runs = block_runs(src, src_blocks, num_tokens, 0)
    est = estimate(cfg, runs * nregions, nbytes, pack.shape[0] * nregions, pack_bw)
    return est.staged_s < est.direct_s


def packs_at_hand_over(
    cfg: Config,
    src: KVLayout,
    src_blocks: np.ndarray | list[int],
    num_tokens: int,
    pack: np.ndarray,
    pack_bw: float,
    last: PlanKind | None,
) -> bool:
    """Pack a parked prefill before any registration? Yes when staging wins for any D (``staged_on_p_alone``),
    and, with ``plan=auto``, when the last plan P chose with a staging slot on both sides was staged.

    P's own runs bound the direct plan only from below: P's blocks in long runs
    say nothing of D's, and a D's allocator scatters one request much as the
    last. A pack made on that guess and not taken costs one pack of the
    request's bytes off the request's path: the plan at pairing drops the slot.
    """
    if staged_on_p_alone(cfg, src, src_blocks, num_tokens, pack, pack_bw):
        return True
    return cfg.staging.plan == "auto" and pack.shape[0] > 0 and last is PlanKind.STAGED
