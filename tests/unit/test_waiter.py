"""``MarkerWaiter``: the helper thread that waits for device markers so P's push thread need not poll."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvpush.engine.waiter import MarkerWaiter


class _Marker:
    def __init__(self) -> None:
        self.reached = threading.Event()


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_wakes_once_per_marker_reached_and_asks_once() -> None:
    woken, waited = [], []

    def wait(m: _Marker) -> None:
        waited.append(m)
        m.reached.wait()

    w = MarkerWaiter(wait, lambda: woken.append(time.monotonic()), "t")
    try:
        a, b = _Marker(), _Marker()
        w.watch(None)
        w.watch(a)
        w.watch(a)  # asked again while pending: not queued twice
        time.sleep(0.05)
        assert woken == [] and waited == [a]
        a.reached.set()
        assert _until(lambda: len(woken) == 1)
        w.watch(b)
        b.reached.set()
        assert _until(lambda: len(woken) == 2)
        time.sleep(0.05)
        assert waited == [a, b] and len(woken) == 2 and w.waits == 2
    finally:
        w.close()


def test_a_failed_wait_still_wakes_the_engine() -> None:
    """The engine's own poll reports the failure; the waiter only must not leave it asleep."""
    woken = []

    def wait(m: _Marker) -> None:
        raise RuntimeError("device lost")

    w = MarkerWaiter(wait, lambda: woken.append(1), "t")
    try:
        w.watch(_Marker())
        assert _until(lambda: woken == [1])
    finally:
        w.close()


def test_a_wait_that_ends_after_close_wakes_nobody() -> None:
    """After close the engine's wake-up pipe is gone (its descriptor may be another file's by then)."""
    woken = []

    def wait(m: _Marker) -> None:
        m.reached.wait()

    w = MarkerWaiter(wait, lambda: woken.append(1), "t")
    m = _Marker()
    w.watch(m)
    time.sleep(0.05)
    w.close(timeout=0.1)  # the wait is still blocked
    m.reached.set()
    time.sleep(0.1)
    assert woken == []
