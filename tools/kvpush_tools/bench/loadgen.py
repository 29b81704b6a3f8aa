"""Pure parts of ``kvpush bench serve``: the modes and routers a sweep compares, its load schedule, a run's
statistics. Result files: :mod:`kvpush_tools.bench.serve_files`; tables and ratios:
:mod:`kvpush_tools.bench.serve_summary`.

Nothing here starts a process or opens a socket, so the numbers the
benchmark reports (and the files it writes) are tested without servers.

Compatibility: a run's JSON uses the keys of ``vllm bench serve``'s result
file where the two overlap (``completed``, ``failed``, ``request_throughput``,
``output_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms``,
``ttfts``, ``itls``, ...), with the same definitions: TTFT is the time to the
first streamed chunk that carries a choice, ITL the gaps between such chunks,
TPOT ``(latency - ttft) / (output_tokens - 1)``, percentiles by
``numpy.percentile`` (linear interpolation), times in the arrays in seconds
and in the statistics in milliseconds. So vLLM's own tooling, and anyone who
knows it, reads our files without a translation table. kvpush's own
bookkeeping (mode, point, iteration, load average, D's prompt-token sources)
sits under the ``"kvpush"`` key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODES = ("kvpush", "vllm-pull", "vllm-push", "kvpush-selective", "kvpush-multi-turn", "kvpush-multi-turn-i0")
DEFAULT_MODES = MODES[:3]
"""What a sweep compares unless told otherwise: the connectors (``kvpush-selective``, ``kvpush-multi-turn`` and
``kvpush-multi-turn-i0`` differ only in their router: ``--selective``, ``--multi-turn``, ``--multi-turn
--turn-interference 0``)."""
ROUTERS = ("kvpush", "vllm-router")
"""The routers a sweep can put in front of a pair: kvpush's own (``kvpush router``) and the vLLM project's
``vllm-router`` (Rust, from PyPI) in its vLLM P/D mode."""
DEFAULT_ROUTER = "kvpush"
ROUTER_MODES = {"kvpush": MODES, "vllm-router": ("kvpush", "vllm-pull")}
"""The modes each router drives. vllm-router speaks only vLLM's P/D protocol (P with ``max_tokens: 1``,
then D with the ``kv_transfer_params`` P returned): kvpush answers it unchanged and vLLM's pull connector
is what it was written for, but vLLM's push connector needs D's address given to P before the prefill
(``kvpush router --mode vllm-push`` does that) and ``kvpush-selective`` is a flag of kvpush's router."""
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
METRICS = ("ttft", "tpot", "itl", "e2el")


# --------------------------------------------------------------------------- #
# Load schedule
# --------------------------------------------------------------------------- #


def poisson_arrivals(n: int, qps: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests at ``qps`` on average.

    Gaps are Gamma(shape=burstiness, scale=1/(qps*burstiness)) as in ``vllm
    bench serve``; ``burstiness=1`` is a Poisson process (exponential gaps).
    The first request goes at 0, so a run's length is the sum of ``n - 1``
    gaps and does not depend on a gap before the first request. ``qps=inf``
    sends everything at once. The same ``seed`` gives the same schedule: all
    modes of one point see the same arrivals, which is what makes their
    latencies comparable request by request.
    """
    if n <= 0:
        return []
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if math.isinf(qps):
        return [0.0] * n
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def requests_for(qps: float, duration_s: float, min_requests: int) -> int:
    """Requests of one point: ``qps * duration_s`` rounded up, at least ``min_requests``.

    Why not a fixed count: a fixed count makes low-QPS points last long and
    high-QPS points too short to build a queue; a fixed arrival window
    gives every point about the same wall time and the heavy points the
    backlog they are meant to show.
    """
    if math.isinf(qps):
        return max(1, min_requests)
    return max(min_requests, math.ceil(qps * duration_s))


def point_seed(base: int, iteration: int, input_len: int, qps: float) -> int:
    """Seed of one (iteration, point): schedules and prompts differ between
    points and iterations but are equal across modes."""
    q = 10**6 if math.isinf(qps) else round(qps * 1000)
    return (base * 1_000_003 + iteration * 10_007 + input_len * 101 + q) % (2**31)


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #


def percentile(values: Sequence[float], p: float) -> float:
    """``numpy.percentile`` with linear interpolation; 0.0 for no values (as vLLM's ``or 0``)."""
    if not len(values):
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), p))


def pword(p: float) -> str:
    """``99.0`` -> ``"99"``, ``99.9`` -> ``"99.9"`` (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def metric_stats(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms``, ``p<P>_<name>_ms`` from seconds."""
    v = np.asarray(values_s, dtype=float) if len(values_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(v.mean()) * 1000,
        f"median_{name}_ms": float(np.median(v)) * 1000,
        f"std_{name}_ms": float(v.std()) * 1000,
    }
    for p in percentiles:
        out[f"p{pword(p)}_{name}_ms"] = float(np.percentile(v, p)) * 1000
    return out


@dataclass
class RequestOutput:
    """One streamed request as the client saw it (times in seconds).

    ``start_time`` is relative to the run's start. ``ok`` needs HTTP 200 and
    at least one chunk with a choice (vLLM's definition of success).
    """

    prompt_len: int
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    start_time: float = 0.0
    error: str = ""
    text: str = ""  # the answer's text (a conversation's next turn resends it); not in the result files

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when fewer than two tokens."""
        if not self.ok or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarize(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The metric part of a ``vllm bench serve`` result for one run.

    ``duration_s`` is from the first send to the last response, as in vLLM,
    and divides the throughputs.
    """
    ok = [o for o in outputs if o.ok]
    ttfts = [o.ttft for o in ok]
    tpots = [t for o in ok if (t := o.tpot) is not None]
    itls = [x for o in ok for x in o.itl]
    e2els = [o.latency for o in ok]
    out_tokens = [o.output_tokens if o.ok else 0 for o in outputs]
    total_in = sum(o.prompt_len for o in ok)
    dur = max(duration_s, 1e-9)
    res: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": sum(out_tokens),
        "request_throughput": len(ok) / dur,
        "request_goodput": None,
        "output_throughput": sum(out_tokens) / dur,
        "total_token_throughput": (total_in + sum(out_tokens)) / dur,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        res.update(metric_stats(name, vals, percentiles))
    res.update(
        {
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": out_tokens,
            "ttfts": [_r(o.ttft) for o in outputs],
            "itls": [[_r(x) for x in o.itl] for o in outputs],
            "latencies": [_r(o.latency) for o in outputs],
            "start_times": [_r(o.start_time) for o in outputs],
            "errors": [o.error for o in outputs],
        }
    )
    return res


def _r(x: float) -> float:
    """Microsecond resolution is plenty and keeps the files small."""
    return round(float(x), 6)


Point = tuple[int, float]  # (input_len, qps)
