"""One 1P1D "stack" per KV connector mode, for the serving benchmarks.

A stack is a prefill server, a decode server and a router in the matching
mode, started with the same model and flags whatever the mode, so the only
difference between stacks is the KV connector. ``kvpush bench serve`` and
``kvpush bench idle`` keep the three stacks up at once and *pause* the ones
not being measured (SIGSTOP to each server's process group, SIGCONT to
resume), because:

* restarting vLLM per mode costs 1-2 minutes per pair on 2 cores, too slow
  to interleave modes point by point;
* leaving idle stacks running is not neutral: vLLM's NIXL connectors spin a
  progress thread per agent, so an idle vLLM stack would eat the cores the
  measured stack needs (and kvpush's measurement would pay for vLLM's spin);
* a stopped process uses no CPU, keeps its memory (each vLLM server here is
  about 2 GB with a 512 MiB KV cache: 6 servers fit in 24 GiB), and resumes
  in milliseconds. Side effects of the time jump (a peer looking silent,
  heartbeats) are absorbed by warm-up requests after every resume.

Pinning: every P on ``p_cpus`` and every D on ``d_cpus`` (whole process
trees, see :mod:`kvpush_tools.demo.launcher`), router and client float.

The benchmarks share one life cycle, kept here: starting the stacks
(:func:`start_stacks`), owning them for the length of a run
(:func:`run_with_stacks`: SIGTERM becomes an orderly stop, every owned
server is stopped whatever happens, the exit codes 130/2 on interrupt or a
server that did not come up) and switching the machine to one of them
(:func:`activate`). How a mode's stack is made is
:mod:`kvpush_tools.bench.stack_build`'s; the options that shape every stack
of a run, :mod:`kvpush_tools.bench.stack_options`'.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpush_tools.bench.server_metrics import http_get
from kvpush_tools.demo import launcher

Say = Callable[[str], None]


@dataclass
class Stack:
    """P, D and router of one mode; or, attached, only a router URL."""

    mode: str
    url: str  # the router, where the client sends
    prefill: launcher.ServerProcess | None = None
    decode: launcher.ServerProcess | None = None
    router: launcher.ServerProcess | None = None
    d_url: str | None = None  # D's own URL, for its /metrics
    paused: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    router_name: str = "kvpush"  # which router: kvpush's own, or "vllm-router"

    @property
    def attached(self) -> bool:
        return self.prefill is None

    @property
    def servers(self) -> list[launcher.ServerProcess]:
        return [s for s in (self.prefill, self.decode) if s is not None]

    def pause(self) -> None:
        """SIGSTOP the router, then P and D (whole process groups).

        Router first so its health check never sees a stopped server and
        marks it unhealthy."""
        if self.attached or self.paused:
            return
        started = [s for s in (self.router, *self.servers) if s is not None and s.proc is not None]
        if not started:
            return  # nothing to pause yet (a stack started later, one at a time)
        for s in started:
            _killpg(s.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        self.paused = True

    def resume(self) -> None:
        """SIGCONT P and D, then the router."""
        if self.attached or not self.paused:
            return
        for s in (*self.servers, self.router):
            if s is not None and s.proc is not None:
                _killpg(s.proc.pid, signal.SIGCONT)
        self.paused = False

    def healthy(self) -> bool:
        """The router answers /health 200 (which needs a healthy P and D)."""
        return http_get(self.url + "/health", timeout=3.0)[0] == 200

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            for s in (*self.servers, self.router):
                if s is not None and s.proc is not None and s.proc.poll() is not None:
                    raise launcher.ServerError(f"{self.mode} {s.name} exited.\n{s.log_tail()}")
            if time.monotonic() > deadline:
                raise launcher.ServerError(f"{self.mode}: router {self.url} not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Resume (a stopped process cannot handle SIGINT) and stop everything."""
        if self.attached:
            return
        with contextlib.suppress(Exception):
            self.resume()
        launcher.stop_all([s for s in (*self.servers, self.router) if s is not None])


def stop_stacks(stacks: Sequence[Stack]) -> None:
    """Stop every owned stack at once (one shared grace period, not one per stack)."""
    owned = [st for st in stacks if not st.attached]
    for st in owned:
        with contextlib.suppress(Exception):
            st.resume()
    # Once each: a second SIGINT makes vLLM quit without cleaning up.
    launcher.stop_all(_unique(s for st in owned for s in (*st.servers, st.router) if s is not None))


def _unique(servers: Iterable[launcher.ServerProcess]) -> list[launcher.ServerProcess]:
    """Each server once, in first-seen order (two stacks may share P and D)."""
    return list({id(s): s for s in servers}.values())


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def start_stacks(stacks: Sequence[Stack], say: Say, timeout: float = 1500.0, every: float = 30.0) -> None:
    """Start every owned stack; on return all of them are healthy and paused.

    All P and D servers start at once (imports dominate and overlap), and
    each stack is paused as soon as its P and D are both up: a vLLM NIXL
    stack spins its progress threads from the moment it is up, which would
    slow down the servers still starting. Then each stack's router starts
    (stack resumed for that) and the stack is checked healthy end to end.
    """
    owned = [s for s in stacks if not s.attached]
    servers = _unique(s for st in owned for s in st.servers)  # stacks behind two routers share P and D
    for server in servers:
        server.start()
    names = ", ".join(dict.fromkeys(st.mode for st in owned))
    say(f"starting {len(servers)} vLLM servers ({names}); minutes on 2 cores")
    pending = list(owned)
    t0 = time.monotonic()
    next_note = t0 + every
    while pending:
        for st in list(pending):
            for server in st.servers:
                if server.ready_after is not None:
                    continue
                if server.proc is not None and server.proc.poll() is not None:
                    raise launcher.ServerError(
                        f"{server.name} exited with code {server.proc.returncode} before it was healthy.\n"
                        f"--- last lines of {server.log_path} ---\n{server.log_tail()}"
                    )
                if server.healthy():
                    server.ready_after = time.monotonic() - server.started_at
                    say(f"{server.name} ready after {server.ready_after:.0f} s")
            if all(server.ready_after is not None for server in st.servers):
                st.pause()
                pending.remove(st)
        now = time.monotonic()
        if pending and now - t0 > timeout:
            names = ", ".join(s.name for s in _unique(s for st in pending for s in st.servers if s.ready_after is None))
            raise launcher.ServerError(
                f"{names} not healthy after {timeout:.0f} s (logs in {pending[0].info['log_dir']})"
            )
        if pending and now >= next_note:
            next_note = now + every
            waiting = _unique(s for st in pending for s in st.servers if s.ready_after is None)
            say(f"{now - t0:4.0f} s: waiting for " + ", ".join(s.name for s in waiting))
        time.sleep(1.0)
    for st in owned:
        st.resume()
        if st.router is not None:
            st.router.start()
            launcher.wait_all_healthy([st.router], timeout=120)
        st.wait_healthy(120)
        st.pause()
    for st in stacks:
        if st.attached:
            st.wait_healthy(120)


def activate(stacks: Mapping[str, Stack] | Sequence[Stack], stack: Stack, timeout: float = 60.0) -> None:
    """Make ``stack`` the only one running: pause every other, resume it, wait
    until it is healthy end to end."""
    for other in stacks.values() if isinstance(stacks, Mapping) else stacks:
        if other is not stack:
            other.pause()
    stack.resume()
    stack.wait_healthy(timeout)


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_with_stacks(stacks: Mapping[str, Stack] | Sequence[Stack], body: Callable[[], int | None], say: Say) -> int:
    """Run ``body`` while owning ``stacks``; returns its status (None: 0).

    SIGTERM is turned into KeyboardInterrupt for the duration, so a killed
    benchmark still stops its servers; every owned stack is stopped at the
    end, whatever happened (attached ones are left alone). An interrupt
    returns 130, a :class:`~kvpush_tools.demo.launcher.ServerError` (a server that
    did not come up, or died) 2, after saying why."""
    every = list(stacks.values()) if isinstance(stacks, Mapping) else list(stacks)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        rc = body()
        return 0 if rc is None else int(rc)
    except KeyboardInterrupt:
        say("interrupted; stopping servers")
        return 130
    except launcher.ServerError as exc:
        say(f"ERROR: {exc}")
        return 2
    finally:
        say("stopping servers")
        stop_stacks(every)
        signal.signal(signal.SIGTERM, previous)
