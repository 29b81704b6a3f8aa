"""The router's Prometheus metrics: specs here, values kept by the router."""

from __future__ import annotations

from kvpush.prometheus import LATENCY_BUCKETS, MetricSpec

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
        "kvpush_router_routes_total",
        "counter",
        "Selective router: requests by route (disaggregate; local, served by D alone; explore, would be local "
        "but disaggregated to keep the transfer cost measured).",
        ("route",),
    ),
)
