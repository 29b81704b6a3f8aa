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
trees, see :mod:`kvpush_tools.demo.servers`), router and client float.

The benchmarks share one life cycle, kept here: the command-line options
that shape a stack (:func:`add_stack_arguments`, :func:`stack_options`),
building them (:func:`build_stacks`), owning them for the length of a run
(:func:`run_with_stacks`: SIGTERM becomes an orderly stop, every owned
server is stopped whatever happens, the exit codes 130/2 on interrupt or a
server that did not come up) and switching the machine to one of them
(:func:`activate`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_tools.bench.loadgen import unsupported
from kvpush_tools.demo import servers as srv

MODES = ("kvpush", "vllm-pull", "vllm-push", "kvpush-selective")
KVPUSH_MODES = ("kvpush", "kvpush-selective")
"""Modes whose servers run kvpush (they differ only in the router: ``--selective``)."""
BASELINE = "none"  # plain vLLM servers, no KV connector: what an idle server costs anyway
SINGLE = "single"  # one plain vLLM server (on the prefill cores), no router: P/D without any transfer
MODEL_NAME = "tiny-qwen3"
DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024
ABLATION_DIR = Path(__file__).resolve().parent / "ablation_no_prog_thread"

Say = Callable[[str], None]


def connector_configs(
    mode: str, p_kv_port: int, d_kv_port: int, engine_id: str
) -> tuple[dict[str, Any] | None, dict[str, str], dict[str, Any] | None, dict[str, str]]:
    """(P kv_transfer_config, P env, D kv_transfer_config, D env) of one mode (kvpush: with a fresh key set)."""
    if mode in (BASELINE, SINGLE):
        return None, {}, None, {}
    if mode in KVPUSH_MODES:
        keys = srv.temp_keys()
        return (
            srv.kvpush_transfer_config("kv_producer", p_kv_port, auth_keys_dir=keys),
            {},
            srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys),
            {},
        )
    if mode in ("vllm-pull", "vllm-push"):
        connector = "NixlConnector" if mode == "vllm-pull" else "NixlPushConnector"
        return (
            srv.vllm_nixl_transfer_config(connector, "kv_producer", engine_id=engine_id),
            srv.vllm_nixl_env(p_kv_port),
            srv.vllm_nixl_transfer_config(connector, "kv_consumer"),
            srv.vllm_nixl_env(d_kv_port),
        )
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def router_args(mode: str, p_url: str, d_url: str, p_kv_port: int, engine_id: str) -> list[str]:
    """The router's command line for one stack (what ``kvpush router`` takes)."""
    args = ["--mode", "kvpush" if mode in KVPUSH_MODES else mode, "--prefill", p_url]
    if mode == "kvpush-selective":
        args.append("--selective")
    if mode != "vllm-pull":
        args += ["--prefill-kv", f"127.0.0.1:{p_kv_port}"]
    if mode == "vllm-push":
        args += ["--prefill-engine-id", engine_id]
    return [*args, "--decode", d_url]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET returning (status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, ""


@dataclass
class Stack:
    """P, D and router of one mode; or, attached, only a router URL."""

    mode: str
    url: str  # the router, where the client sends
    prefill: srv.ServerProcess | None = None
    decode: srv.ServerProcess | None = None
    router: srv.ServerProcess | None = None
    d_url: str | None = None  # D's own URL, for its /metrics
    paused: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    router_name: str = "kvpush"  # which router: kvpush's own, or "vllm-router"

    @property
    def attached(self) -> bool:
        return self.prefill is None

    @property
    def servers(self) -> list[srv.ServerProcess]:
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
                    raise srv.ServerError(f"{self.mode} {s.name} exited.\n{s.log_tail()}")
            if time.monotonic() > deadline:
                raise srv.ServerError(f"{self.mode}: router {self.url} not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Resume (a stopped process cannot handle SIGINT) and stop everything."""
        if self.attached:
            return
        with contextlib.suppress(Exception):
            self.resume()
        srv.stop_all([s for s in (*self.servers, self.router) if s is not None])


def stop_stacks(stacks: Sequence[Stack]) -> None:
    """Stop every owned stack at once (one shared grace period, not one per stack)."""
    owned = [st for st in stacks if not st.attached]
    for st in owned:
        with contextlib.suppress(Exception):
            st.resume()
    # Once each: a second SIGINT makes vLLM quit without cleaning up.
    srv.stop_all(_unique(s for st in owned for s in (*st.servers, st.router) if s is not None))


def _unique(servers: Iterable[srv.ServerProcess]) -> list[srv.ServerProcess]:
    """Each server once, in first-seen order (two stacks may share P and D)."""
    return list({id(s): s for s in servers}.values())


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def build_stack(
    mode: str,
    model: str | os.PathLike[str],
    log_dir: Path,
    *,
    p_cpus: str = "0",
    d_cpus: str = "1",
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    debug_log: bool = False,
    extra_server_args: Sequence[str] = (),
    vllm_no_progress_thread: bool = False,
    kvpush_extra: Mapping[str, Any] | None = None,
    max_model_len: int | None = None,
    name: str | None = None,
    prefill_args: Sequence[str] = (),
    kvpush_router_args: Sequence[str] = (),
) -> Stack:
    """A (not started) stack of ``mode`` on fresh ports (``"none"``: two plain
    vLLM servers without connector or router, the idle baseline;
    ``"single"``: one plain vLLM server on ``p_cpus``, no router, the
    no-transfer baseline of latency; it sits in the stack's ``prefill`` slot).

    ``name`` labels the stack (``Stack.mode``, server names, log folder) when
    two stacks of one mode differ only in ``kvpush_extra`` (default: ``mode``).
    ``max_model_len`` overrides :data:`kvpush_tools.demo.servers.DEFAULT_MAX_MODEL_LEN`.

    Identical for every mode except the connector: ``--no-enable-prefix-caching``
    on P and D (every request transfers its whole prompt's KV), the same KV
    cache size, block size, dtype, eager mode, pinning. ``debug_log`` sets
    ``KVPUSH_LOG_LEVEL=DEBUG`` (kvpush's per-transfer lines; no effect on
    vLLM's connectors). ``vllm_no_progress_thread`` (vLLM modes only) is an
    ablation: NIXL agents without their spinning progress thread (see
    ``tools/kvpush_tools/bench/ablation_no_prog_thread/sitecustomize.py``).
    ``kvpush_extra``: more ``kv_connector_extra_config`` keys for kvpush's P
    and D (e.g. ``{"idle_poll_max_s": 0.05}``), for experiments. ``prefill_args``: more vLLM flags for P
    alone (every mode alike: the overload profile slows P with them); ``kvpush_router_args``: more flags of
    the router in kvpush modes.
    """
    name = name or mode
    p_port, d_port, r_port, p_kv, d_kv = (srv.free_port() for _ in range(5))
    engine_id = f"bench-{name}-prefill-{p_port}"
    p_cfg, p_env, d_cfg, d_env = connector_configs(mode, p_kv, d_kv, engine_id)
    if mode in KVPUSH_MODES and kvpush_extra:
        for cfg in (p_cfg, d_cfg):
            assert cfg is not None
            cfg["kv_connector_extra_config"].update(kvpush_extra)
    env: dict[str, str] = {}
    if debug_log:
        env["KVPUSH_LOG_LEVEL"] = "DEBUG"
    ablation = vllm_no_progress_thread and mode in ("vllm-pull", "vllm-push")
    if ablation:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ABLATION_DIR), os.environ.get("PYTHONPATH", "")) if p)
    args = ["--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(kv_cache_bytes), *extra_server_args]
    logs = Path(log_dir) / name
    common: dict[str, Any] = {"log_dir": logs, "served_model_name": MODEL_NAME, "fast_start": True, "extra_args": args}
    if max_model_len is not None:
        common["max_model_len"] = max_model_len
    if mode == SINGLE:
        single = srv.vllm_server(name, model, p_port, cpus=p_cpus, env=env, **common)
        _unset_kvcache_space(single)
        info = {"mode": mode, "name": name, "cpus": p_cpus, "server_args": args, "log_dir": str(logs)}
        return Stack(name, single.url, single, None, None, single.url, info=info)
    prefill = srv.vllm_server(
        f"{name}-prefill",
        model,
        p_port,
        cpus=p_cpus,
        kv_transfer_config=p_cfg,
        env={**env, **p_env},
        check_ports=(p_kv,),
        **{**common, "extra_args": [*args, *prefill_args]},
    )
    decode = srv.vllm_server(
        f"{name}-decode",
        model,
        d_port,
        cpus=d_cpus,
        kv_transfer_config=d_cfg,
        env={**env, **d_env},
        check_ports=(d_kv,) if mode not in KVPUSH_MODES else (),
        **common,
    )
    for server in (prefill, decode):
        _unset_kvcache_space(server)
    rargs = router_args(mode, prefill.url, decode.url, p_kv, engine_id) if mode != BASELINE else []
    if mode in KVPUSH_MODES:
        rargs += list(kvpush_router_args)
    keys = p_cfg["kv_connector_extra_config"]["auth_keys_dir"] if mode in KVPUSH_MODES and p_cfg else None
    router = srv.router_server(rargs, r_port, log_dir=logs, keys=keys) if mode != BASELINE else None
    info = {
        "mode": mode,
        **({"name": name} if name != mode else {}),
        "prefill_cpus": p_cpus,
        "decode_cpus": d_cpus,
        "server_args": args,
        "prefill_args": list(prefill_args),
        "prefill_kv_transfer_config": p_cfg,
        "decode_kv_transfer_config": d_cfg,
        "router_args": rargs,
        "log_dir": str(logs),
        "ablation": "vllm_no_progress_thread" if ablation else None,
    }
    # The baseline has no router: clients talk to its D directly.
    url = router.url if router is not None else decode.url
    return Stack(name, url, prefill, decode, router, decode.url, info=info)


def _unset_kvcache_space(server: srv.ServerProcess) -> None:
    """An explicit KV size (--kv-cache-memory-bytes) instead of
    VLLM_CPU_KVCACHE_SPACE's whole GiB: six servers must fit in memory next
    to other people's work. vLLM lets that variable override the flag and
    rejects it empty, so it must be absent from the environment."""
    server.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    server.cmd = ["env", "-u", "VLLM_CPU_KVCACHE_SPACE", *server.cmd]


def attach_stack(mode: str, url: str) -> Stack:
    """A stack someone else runs: only its router URL (D's URL is read from the
    router's /health, for D's /metrics). Never paused or stopped by us."""
    import json

    url = url.rstrip("/")
    d_url = None
    status, body = http_get(url + "/health")
    if status == 200:
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            d_url = json.loads(body)["decode"][0]["url"]
    return Stack(mode, url, d_url=d_url, info={"mode": mode, "attached": url})


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
                    raise srv.ServerError(
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
            raise srv.ServerError(f"{names} not healthy after {timeout:.0f} s (logs in {pending[0].info['log_dir']})")
        if pending and now >= next_note:
            next_note = now + every
            waiting = _unique(s for st in pending for s in st.servers if s.ready_after is None)
            say(f"{now - t0:4.0f} s: waiting for " + ", ".join(s.name for s in waiting))
        time.sleep(1.0)
    for st in owned:
        st.resume()
        if st.router is not None:
            st.router.start()
            srv.wait_all_healthy([st.router], timeout=120)
        st.wait_healthy(120)
        st.pause()
    for st in stacks:
        if st.attached:
            st.wait_healthy(120)


def prompt_token_sources(d_url: str | None) -> dict[str, float]:
    """D's ``vllm:prompt_tokens_by_source_total`` per source (empty if unknown)."""
    if not d_url:
        return {}
    status, text = http_get(d_url + "/metrics", timeout=5.0)
    if status != 200:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="' in line:
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# vLLM's per-request latency histograms (seconds): the server's own view of
# where a request's time went, the same for every connector.
SERVER_HISTOGRAMS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)


def server_histograms(url: str | None) -> dict[str, tuple[float, float]]:
    """(sum, count) of :data:`SERVER_HISTOGRAMS` from a server's /metrics (empty if unknown)."""
    if not url:
        return {}
    status, text = http_get(url + "/metrics", timeout=5.0)
    if status != 200:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for name in SERVER_HISTOGRAMS:
            for suffix, i in (("_sum", 0), ("_count", 1)):
                if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                    out.setdefault(name, [0.0, 0.0])[i] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def histogram_means_ms(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean per observation (ms) of each histogram between two scrapes; names
    shortened (``vllm:request_queue_time_seconds`` -> ``request_queue_time``)."""
    out = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c1 > c0:
            out[name.removeprefix("vllm:").removesuffix("_seconds")] = 1000 * (s1 - s0) / (c1 - c0)
    return out


# --------------------------------------------------------------------------- #
# The life cycle the benchmarks share: options, building, owning, switching
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class StackOptions:
    """What shapes every stack of a run alike (keyword arguments of :func:`build_stack`)."""

    p_cpus: str = "0"
    d_cpus: str = "1"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    debug_log: bool = False
    vllm_no_progress_thread: bool = False
    kvpush_extra: Mapping[str, Any] | None = None
    max_model_len: int | None = None
    prefill_args: tuple[str, ...] = ()
    kvpush_router_args: tuple[str, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        return {
            "p_cpus": self.p_cpus,
            "d_cpus": self.d_cpus,
            "kv_cache_bytes": self.kv_cache_bytes,
            "debug_log": self.debug_log,
            "vllm_no_progress_thread": self.vllm_no_progress_thread,
            "kvpush_extra": self.kvpush_extra,
            "max_model_len": self.max_model_len,
            "prefill_args": self.prefill_args,
            "kvpush_router_args": self.kvpush_router_args,
        }


def comma_list(text: str, convert: Callable[[str], Any] = str) -> list[Any]:
    """``"a, b,,c"`` -> ``[convert("a"), convert("b"), convert("c")]``: the benchmarks' list options."""
    return [convert(x.strip()) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    """``--lengths 256,1024``-style options (argparse ``type=``)."""
    return comma_list(text, int)


def floats(text: str) -> list[float]:
    """``--qps 0.5,1``-style options (argparse ``type=``)."""
    return comma_list(text, float)


def add_stack_arguments(
    ap: argparse.ArgumentParser,
    *,
    model_dir: str = "models/tiny-qwen3",
    kv_cache_mib: int = 512,
    vllm_ablation: bool = True,
    debug_log: bool = True,
) -> None:
    """The command-line options of :class:`StackOptions` (and ``--model-dir``,
    ``--startup-timeout``), the same in every benchmark."""
    ap.add_argument("--model-dir", default=model_dir, help="where the tiny model is created (reused)")
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--kv-cache-mib", type=int, default=kv_cache_mib, help="KV cache per server (all modes alike)")
    if debug_log:
        ap.add_argument("--debug-log", action="store_true", help="KVPUSH_LOG_LEVEL=DEBUG on kvpush servers")
    ap.add_argument("--startup-timeout", type=float, default=1500.0)
    if vllm_ablation:
        ap.add_argument(
            "--vllm-no-progress-thread",
            action="store_true",
            help="ablation: vLLM's NIXL agents without their (spinning) progress thread; not a vLLM option",
        )
    ap.add_argument(
        "--kvpush-config",
        default=None,
        metavar="JSON",
        help="extra kv_connector_extra_config keys for kvpush, e.g. '{\"idle_poll_max_s\": 0.05}'",
    )


def stack_options(args: argparse.Namespace, **override: Any) -> StackOptions:
    """:class:`StackOptions` from the options of :func:`add_stack_arguments`."""
    opts: dict[str, Any] = {
        "p_cpus": args.prefill_cpus,
        "d_cpus": args.decode_cpus,
        "kv_cache_bytes": args.kv_cache_mib * 1024 * 1024,
        "debug_log": getattr(args, "debug_log", False),
        "vllm_no_progress_thread": getattr(args, "vllm_no_progress_thread", False),
        "kvpush_extra": json.loads(args.kvpush_config) if args.kvpush_config else None,
    }
    opts.update(override)
    return StackOptions(**opts)


def behind_vllm_router(base: Stack, log_dir: Path) -> Stack:
    """A stack of ``base``'s mode behind vllm-router, sharing ``base``'s P and D (not started).

    Why share one P/D pair between the two routers rather than start a pair
    per router: only one router is ever active (the other is paused with
    SIGSTOP, as an idle stack is), every run waits until the pair has drained
    before the next cell starts, and neither router keeps per-request state in
    P or D that the other could trip on: kvpush's router only tells D where
    P's KV side channel is and signs a capability, vllm-router tells D
    nothing before P answers; P and D serve both conventions (kvpush by
    design, vLLM's pull connector is vllm-router's own protocol). Sharing
    halves the servers (each ~2 GB and minutes to start on 2 cores) and
    takes one confound out of the comparison: the two routers of a mode
    drive the very same P and D processes, so a router difference is not a
    server difference. What differs per router is only the router process
    and its protocol (vllm-router: P to the end of its one-token prefill,
    then D; kvpush's router: D and P at once)."""
    if base.attached or base.prefill is None or base.decode is None:
        raise ValueError(f"{base.mode}: vllm-router needs a stack with its own P and D")
    why = unsupported(base.mode, "vllm-router")
    if why:
        raise ValueError(why)
    logs = Path(log_dir) / f"{base.mode}-vllm-router"
    router = srv.vllm_router_server(base.prefill.url, base.decode.url, srv.free_port(), log_dir=logs)
    info = {**base.info, "router": "vllm-router", "router_args": router.cmd[1:], "router_log_dir": str(logs)}
    return Stack(
        base.mode, router.url, base.prefill, base.decode, router, base.d_url, info=info, router_name="vllm-router"
    )


def build_stacks(
    modes: Sequence[str],
    model: Callable[[], str | os.PathLike[str]],
    log_dir: Path,
    opts: StackOptions,
    attached: Mapping[str, str] | None = None,
) -> dict[str, Stack]:
    """One stack per mode, in order: attached to a running router where
    ``attached`` names one, else built (not started) with ``opts``. ``model``
    is called once, and only if some stack is built (it may create the model)."""
    attached = attached or {}
    stacks: dict[str, Stack] = {}
    path: str | os.PathLike[str] | None = None
    for mode in modes:
        if mode in attached:
            stacks[mode] = attach_stack(mode, attached[mode])
            continue
        if path is None:
            path = model()
        stacks[mode] = build_stack(mode, path, log_dir, **opts.kwargs())
    return stacks


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
    returns 130, a :class:`~kvpush_tools.demo.servers.ServerError` (a server that
    did not come up, or died) 2, after saying why."""
    every = list(stacks.values()) if isinstance(stacks, Mapping) else list(stacks)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        rc = body()
        return 0 if rc is None else int(rc)
    except KeyboardInterrupt:
        say("interrupted; stopping servers")
        return 130
    except srv.ServerError as exc:
        say(f"ERROR: {exc}")
        return 2
    finally:
        say("stopping servers")
        stop_stacks(every)
        signal.signal(signal.SIGTERM, previous)
