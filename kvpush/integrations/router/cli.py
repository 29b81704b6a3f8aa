"""``kvpush router``: the command line, and running the router in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvpush.core.errors import ConfigError
from kvpush.integrations.router.app import Router
from kvpush.integrations.router.config import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_HEALTH_TIMEOUT_STRIKES,
    DEFAULT_UPSTREAM_KEEPALIVE,
    RouterConfig,
)
from kvpush.integrations.router.dp import dp_engines
from kvpush.integrations.router.pool import Instance
from kvpush.integrations.router.requests import CLIENT_PARAMS, MODES
from kvpush.integrations.router.turns import DEFAULT_INTERFERENCE
from kvpush.transport import key_set

log = logging.getLogger("kvpush.router")


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush router",
        description="OpenAI-compatible router for P/D-disaggregated vLLM (kvpush, vLLM NIXL pull or push).",
    )
    _listen_args(ap.add_argument_group("serving"))
    _instance_args(ap.add_argument_group("instances"))
    _timeout_args(ap.add_argument_group("timeouts and health checks"))
    _policy_args(ap.add_argument_group("routing policy"))
    ap.add_argument("--log-level", default="INFO")
    return ap


def _listen_args(g: argparse._ArgumentGroup) -> None:
    """Where the router listens and which connector's conventions it speaks."""
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--mode", choices=MODES, default="kvpush")


def _instance_args(g: argparse._ArgumentGroup) -> None:
    """The P and D instances; the per-P flags pair with ``--prefill`` in order."""
    g.add_argument("--prefill", action="append", default=[], metavar="URL", help="P instance (repeatable)")
    g.add_argument(
        "--prefill-kv",
        action="append",
        default=[],
        type=_hostport,
        metavar="HOST:PORT",
        help="KV side channel of the P instance at the same position (kvpush, vllm-push)",
    )
    g.add_argument(
        "--prefill-tp",
        action="append",
        default=[],
        type=int,
        metavar="N",
        help="TP size per P (one value for all, or one per --prefill; default 1)",
    )
    g.add_argument(
        "--prefill-dp",
        action="append",
        default=[],
        type=int,
        metavar="N",
        help="data-parallel engines per P (one value for all, or one per --prefill; default 1): the router "
        "picks the engine with vLLM's X-data-parallel-rank header and tells D that engine's side channel "
        "(kvpush: --prefill-kv port + rank * TP size; vllm-push: + rank)",
    )
    g.add_argument(
        "--prefill-engine-id",
        action="append",
        default=[],
        metavar="ID",
        help="vllm-push: NIXL engine id per P (else learned from the first request)",
    )
    g.add_argument("--decode", action="append", default=[], metavar="URL", help="D instance (repeatable)")
    g.add_argument(
        "--decode-dp",
        action="append",
        default=[],
        type=int,
        metavar="N",
        help="data-parallel engines per D (one value for all, or one per --decode; default 1): requests are "
        "spread over them with the X-data-parallel-rank header",
    )


def _timeout_args(g: argparse._ArgumentGroup) -> None:
    """How long the router waits on an instance, and when it stops sending to one."""
    g.add_argument("--connect-timeout", type=float, default=5.0)
    g.add_argument(
        "--upstream-keepalive",
        type=float,
        default=DEFAULT_UPSTREAM_KEEPALIVE,
        metavar="SECONDS",
        help="how long an idle connection to P or D is kept for reuse; keep it below the servers' own keep-alive "
        "(vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), or a request sent as a server closes one fails "
        f"(default {DEFAULT_UPSTREAM_KEEPALIVE:g})",
    )
    g.add_argument("--prefill-timeout", type=float, default=600.0, help="seconds for P's whole answer")
    g.add_argument("--decode-timeout", type=float, default=600.0, help="longest silence from D (seconds)")
    g.add_argument("--health-interval", type=float, default=5.0, help="seconds between /health checks (0: off)")
    g.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_HEALTH_TIMEOUT,
        metavar="SECONDS",
        help=f"how long one /health check may take (default {DEFAULT_HEALTH_TIMEOUT:g})",
    )
    g.add_argument(
        "--health-timeout-strikes",
        type=int,
        default=DEFAULT_HEALTH_TIMEOUT_STRIKES,
        metavar="N",
        help="timed-out /health checks in a row before an instance counts as unhealthy; an error answer or a "
        f"refused connection counts at once (default {DEFAULT_HEALTH_TIMEOUT_STRIKES}; 1: any timeout)",
    )


def _policy_args(g: argparse._ArgumentGroup) -> None:
    """What the router does with a failed D, a short prompt, and a client's own transfer parameters."""
    g.add_argument("--no-retry", action="store_true", help="do not retry a failed P or D on another instance")
    g.add_argument(
        "--selective",
        action="store_true",
        help="serve prompts on D alone when moving their KV costs more than computing them there; both costs "
        "are learned from the engines' metrics and the router's own timings",
    )
    g.add_argument(
        "--multi-turn",
        action="store_true",
        help="know what each D holds of a conversation (from its answers) and serve a turn whose start a D holds "
        "on that D alone when the rest is short, else through P as before (docs/design.md, Multi-turn)",
    )
    g.add_argument(
        "--turn-interference",
        type=float,
        default=DEFAULT_INTERFERENCE,
        metavar="X",
        help="with --multi-turn: how many more times D's prefill seconds count against moving the prompt through "
        f"P, for the decodes D's prefill stalls (default {DEFAULT_INTERFERENCE:g}; 0: D alone whenever it is "
        "the cheaper compute)",
    )
    g.add_argument(
        "--client-kv-params",
        choices=CLIENT_PARAMS,
        default="reject",
        help="a client's own kv_transfer_params: reject (HTTP 400, default), strip, or trust (they override the "
        "router's: only behind another router that chooses transfer ids)",
    )
    g.add_argument(
        "--capability-key",
        metavar="PATH",
        default="",
        help="the P fleet's capability key: the file `kvpush keys DIR` writes (DIR/router/capability.key) or a "
        "key set directory; default $KVPUSH_AUTH_KEYS_DIR. D gets each transfer's capability from it "
        "(docs/security.md); without it P must accept registrations without one (capability: optional)",
    )
    g.add_argument(
        "--max-prefill-queue",
        type=int,
        default=0,
        metavar="N",
        help="answer HTTP 503 (retryable, with the reason) when even the least-loaded P has N requests queued or "
        "running (default 0: no bound)",
    )
    g.add_argument(
        "--queue-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between reads of each P's queue depth from its /metrics (0: off)",
    )


_ONE_FOR_ALL = ("--prefill-tp", "--prefill-dp", "--decode-dp")
"""Options that may be given once for every instance of their role."""


def _per_instance(
    ap: argparse.ArgumentParser, name: str, values: Sequence[Any], n: int, default: Any, role: str = "--prefill"
) -> list[Any]:
    if not values:
        return [default] * n
    if len(values) == 1 and name in _ONE_FOR_ALL:
        return list(values) * n
    if len(values) != n:
        ap.error(f"{name} given {len(values)} times for {n} {role} instances (they pair in order)")
    return list(values)


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse the CLI into a validated :class:`RouterConfig`."""
    ap = build_parser()
    return _config(ap, ap.parse_args(argv))


def _config(ap: argparse.ArgumentParser, a: argparse.Namespace) -> RouterConfig:
    if not a.prefill or not a.decode:
        ap.error("give at least one --prefill and one --decode")
    n = len(a.prefill)
    kvs = _per_instance(ap, "--prefill-kv", a.prefill_kv, n, None)
    tps = _per_instance(ap, "--prefill-tp", a.prefill_tp, n, 1)
    eids = _per_instance(ap, "--prefill-engine-id", a.prefill_engine_id, n, None)
    p_dps = _per_instance(ap, "--prefill-dp", a.prefill_dp, n, 1)
    d_dps = _per_instance(ap, "--decode-dp", a.decode_dp, len(a.decode), 1, role="--decode")
    try:
        servers = [
            (Instance(url, "prefill", kv[0] if kv else None, kv[1] if kv else None, tp, eid), dp)
            for url, kv, tp, eid, dp in zip(a.prefill, kvs, tps, eids, p_dps, strict=True)
        ]
        servers += [(Instance(url, "decode"), dp) for url, dp in zip(a.decode, d_dps, strict=True)]
        engines = [e for inst, dp in servers for e in dp_engines(inst, dp, a.mode)]
        prefill = [e for e in engines if e.role == "prefill"]
        decode = [e for e in engines if e.role == "decode"]
        return RouterConfig(
            prefill=prefill,
            decode=decode,
            mode=a.mode,
            host=a.host,
            port=a.port,
            connect_timeout=a.connect_timeout,
            prefill_timeout=a.prefill_timeout,
            decode_timeout=a.decode_timeout,
            health_interval=a.health_interval,
            health_timeout=a.health_timeout,
            health_timeout_strikes=a.health_timeout_strikes,
            retry_decode=not a.no_retry,
            retry_prefill=not a.no_retry,
            client_params=a.client_kv_params,
            selective=a.selective,
            multi_turn=a.multi_turn,
            turn_interference=a.turn_interference,
            max_prefill_queue=a.max_prefill_queue,
            queue_interval=a.queue_interval,
            upstream_keepalive=a.upstream_keepalive,
            capability_key=key_set.router_capability_key(a.capability_key or key_set.keys_dir("")),
        )
    except (ValueError, ConfigError) as e:
        ap.error(str(e))
        raise  # unreachable: ap.error exits


async def serve(config: RouterConfig) -> None:
    """Run the router until cancelled."""
    router = Router(config)
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log.info(
        "kvpush router (%s) on http://%s:%d: prefill %s, decode %s",
        config.mode,
        config.host,
        config.port,
        [i.name for i in config.prefill],
        [i.name for i in config.decode],
    )
    if config.capability_key is None and config.mode in ("kvpush", "vllm-push"):
        log.warning(
            "no capability key (--capability-key, or $KVPUSH_AUTH_KEYS_DIR with router/capability.key): D gets "
            "no capability, so P refuses its registrations unless P runs with capability optional "
            "(docs/security.md)"
        )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """``kvpush router ...``: run the router in the foreground (Ctrl-C stops it)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    config = _config(ap, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0
