"""How each connector mode's stack is made: the servers' flags and connector configs, the router's command line,
a stack built on fresh ports, one attached to a router someone else runs, one behind vllm-router.

Every mode's servers run the same command but for the KV connector (``--no-enable-prefix-caching`` on P and D,
the same KV cache size, block size, dtype, eager mode, pinning): a difference between stacks is the connector's.
The life cycle of built stacks (start, pause, switch, stop) is :mod:`kvpush_tools.bench.stacks`'.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench.serve_summary import unsupported
from kvpush_tools.bench.server_metrics import http_get
from kvpush_tools.bench.stack_options import DEFAULT_KV_CACHE_BYTES, StackOptions
from kvpush_tools.bench.stacks import Stack
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv

MODES = ("kvpush", "vllm-pull", "vllm-push", "kvpush-selective", "kvpush-multi-turn", "kvpush-multi-turn-i0")
KVPUSH_MODES = ("kvpush", "kvpush-selective", "kvpush-multi-turn", "kvpush-multi-turn-i0")
"""Modes whose servers run kvpush (they differ only in the router's flags, :data:`ROUTER_FLAGS`)."""
ROUTER_FLAGS: dict[str, tuple[str, ...]] = {
    "kvpush-selective": ("--selective",),
    "kvpush-multi-turn": ("--multi-turn",),
    # The turn route with D's prefill counted once: D alone wherever it holds the start (an experiment).
    "kvpush-multi-turn-i0": ("--multi-turn", "--turn-interference", "0"),
}
SHARES_KVPUSH_PAIR = ("kvpush-multi-turn", "kvpush-multi-turn-i0")
"""Router-only modes that run on ``kvpush``'s P and D when both are in one run (:func:`beside`)."""
BASELINE = "none"  # plain vLLM servers, no KV connector: what an idle server costs anyway
MODEL_NAME = "tiny-qwen3"
ABLATION_DIR = Path(__file__).resolve().parent / "ablation_no_prog_thread"


def connector_configs(
    mode: str, p_kv_port: int, d_kv_port: int, engine_id: str
) -> tuple[dict[str, Any] | None, dict[str, str], dict[str, Any] | None, dict[str, str]]:
    """(P kv_transfer_config, P env, D kv_transfer_config, D env) of one mode (kvpush: with a fresh key set)."""
    if mode == BASELINE:
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
    args += ROUTER_FLAGS.get(mode, ())
    if mode != "vllm-pull":
        args += ["--prefill-kv", f"127.0.0.1:{p_kv_port}"]
    if mode == "vllm-push":
        args += ["--prefill-engine-id", engine_id]
    return [*args, "--decode", d_url]


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
    prefix_caching: bool = False,
    server_env: Mapping[str, str] | None = None,
) -> Stack:
    """A (not started) stack of ``mode`` on fresh ports (``"none"``: two plain
    vLLM servers without connector or router, the idle baseline).

    ``name`` labels the stack (``Stack.mode``, server names, log folder) when
    two stacks of one mode differ only in ``kvpush_extra`` (default: ``mode``).
    ``max_model_len`` overrides :data:`kvpush_tools.demo.servers.DEFAULT_MAX_MODEL_LEN`.

    Identical for every mode except the connector: ``--no-enable-prefix-caching``
    on P and D (every request transfers its whole prompt's KV; ``prefix_caching``
    leaves vLLM's default on, as conversations need), the same KV
    cache size, block size, dtype, eager mode, pinning. ``debug_log`` sets
    ``KVPUSH_LOG_LEVEL=DEBUG`` (kvpush's per-transfer lines; no effect on
    vLLM's connectors). ``vllm_no_progress_thread`` (vLLM modes only) is an
    ablation: NIXL agents without their spinning progress thread (see
    ``tools/kvpush_tools/bench/ablation_no_prog_thread/sitecustomize.py``).
    ``kvpush_extra``: more ``kv_connector_extra_config`` keys for kvpush's P
    and D (e.g. ``{"idle_poll_max_s": 0.05}``), for experiments. ``prefill_args``: more vLLM flags for P
    alone (every mode alike: the overload profile slows P with them); ``kvpush_router_args``: more flags of
    the router in kvpush modes. ``server_env``: more environment for P and D (every mode alike).
    """
    name = name or mode
    p_port, d_port, r_port, p_kv, d_kv = (launcher.free_port() for _ in range(5))
    engine_id = f"bench-{name}-prefill-{p_port}"
    p_cfg, p_env, d_cfg, d_env = connector_configs(mode, p_kv, d_kv, engine_id)
    if mode in KVPUSH_MODES and kvpush_extra:
        for cfg in (p_cfg, d_cfg):
            assert cfg is not None
            cfg["kv_connector_extra_config"].update(kvpush_extra)
    env: dict[str, str] = dict(server_env or {})
    if debug_log:
        env["KVPUSH_LOG_LEVEL"] = "DEBUG"
    ablation = vllm_no_progress_thread and mode in ("vllm-pull", "vllm-push")
    if ablation:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ABLATION_DIR), os.environ.get("PYTHONPATH", "")) if p)
    caching = [] if prefix_caching else ["--no-enable-prefix-caching"]
    args = [*caching, "--kv-cache-memory-bytes", str(kv_cache_bytes), *extra_server_args]
    logs = Path(log_dir) / name
    common: dict[str, Any] = {"log_dir": logs, "served_model_name": MODEL_NAME, "fast_start": True, "extra_args": args}
    if max_model_len is not None:
        common["max_model_len"] = max_model_len
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


def _unset_kvcache_space(server: launcher.ServerProcess) -> None:
    """An explicit KV size (--kv-cache-memory-bytes) instead of VLLM_CPU_KVCACHE_SPACE's whole GiB: six servers
    must fit in memory next to other people's work (:func:`kvpush_tools.demo.servers.without_kvcache_space`)."""
    server.cmd = srv.without_kvcache_space(server.env, server.cmd)


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
    router = srv.vllm_router_server(base.prefill.url, base.decode.url, launcher.free_port(), log_dir=logs)
    info = {**base.info, "router": "vllm-router", "router_args": router.cmd[1:], "router_log_dir": str(logs)}
    return Stack(
        base.mode, router.url, base.prefill, base.decode, router, base.d_url, info=info, router_name="vllm-router"
    )


def beside(base: Stack, mode: str, log_dir: Path) -> Stack:
    """A stack of router-only ``mode`` (:data:`SHARES_KVPUSH_PAIR`) on ``base``'s kvpush P and D (not started).

    Sound for the reasons :func:`behind_vllm_router` gives (one router active at a time, the pair drained
    between runs, no per-request state a router leaves in P or D); what a shared pair's prefix cache
    carries from one router's run to the other's is kept apart by each run's ``cache_salt``
    (:mod:`kvpush_tools.bench.conversation`). The comparison then differs by the router alone."""
    if base.attached or base.prefill is None or base.decode is None or base.mode != "kvpush":
        raise ValueError(f"{mode}: shares a kvpush stack with its own P and D, not {base.mode!r}")
    if mode not in SHARES_KVPUSH_PAIR:
        raise ValueError(f"{mode} does not share kvpush's pair (only {', '.join(SHARES_KVPUSH_PAIR)})")
    rargs = [*base.info["router_args"], *ROUTER_FLAGS[mode]]
    keys = base.info["prefill_kv_transfer_config"]["kv_connector_extra_config"]["auth_keys_dir"]
    logs = Path(log_dir) / mode
    router = srv.router_server(rargs, launcher.free_port(), log_dir=logs, keys=keys)
    info = {**base.info, "mode": mode, "router_args": rargs, "router_log_dir": str(logs), "shares_pair_of": "kvpush"}
    return Stack(mode, router.url, base.prefill, base.decode, router, base.d_url, info=info)


def build_stacks(
    modes: Sequence[str],
    model: Callable[[], str | os.PathLike[str]],
    log_dir: Path,
    opts: StackOptions,
    attached: Mapping[str, str] | None = None,
) -> dict[str, Stack]:
    """One stack per mode, in order: attached to a running router where
    ``attached`` names one, else built (not started) with ``opts``; a router-only mode of
    :data:`SHARES_KVPUSH_PAIR` beside a built ``kvpush`` stack runs on its P and D (:func:`beside`). ``model``
    is called once, and only if some stack is built (it may create the model)."""
    attached = attached or {}
    stacks: dict[str, Stack] = {}
    path: str | os.PathLike[str] | None = None
    shared = "kvpush" in modes and "kvpush" not in attached
    for mode in sorted(modes, key=lambda m: m in SHARES_KVPUSH_PAIR):  # kvpush's pair before those sharing it
        if mode in attached:
            stacks[mode] = attach_stack(mode, attached[mode])
            continue
        if shared and mode in SHARES_KVPUSH_PAIR:  # a router-only mode runs on kvpush's P and D
            stacks[mode] = beside(stacks["kvpush"], mode, log_dir)
            continue
        if path is None:
            path = model()
        stacks[mode] = build_stack(mode, path, log_dir, **opts.kwargs())
    return {m: stacks[m] for m in modes}
