"""A backend with chosen bugs, to show the conformance suite catches each one.

``BrokenBackend(bug="a,b")`` is the minimal example backend with these bugs:

- ``swap_kv``: describe lists each layer's V region before its K region. Two
  instances of this backend still agree (the mistake cancels out), so only a
  push against the host reference backend can see it.
- ``accept_foreign``: describe copies anything array-like instead of refusing
  it, so a layout points at memory the engine never wrote.
- ``late_write``: writes into a cache that was already described land 1.5 s
  later, and ``record_ready`` ignores them, as a device backend that records
  its marker on the wrong stream would.
- ``leak_thread``: starts a non-daemon thread that never ends, so the process
  cannot exit.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import numpy as np
from kvpush_minimal import MinimalBackend

from kvpush.backends.base import CacheSpec
from kvpush.core.layout import KVLayout

BUGS = {"swap_kv", "accept_foreign", "late_write", "leak_thread"}
LATE_S = 1.5


class BrokenBackend(MinimalBackend):
    name = "broken"

    def __init__(self, bug: str = "") -> None:
        super().__init__()
        self.bugs = {b for b in bug.split(",") if b}
        assert self.bugs <= BUGS, self.bugs - BUGS
        self._described: set[int] = set()
        self._pending: list[threading.Thread] = []
        if "leak_thread" in self.bugs:
            threading.Thread(target=threading.Event().wait, name="leaked", daemon=False).start()

    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        if "accept_foreign" in self.bugs:
            kv_caches = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float16)) for k, v in kv_caches.items()}
        layout = super().describe(kv_caches, spec)
        self._described.update(id(t) for t in kv_caches.values())
        if "swap_kv" in self.bugs:
            r = layout.regions
            swapped = tuple(r[i + 1 - 2 * (i % 2)] for i in range(len(r)))
            layout = msgspec.structs.replace(layout, regions=swapped)
        return layout

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        if "late_write" in self.bugs and id(tensor) in self._described:
            copy = np.array(data, dtype=np.uint8)

            def land() -> None:
                time.sleep(LATE_S)
                super(BrokenBackend, self).write_bytes(tensor, copy)

            th = threading.Thread(target=land, daemon=True)
            th.start()
            self._pending.append(th)
            return
        super().write_bytes(tensor, data)

    def read_bytes(self, tensor: Any) -> np.ndarray:
        for th in self._pending:  # "all device work issued before the call"
            th.join()
        self._pending.clear()
        return super().read_bytes(tensor)
