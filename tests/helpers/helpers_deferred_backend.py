"""The host backend with an asynchronous pack/unpack, like a device copier on a side stream.

``start_pack``/``start_unpack``/``start_peer_copy`` return at once and do the copy ``DELAY_S``
later on a timer thread; ``poll_ready`` says whether it happened. An engine
that posted a staged WRITE before its pack landed would send stale staging
bytes, and a D that reported a transfer before its unpack landed would hand
back blocks still holding the sentinel (or see them written after it let go
of them): the tests that run on this backend fail in each case.

Every copy is kept with when it started and landed (``timeline``), so a test
can see which copies overlapped, across processes (``time.monotonic`` is the
host's clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpush.backends.base import Capabilities
from kvpush.backends.host import HostBackend

DELAY_S = 0.25


class _Later:
    """A copy that runs ``DELAY_S`` from now; its marker. ``kind``: pack or unpack; ``staging_addr``: where in
    the staging buffer its part sits (a part's place tells which part it is)."""

    def __init__(self, fn: Callable[[], None], kind: str, staging_addr: int) -> None:
        self.done = threading.Event()
        self.kind, self.staging_addr = kind, staging_addr
        self.started = time.monotonic()
        self.landed: float | None = None

        def run() -> None:
            fn()
            self.landed = time.monotonic()
            self.done.set()

        self._timer = threading.Timer(DELAY_S, run)
        self._timer.daemon = True
        self._timer.start()


class DeferredHostBackend(HostBackend):
    name = "deferred-host"
    # a pack may be queued behind a marker (host markers are None: nothing to wait for)
    capabilities = Capabilities(chained_ready=True)

    def __init__(self) -> None:
        super().__init__()
        self.started = 0
        self.copies: list[_Later] = []

    def start_pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int, after: Any = None) -> Any:
        self.started += 1

        def copy() -> None:
            if after is not None:
                self.wait_ready(after)
            self.pack(list(regions), pieces, staging_addr)

        return self._later(copy, "pack", staging_addr)

    def start_unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> Any:
        self.started += 1
        return self._later(lambda: self.unpack(list(regions), pieces, staging_addr), "unpack", staging_addr)

    def start_peer_copy(
        self, peer: Any, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray, after: Any = None
    ) -> Any:
        """A peer copy that lands ``DELAY_S`` later (behind ``after``): a P that told D before it landed would
        have D report blocks still holding the sentinel."""
        self.started += 1

        def copy() -> None:
            if after is not None:
                self.wait_ready(after)
            super(DeferredHostBackend, self).start_peer_copy(peer, src_bases, dst_bases, pieces)

        return self._later(copy, "peer", 0)

    def _later(self, fn: Callable[[], None], kind: str, staging_addr: int) -> _Later:
        later = _Later(fn, kind, staging_addr)
        self.copies.append(later)
        return later

    def timeline(self) -> list[tuple[str, int, float, float | None]]:
        """Every copy so far: (kind, staging address, started, landed or None), in the order started."""
        return [(c.kind, c.staging_addr, c.started, c.landed) for c in self.copies]

    def poll_ready(self, marker: Any) -> bool:
        if isinstance(marker, _Later):
            return marker.done.is_set()
        return super().poll_ready(marker)

    def wait_ready(self, marker: Any) -> None:
        if isinstance(marker, _Later):
            marker.done.wait()
        else:
            super().wait_ready(marker)
