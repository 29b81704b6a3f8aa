"""The router's settings, validated where they are built (CLI or tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.integrations.router.pool import Instance
from kvpush.integrations.router.requests import CLIENT_PARAMS, MODES
from kvpush.integrations.router.turns import DEFAULT_INTERFERENCE

DEFAULT_HEALTH_TIMEOUT = 5.0
DEFAULT_HEALTH_TIMEOUT_STRIKES = 3
DEFAULT_UPSTREAM_KEEPALIVE = 4.0
"""Seconds the router keeps an idle connection to P or D for reuse: under the 5 s after which vLLM's HTTP
server closes one (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``). A request sent on a connection as the server closes it
is reset, and the router cannot tell whether the server had it; aiohttp's default (15 s) reuses connections
past the server's limit (docs/benchmarks-log.md, section 19)."""


@dataclass
class RouterConfig:
    """Everything the router needs; built from the CLI or by tests."""

    prefill: list[Instance]
    decode: list[Instance]
    mode: str = "kvpush"
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout: float = 5.0
    prefill_timeout: float = 600.0
    # Longest D may stay silent (before its first byte and between chunks).
    decode_timeout: float = 600.0
    health_interval: float = 5.0
    # Seconds one /health check may take: a D busy with decodes answers late while it still serves
    # (docs/benchmarks-log.md, "Caveats, all together": router health checks).
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT
    # Timed-out checks in a row before an instance counts as unhealthy.
    health_timeout_strikes: int = DEFAULT_HEALTH_TIMEOUT_STRIKES
    retry_decode: bool = True
    # A P that fails before D produced anything: the pairing again on another healthy P.
    retry_prefill: bool = True
    # A client's own kv_transfer_params: "reject" (HTTP 400), "strip", or "trust" (they override the router's).
    client_params: str = "reject"
    # Serve prompts whose measured transfer cost exceeds their prefill cost on D alone (``selective``).
    selective: bool = False
    # Multi-turn: serve a prompt whose start a D holds (a conversation's earlier turns) by the turn route
    # (``turns``): D alone when the rest is short, else today's path (docs/design.md, "Multi-turn").
    multi_turn: bool = False
    # How many more times D's prefill seconds count in the turn route, for the decodes they stall (``turns``).
    turn_interference: float = DEFAULT_INTERFERENCE
    # Backpressure: a request whose least-loaded P already has this many requests queued or running is
    # answered HTTP 503 with the reason and Retry-After at once, instead of queueing behind them (0: no bound).
    max_prefill_queue: int = 0
    # Seconds between reads of each P's queue depth from its /metrics (0: off; then only this router's count).
    queue_interval: float = 1.0
    # Seconds an idle connection to P or D is kept for reuse: below the upstream's own keep-alive
    # (DEFAULT_UPSTREAM_KEEPALIVE says why).
    upstream_keepalive: float = DEFAULT_UPSTREAM_KEEPALIVE
    # The P fleet's capability key (kvpush.core.capability): concurrent dispatch mints each transfer's capability
    # with it and sends it to D. None: D gets none (P then must accept registrations without: "optional").
    capability_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; expected one of {MODES}")
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        if not self.health_timeout > 0:
            raise ValueError(f"health_timeout must be > 0 seconds, got {self.health_timeout}")
        if self.client_params not in CLIENT_PARAMS:
            raise ValueError(f"client_params must be one of {CLIENT_PARAMS}, got {self.client_params!r}")
        if not 0 <= self.turn_interference < float("inf"):
            raise ValueError(f"turn_interference must be a finite number >= 0, got {self.turn_interference}")
        if self.max_prefill_queue < 0:
            raise ValueError(f"max_prefill_queue must be >= 0 (0: no bound), got {self.max_prefill_queue}")
        if not self.upstream_keepalive > 0:
            raise ValueError(f"upstream_keepalive must be > 0 seconds, got {self.upstream_keepalive}")
        if self.health_timeout_strikes < 1:
            raise ValueError(f"health_timeout_strikes must be >= 1, got {self.health_timeout_strikes}")
        for inst in self.prefill:
            inst.role = "prefill"
            if self.mode in ("kvpush", "vllm-push") and (inst.kv_host is None or inst.kv_port is None):
                raise ValueError(f"{inst.name}: mode {self.mode} needs its KV side-channel address (--prefill-kv)")
        for inst in self.decode:
            inst.role = "decode"
