"""A bounded allocator for slots of a staging region (pure bookkeeping).

Staging regions are registered once and reused; transfers borrow slots. When
no slot fits, the caller falls back to a direct plan (always correct) rather
than waiting, so a burst of large requests degrades speed, never liveness.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

ALIGN = 4096


@dataclass(frozen=True)
class FreeSlot:
    """Give the slot at ``offset`` back to its staging region's allocator (``SlotAllocator.free``): the action
    P's packs at hand-over (``kvpush.prefill.prepack``) and D's fencing
    (``kvpush.decode.fencing_actions``) both ask for."""

    offset: int


class SlotAllocator:
    """First-fit allocator over ``[0, capacity)`` with coalescing frees."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        self.capacity = capacity
        self.align = align
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []
        self._used: dict[int, int] = {}

    def _aligned(self, size: int) -> int:
        """``size`` rounded up to the alignment every slot has."""
        return -(-size // self.align) * self.align

    def holds(self, size: int) -> bool:
        """Whether a slot of ``size`` bytes fits the region at all (free or not): one that does not is never
        granted, however long the push waits."""
        return 0 < self._aligned(size) <= self.capacity

    def alloc(self, size: int) -> int | None:
        """Offset of a slot of at least ``size`` bytes, or None when none fits."""
        if size <= 0:
            return None
        size = self._aligned(size)
        for i, (off, ln) in enumerate(self._free):
            if ln >= size:
                if ln == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, ln - size)
                self._used[off] = size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"staging slot at offset {offset} is not allocated")
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # merge with neighbours
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    @property
    def slots_in_use(self) -> int:
        return len(self._used)
