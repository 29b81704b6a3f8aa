"""Waiting for device markers off the engine thread, without holding the GIL.

P's engine thread spends most of a layer-wise push (and every push planned
ahead) waiting for the device: a layer's KV event, or the pack queued behind
it. Polling for it from Python, even every few microseconds, takes the GIL
once per poll, and the forward's launching thread (the same process: vLLM's
worker) gives the GIL up on every torch call, so each of its launches waits
for a poll and the forward slows (measured: docs/cuda.md, "Engine
defaults"). A helper thread blocked in the backend's ``wait_ready`` (CUDA:
``Event.synchronize``, which drops the GIL) wakes the engine when the marker
is reached, and the engine sleeps until then.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class MarkerWaiter:
    """A thread that waits for one marker at a time and calls ``wake`` when it is reached.

    Only latency depends on it: the engine still polls its markers whenever
    it steps, so a marker the waiter never sees reached (a hung device) costs
    nothing but this thread.
    """

    def __init__(
        self, wait: Callable[[Any], None], wake: Callable[[], None], name: str, bind: Callable[[], None] | None = None
    ) -> None:
        self._wait = wait
        self._bind = bind
        self._wake = wake
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._asked: Any = None  # the marker most recently asked for (engine thread only)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvpush-wait-{name}", daemon=True)
        self._thread.start()
        self.waits = 0

    def watch(self, marker: Any) -> None:
        """Wake the engine once ``marker`` is reached (engine thread; asking again for the same one is free)."""
        if marker is None or marker is self._asked:
            return
        self._asked = marker
        self._queue.put(marker)

    def close(self, timeout: float = 1.0) -> None:
        """Stop; a wait still blocked (a hung device) ends without waking anyone: the engine's wake-up
        pipe is closed by then, and its descriptor may belong to another file."""
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._bind is not None:
            try:
                self._bind()  # the backend's thread hook, before its first call from this thread
            except Exception:
                log.exception("binding the marker waiter to the backend failed")
        while True:
            marker = self._queue.get()
            if marker is _STOP:
                return
            try:
                self._wait(marker)
            except Exception:
                log.debug("waiting for a device marker failed (the engine's own poll reports it)", exc_info=True)
            self.waits += 1
            if self._closed:
                return
            self._wake()


_STOP = object()
