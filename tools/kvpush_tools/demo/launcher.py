"""HTTP server subprocesses (vLLM servers, the router) with a ``/health`` endpoint and a log file: free ports,
start, health, stop.

Each server runs in its own process group (``start_new_session``), so :meth:`ServerProcess.stop` reaches vLLM's
engine-core and worker children too: SIGINT to the group, then SIGKILL after a grace period. A guard (this file
run as a script: stdlib only, nothing of kvpush is imported here) leads the group, so that a launcher that dies
without cleaning up still stops the server's whole tree (:func:`_guard`). What is particular to vLLM, its flags
and connector configs, is :mod:`kvpush_tools.demo.servers`'."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Progress = Callable[[str], None]


class ServerError(RuntimeError):
    """A server did not come up (or died); the message holds its log tail."""


# A log line that starts an error report: a traceback or a logged error.
_ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|Error: ")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on ``host:port`` (so a server can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_LOWEST = 20000


def ephemeral_ports() -> range:
    """The ports the kernel hands out to outgoing connections and ``bind(0)``
    (``ip_local_port_range``; Linux's default where it cannot be read)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port with ``span`` consecutive ports from it free now, outside the
    kernel's ephemeral range.

    A server binds its ports tens of seconds after they were picked (vLLM
    imports first); a port from the ephemeral range can meanwhile become the
    local end of any outgoing connection on the host (other tests, NIXL
    agents), and the server then dies with ``EADDRINUSE``. Ports below the
    range are only ever taken by an explicit ``bind``; from :data:`_LOWEST`,
    above the ports Ray's workers take (10002-19999 by default).
    """
    ephemeral = ephemeral_ports()
    low, high = (_LOWEST, ephemeral.start) if ephemeral.start - _LOWEST > 1000 + span else (ephemeral.stop, 65536)
    rng = random.SystemRandom()
    for _ in range(1000):
        base = rng.randrange(low, high - span + 1)
        if all(port_is_free(base + i, host) for i in range(span)):
            return base
    raise ServerError(f"no {span} consecutive free ports in [{low}, {high}) on {host}")


@dataclass
class ServerProcess:
    """One HTTP server subprocess with a ``/health`` endpoint and a log file."""

    name: str
    cmd: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    ports: tuple[int, ...] = ()  # checked free before starting
    cpu_affinity: frozenset[int] | None = None  # pin the whole process tree
    guard_grace: float = 15.0  # after SIGINT, the guard SIGKILLs the group after this long
    health_path: str = "/health"  # answers 200 once the server serves
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after: float | None = None  # seconds from start to healthy

    # -- lifecycle ---------------------------------------------------------- #

    def start(self) -> ServerProcess:
        """Spawn the process (does not wait for it to be healthy)."""
        if self.proc is not None:
            raise ServerError(f"{self.name}: already started (pid {self.proc.pid})")
        busy = [p for p in self.ports if not port_is_free(p)]
        if busy:
            raise ServerError(f"{self.name}: port(s) {busy} already in use; is another server running there?")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%F %T')} starting {self.name}: {' '.join(self.cmd)}\n".encode())
            log.flush()
            # The guard (this file run as a script, stdlib only) is the group
            # leader; see _guard for why.
            guard = [sys.executable, os.path.abspath(__file__), "--guard", str(self.guard_grace), "--"]
            self.proc = subprocess.Popen(
                guard + self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,  # own process group: stop() reaches all children
                preexec_fn=self._preexec if sys.platform.startswith("linux") else None,
            )
        self.started_at = time.monotonic()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 1.0) -> bool:
        """One ``GET`` of :attr:`health_path`; True on HTTP 200."""
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=timeout) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 300.0, progress: Progress | None = None) -> float:
        """Block until ``/health`` answers 200; returns seconds since start.

        Raises :class:`ServerError` with the log tail if the process exits or
        ``timeout`` passes first.
        """
        wait_all_healthy([self], timeout=timeout, progress=progress)
        assert self.ready_after is not None
        return self.ready_after

    def interrupt(self) -> None:
        """Ask for an orderly shutdown: SIGINT to the server process only.

        vLLM's API server then shuts its engine down itself; signalling the
        whole group at once would kill the engine core under it (noisy
        tracebacks, and its NIXL agent gets no chance to close)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGINT the server, then SIGKILL its whole process group after
        ``grace`` seconds or as soon as the server has exited (so no engine
        child outlives it). Idempotent. Returns the exit code (None if never
        started)."""
        if self.proc is None:
            return None
        self.interrupt()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def log_cause(self, lines: int = 30) -> str:
        """The first error of the log with the lines before it: with several
        processes (engine cores of data parallelism) the root cause comes
        first and the tail only shows the others shutting down."""
        try:
            text = self.log_path.read_text("utf-8", "replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        first = next((i for i, line in enumerate(text) if _ERROR_LINE.search(line)), None)
        if first is None:
            return ""
        return "\n".join(text[max(0, first - 5) : first + lines])

    def __enter__(self) -> ServerProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _preexec(self) -> None:
        """In the child (the guard) before exec: get SIGTERM if the launching
        process dies, even by SIGKILL, so a killed test or demo leaves no
        orphan server; apply the CPU pinning, which all children inherit.
        The kernel ties that signal to the launching *thread*: a server started
        from a thread that then ends is stopped with it, so start servers from
        a thread that outlives them."""
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if self.cpu_affinity:
            os.sched_setaffinity(0, self.cpu_affinity)


def parse_cpus(spec: str) -> frozenset[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6} (the syntax of VLLM_CPU_OMP_THREADS_BIND and taskset)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {spec!r}")
    return frozenset(cpus)


def _guard(argv: list[str]) -> int:
    """``servers.py --guard GRACE -- CMD...``: run CMD in this process group,
    turn SIGINT/SIGTERM into SIGINT for CMD, and SIGKILL the whole group if it
    is not gone ``GRACE`` seconds later. Exits with CMD's status.

    Why a guard: the launcher may die without cleaning up (a CI timeout
    SIGKILLs pytest). The kernel then sends the guard SIGTERM (parent-death
    signal), and the guard stops the server's whole tree. vLLM itself could
    not be trusted with that signal: while it is still starting up it may
    ignore it, and its engine-core children do not notice that their parent
    died, so they would keep both cores busy for nothing.
    """
    import threading

    grace = float(argv[0])
    cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    child = subprocess.Popen(cmd)

    def on_signal(_signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGINT)
        timer = threading.Timer(grace, os.killpg, (0, signal.SIGKILL))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def wait_all_healthy(
    servers: Sequence[ServerProcess], timeout: float = 300.0, progress: Progress | None = None, every: float = 10.0
) -> None:
    """Wait for several servers at once (they start in parallel), failing as
    soon as any of them dies. ``progress`` gets a line about every ``every``
    seconds and one per server when it becomes healthy."""
    pending = [s for s in servers if s.ready_after is None]
    deadline = time.monotonic() + timeout
    next_note = time.monotonic() + every
    while pending:
        for s in list(pending):
            if s.proc is None:
                raise ServerError(f"{s.name}: not started")
            if s.proc.poll() is not None:
                cause = s.log_cause()
                raise ServerError(
                    f"{s.name} exited with code {s.proc.returncode} before it was healthy.\n"
                    + (f"--- first error in {s.log_path} ---\n{cause}\n" if cause else "")
                    + f"--- last lines of {s.log_path} ---\n{s.log_tail()}"
                )
            if s.healthy():
                s.ready_after = time.monotonic() - s.started_at
                pending.remove(s)
                if progress:
                    progress(f"{s.name} ready at {s.url} after {s.ready_after:.0f} s")
        if not pending:
            break
        now = time.monotonic()
        if now > deadline:
            s = pending[0]
            raise ServerError(
                f"{', '.join(p.name for p in pending)} not healthy after {timeout:.0f} s.\n"
                f"--- last lines of {s.log_path} ---\n{s.log_tail()}"
            )
        if progress and now >= next_note:
            next_note = now + every
            elapsed = now - pending[0].started_at
            progress(f"{elapsed:3.0f} s: " + "; ".join(f"{p.name}: {_last_line(p)}" for p in pending))
        time.sleep(0.5)


def _last_line(s: ServerProcess) -> str:
    """The server's latest log line, shortened: what it is doing now."""
    for line in reversed(s.log_tail(5).splitlines()):
        line = line.strip()
        if line and not line.startswith("==="):
            # Drop vLLM's "(APIServer pid=..) INFO 11-30 10:47:14 [file.py:123]" prefix.
            if "] " in line[:120]:
                line = line.split("] ", 1)[1]
            return line[:48]
    return "starting"


def stop_all(servers: Iterable[ServerProcess], grace: float = 20.0) -> None:
    """Stop several servers, in parallel (one shared grace period); never raises."""
    servers = list(servers)
    for s in servers:
        s.interrupt()
    deadline = time.monotonic() + grace
    for s in reversed(servers):
        with contextlib.suppress(Exception):
            s.stop(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__" and sys.argv[1:2] == ["--guard"]:
    sys.exit(_guard(sys.argv[2:]))
