"""What the serving benchmarks read from a vLLM server's ``/metrics``: where D's prompt tokens came from
(transfer or local compute), and vLLM's own per-request latency histograms, the same instrumentation for every
connector."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET returning (status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, ""


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
