"""vLLM's engine loop in the transfer bench's processes (``--busy-gil``), and the GIL's switch interval.

In vLLM, kvpush's engine threads share their process with vLLM's engine
loop: Python that runs without blocking while requests are scheduled. A
kvpush thread that wakes (its poll's sleep over, a message on its socket, a
copy that dropped the GIL ending) must take the GIL back from that loop, and
CPython asks the running thread to drop it only after the waiter has waited
``sys.getswitchinterval()`` (5 ms by default). Each wake-up on a push's path
may so cost up to an interval: per part in rounds, D's notification poll and
unpack, P's credit and post.

``BusyLoop`` stands in for that loop in a bench process: short Python steps
(small dicts and lists, what a scheduler step does), never blocking, in a
thread of the process (``busy``: it takes a core and the GIL) or, as a
control, in a process of its own beside it (``cpu``: it takes a core, not
this process's GIL; on a host of few cores, what the busy thread costs
without the GIL). A ``Mode`` is one of those or none (``idle``) and the
switch interval of the process; the bench's P and D processes switch modes
between transfers (``switch``), so modes take turns in one pair of
processes and each mode's loops run only during its own transfers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_INTERVAL_MS = 5.0
"""CPython's default switch interval (``sys.getswitchinterval()``), in ms."""
KINDS = ("idle", "busy", "cpu")
"""No loop; a busy thread in the process (its GIL); a busy process beside it (a core, not the GIL)."""


@dataclass(frozen=True)
class Mode:
    """One GIL setting of the bench's processes: which busy loop (``KINDS``), and the switch interval (ms)."""

    kind: str
    interval_ms: float

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.interval_ms:g}ms"

    def fields(self) -> dict[str, Any]:
        """What a result row says of its mode."""
        return {"gil": self.label, "busy_gil": self.kind, "switch_interval_ms": self.interval_ms}


def parse_mode(text: str) -> Mode:
    """``busy/0.5`` (or ``busy/0.5ms``): a kind of ``KINDS`` and a switch interval in ms."""
    kind, _, ms = text.strip().partition("/")
    try:
        interval = float(ms.removesuffix("ms")) if ms else DEFAULT_INTERVAL_MS
    except ValueError:
        interval = -1.0
    if kind not in KINDS or interval <= 0:
        raise argparse.ArgumentTypeError(f"a GIL mode is KIND/MS, KIND one of {', '.join(KINDS)}: got {text!r}")
    return Mode(kind, interval)


def modes(args: argparse.Namespace) -> list[Mode] | None:
    """The modes to take turns: ``--gil-modes`` as given, then without and with the busy thread
    (``--busy-gil``) at each of ``--switch-intervals``; None when none was asked for (the processes as they
    start, no switching)."""
    out = list(args.gil_modes or [])
    if args.busy_gil or args.switch_intervals:
        ivs = args.switch_intervals or [DEFAULT_INTERVAL_MS]
        out += [Mode(k, iv) for k in (("idle", "busy") if args.busy_gil else ("idle",)) for iv in ivs]
    return list(dict.fromkeys(out)) or None


class BusyLoop:
    """vLLM's engine loop as the GIL sees it: a thread of pure Python that never blocks (or, ``cpu``, the same
    in a process of its own)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: Any = None

    def start(self, kind: str) -> None:
        if kind == "busy" and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="bench-busy-gil", daemon=True)
            self._thread.start()
        elif kind == "cpu" and self._proc is None:
            # A plain child: the bench's side processes are daemons, which multiprocessing lets have none.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            code = "from kvpush_tools.bench.busy_gil import spin; spin()"
            self._proc = subprocess.Popen([sys.executable, "-c", code], env=env)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None

    def _run(self) -> None:
        queues: dict[int, list[int]] = {}
        n = 0
        while not self._stop.is_set():
            n += 1
            _step(queues, n)


def spin() -> None:
    """A busy process's body: the busy thread's steps, for ever (it is terminated)."""
    queues: dict[int, list[int]] = {}
    n = 0
    while True:
        n += 1
        _step(queues, n)


def _step(queues: dict[int, list[int]], n: int) -> int:
    """One short step of a scheduler's kind of work: a few look-ups, appends and a small sum, no call that
    drops the GIL (a few microseconds)."""
    q = queues.setdefault(n & 31, [])
    q.append(n)
    if len(q) > 8:
        q.clear()
    return sum(len(v) for v in queues.values())


def apply(loop: BusyLoop, kind: str, interval_ms: float) -> None:
    """Put this process in a mode: its switch interval, and only the busy loop of ``kind`` running."""
    sys.setswitchinterval(interval_ms / 1e3)
    loop.stop()
    loop.start(kind)
    if kind == "cpu":
        time.sleep(0.3)  # a spawned process takes a moment to start spinning


def switch(sides: tuple[Any, ...], current: dict[Any, Mode], key: Any, mode: Mode | None) -> None:
    """Put the processes ``sides`` (``transfer_side.Proc``) of lane ``key`` in ``mode`` unless they are in it."""
    if mode is None or current.get(key) == mode:
        return
    for side in sides:
        side.call("gil", mode.kind, mode.interval_ms)
    current[key] = mode


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The GIL options of ``kvpush bench transfer``."""
    ap.add_argument(
        "--busy-gil",
        action="store_true",
        help="every case also with a busy pure-Python thread in P's and D's processes (vLLM's engine loop "
        "holding the GIL), modes taking turns",
    )
    ap.add_argument(
        "--switch-intervals",
        type=lambda s: [float(x) for x in s.split(",") if x.strip()],
        default=None,
        metavar="MS",
        help="sys.setswitchinterval of P's and D's processes, in ms, each a mode (e.g. 5,0.5,0.1; default Python's 5)",
    )
    ap.add_argument(
        "--gil-modes",
        type=lambda s: [parse_mode(x) for x in s.split(",") if x.strip()],
        default=None,
        metavar="KIND/MS,...",
        help="GIL modes to take turns, KIND idle, busy (a busy thread in P's and D's processes) or cpu (the "
        "same loop in a process of its own beside each: the cores it takes, not the GIL), e.g. cpu/5",
    )
