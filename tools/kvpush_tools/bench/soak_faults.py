"""The soak's faults, each at a set point of the plan (when that many requests were sent), one after another
while the load goes on: D killed and started again, P killed and started again, the network between P and
the rest cut for longer than ``peer_dead_s`` and healed.

Each fault is a :class:`~kvpush_tools.bench.soak_rules.Window` from its start to when the router is healthy
again (it holds a healthy P and D: the stack can serve), which is what the explained-failure rule measures
from. Restarts are at the same addresses: the router finds the server again at its next health check, and a
P started again at its address answers D's fencing hello, so D gives back the blocks it withheld for the
dead P without an operator's ``kvpush fence``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvpush_tools.bench.soak_load import Load
from kvpush_tools.bench.soak_net import Link
from kvpush_tools.bench.soak_rules import Window
from kvpush_tools.bench.soak_stack import SoakStack

FAULTS = ("d_restart", "p_restart", "net_drop")
ALIASES = {"d": "d_restart", "p": "p_restart", "net": "net_drop"}


def parse_faults(text: str) -> tuple[str, ...]:
    """``"d,p,net"`` (or the full names, or ``"none"``) -> the faults' names, in the order given."""
    if text.strip() in ("", "none"):
        return ()
    out = []
    for part in text.split(","):
        name = ALIASES.get(part.strip(), part.strip())
        if name not in FAULTS:
            raise ValueError(f"no fault {part!r}; choose from {', '.join((*ALIASES, *FAULTS))}")
        out.append(name)
    return tuple(out)


def points(faults: Sequence[str], at: Sequence[float], requests: int) -> list[tuple[str, int]]:
    """Each fault with the request count it starts at (``at``: fractions of ``requests``, one per fault)."""
    if len(at) != len(faults):
        raise ValueError(f"{len(faults)} faults but {len(at)} points")
    return [(name, max(1, round(share * requests))) for name, share in zip(faults, at, strict=True)]


class Faults(threading.Thread):
    """Runs the faults at their points (``plan``), appending each one's window to ``windows``; a fault the
    stack does not recover from halts the load, saying why."""

    def __init__(
        self,
        stack: SoakStack,
        link: Link | None,
        load: Load,
        plan: Sequence[tuple[str, int]],
        cut_s: float,
        t0: float,
        say: Callable[[str], None],
    ) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.stack, self.link, self.load, self.plan = stack, link, load, list(plan)
        self.cut_s, self.t0, self.say = cut_s, t0, say
        self.windows: list[Window] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        for name, at in self.plan:
            while self.load.sent < at:
                if self.load.stopped.is_set() or self.load.ended >= len(self.load.specs):
                    return
                time.sleep(0.2)
            w = Window(name, self.now(), info={"at_request": self.load.sent})
            self.windows.append(w)
            self.say(f"fault {name} at request {self.load.sent}")
            try:
                getattr(self, name)(w)
                w.recovered = self.stack.wait_router(timeout=300) - self.t0
            except Exception as exc:
                w.info["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                self.load.halt(f"fault {name}: the stack did not recover ({w.info['error'][:300]})")
                return
            self.say(f"fault {name}: serving again {w.recovered - w.start:.0f} s after it began")

    def d_restart(self, w: Window) -> None:
        """kill -9 D; a new D at the same ports (HTTP, fence listener)."""
        self.stack.kill("decode")
        w.info["killed_s"] = round(self.now(), 2)
        w.info["up_s"] = round(self.stack.start_again("decode") - self.t0, 2)

    def p_restart(self, w: Window) -> None:
        """kill -9 P; a new P at the same address (HTTP port, side channel)."""
        self.stack.kill("prefill")
        w.info["killed_s"] = round(self.now(), 2)
        w.info["up_s"] = round(self.stack.start_again("prefill") - self.t0, 2)

    def net_drop(self, w: Window) -> None:
        """Both ends of the pair down for ``cut_s``, then up."""
        if self.link is None:
            raise RuntimeError("no network namespaces (--no-netns): there is no link to cut")
        self.link.drop()
        time.sleep(self.cut_s)
        self.link.heal()
        w.info["cut_s"] = self.cut_s
        w.info["healed_s"] = round(self.now(), 2)
