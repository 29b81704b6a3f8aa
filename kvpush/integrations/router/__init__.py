"""OpenAI-compatible router for prefill/decode disaggregated vLLM (``kvpush router``).

One module per job: ``pool`` (instances, least-loaded choice), ``requests``
(what P and D are sent per mode; clients' ``kv_transfer_params``),
``config``, ``dp`` (a data-parallel server as one instance per DP rank),
``health`` (the health rule), ``upstream`` (HTTP calls to P and
D, typed failures), ``app`` (the aiohttp application: endpoints and
lifecycle), ``pairing`` (one request's P/D pairing, its retry and the
failure policy), ``prefill_tasks`` (P's request as a task, raced against
D), ``stream`` (D's stream forwarded whole events at a time), ``answers``
(the router's own error answers), ``metrics``, ``cli``.
"""

from kvpush.integrations.router.app import Router
from kvpush.integrations.router.cli import build_parser, config_from_args, main, serve
from kvpush.integrations.router.config import RouterConfig
from kvpush.integrations.router.dp import DP_RANK_HEADER, dp_engines, dp_headers, dp_port
from kvpush.integrations.router.pool import Instance, Pool
from kvpush.integrations.router.requests import (
    MODES,
    concurrent,
    decode_body,
    decode_params,
    new_transfer_id,
    prefill_body,
)

__all__ = [
    "DP_RANK_HEADER",
    "MODES",
    "Instance",
    "Pool",
    "Router",
    "RouterConfig",
    "build_parser",
    "concurrent",
    "config_from_args",
    "decode_body",
    "decode_params",
    "dp_engines",
    "dp_headers",
    "dp_port",
    "main",
    "new_transfer_id",
    "prefill_body",
    "serve",
]
