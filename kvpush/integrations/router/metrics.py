"""The router's Prometheus metrics: specs and the fixed exposition here, values kept by the router."""

from __future__ import annotations

from kvpush.integrations.router.pool import Instance
from kvpush.observability.prometheus import LATENCY_BUCKETS, MetricSpec

ROUTER_METRICS = (
    MetricSpec(
        "kvpush_router_request_seconds",
        "histogram",
        "Router-side time per successful request and stage: prefill (P's one-token answer), decode_first_byte "
        "(D's first bytes, i.e. the pushed KV arrived and D produced output), total.",
        ("stage",),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "kvpush_router_failures_total",
        "counter",
        "Upstream failures by role and cause (connect, timeout, http_5xx, http_4xx, bad_response, stream_cut, other).",
        ("role", "cause"),
    ),
    MetricSpec(
        "kvpush_router_prefill_aborts_total",
        "counter",
        "P requests cancelled because their pairing failed first (vLLM aborts them and frees their blocks).",
        (),
    ),
    MetricSpec(
        "kvpush_router_turn_routes_total",
        "counter",
        "Multi-turn router: requests whose prompt's start a D holds, by turn route (d_alone: D computes the rest, "
        "its prefix cache serves the start; today: P prefills and pushes; push_back: P computes the rest, the "
        "start pushed to it from D).",
        ("route",),
    ),
    MetricSpec(
        "kvpush_router_routes_total",
        "counter",
        "Selective router: requests by route (disaggregate; local, served by D alone; explore, would be local "
        "but disaggregated to keep the transfer cost measured).",
        ("route",),
    ),
)


def fixed_exposition(pending: int, pending_prefill: int, counters: dict[str, int], insts: list[Instance]) -> str:
    """The router's hand-written gauges and counters in Prometheus text form.

    Their values live in the router's own fields (pending counts, outcome
    counters, each instance's load and health), not in a ``TextExposition``,
    so they are rendered from those fields here; the declared specs follow them.
    """
    lines = [
        "# HELP kvpush_router_pending_requests Client requests being proxied now.",
        "# TYPE kvpush_router_pending_requests gauge",
        f"kvpush_router_pending_requests {pending}",
        "# HELP kvpush_router_pending_transfers P (prefill) requests in flight, i.e. transfers not yet prefilled.",
        "# TYPE kvpush_router_pending_transfers gauge",
        f"kvpush_router_pending_transfers {pending_prefill}",
        "# HELP kvpush_router_requests_total Requests by outcome.",
        "# TYPE kvpush_router_requests_total counter",
    ]
    for outcome in ("ok", "client_errors", "prefill_failures", "decode_failures", "unavailable", "overloaded"):
        lines.append(f'kvpush_router_requests_total{{outcome="{outcome}"}} {counters[outcome]}')
    lines += [
        "# HELP kvpush_router_received_total Requests received on completion endpoints.",
        "# TYPE kvpush_router_received_total counter",
        f"kvpush_router_received_total {counters['requests']}",
        "# HELP kvpush_router_retries_total Requests retried on another decode instance.",
        "# TYPE kvpush_router_retries_total counter",
        f"kvpush_router_retries_total {counters['retries']}",
        "# HELP kvpush_router_instance_in_flight Requests in flight per instance.",
        "# TYPE kvpush_router_instance_in_flight gauge",
    ]
    for i in insts:
        lines.append(f'kvpush_router_instance_in_flight{{role="{i.role}",url="{i.url}"}} {i.in_flight}')
    lines += ["# HELP kvpush_router_instance_healthy 1 if healthy.", "# TYPE kvpush_router_instance_healthy gauge"]
    for i in insts:
        lines.append(f'kvpush_router_instance_healthy{{role="{i.role}",url="{i.url}"}} {int(i.healthy)}')
    return "\n".join(lines) + "\n"
