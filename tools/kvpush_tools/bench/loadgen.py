"""Pure parts of ``kvpush bench serve``: load schedule, statistics, result files.

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

import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MODES = ("kvpush", "vllm-pull", "vllm-push", "kvpush-selective")
DEFAULT_MODES = MODES[:3]
"""What a sweep compares unless told otherwise: the connectors (``kvpush-selective`` differs only in its router)."""
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
_NAME_RE = re.compile(
    r"^(?P<mode>[A-Za-z0-9-]+?)(?:_via-(?P<router>[A-Za-z0-9-]+))?"
    r"_qps(?P<qps>[0-9.]+|inf)_in(?P<inp>\d+)_out(?P<out>\d+)_iter(?P<it>\d+)\.json$"
)


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


# --------------------------------------------------------------------------- #
# Result files
# --------------------------------------------------------------------------- #


def fmt_qps(qps: float) -> str:
    """``0.5`` -> ``"0.5"``, ``4.0`` -> ``"4"``, ``inf`` -> ``"inf"``."""
    return "inf" if math.isinf(qps) else f"{qps:g}"


def result_name(
    mode: str, qps: float, input_len: int, output_len: int, iteration: int, router: str | None = None
) -> str:
    """``<mode>[_via-<router>]_qps<q>_in<in>_out<out>_iter<i>.json``: the seed's naming, plus the router
    when one is named (a sweep always names it; files without it, the seed's and ``vllm bench serve``'s
    renamed ones, count as :data:`DEFAULT_ROUTER`'s)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if router is not None and router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; expected one of {ROUTERS}")
    via = f"_via-{router}" if router is not None else ""
    return f"{mode}{via}_qps{fmt_qps(qps)}_in{input_len}_out{output_len}_iter{iteration}.json"


def parse_result_name(name: str) -> tuple[str, float, int, int, int] | None:
    """Inverse of :func:`result_name` but the router (:func:`router_of_name`); None for other file names."""
    m = _NAME_RE.match(Path(name).name)
    if m is None or m["mode"] not in MODES or (m["router"] is not None and m["router"] not in ROUTERS):
        return None
    return m["mode"], float(m["qps"]), int(m["inp"]), int(m["out"]), int(m["it"])


def router_of_name(name: str) -> str:
    """The router a run file's name says (:data:`DEFAULT_ROUTER` when it names none)."""
    m = _NAME_RE.match(Path(name).name)
    return (m["router"] if m is not None else None) or DEFAULT_ROUTER


def write_result(directory: Path, result: Mapping[str, Any]) -> Path:
    """Write one run's JSON under its canonical name (from ``result["kvpush"]``)."""
    k = result["kvpush"]
    path = Path(directory) / result_name(
        k["mode"], k["qps"], k["input_len"], k["output_len"], k["iteration"], k.get("router")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=True) + "\n")
    return path


def load_results(directory: Path) -> list[dict[str, Any]]:
    """Every run JSON in ``directory`` whose name follows :func:`result_name`.

    The point's coordinates come from the file name (the contract), so files
    from another tool that only share the naming still load.
    """
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        key = parse_result_name(path.name)
        if key is None:
            continue
        data = json.loads(path.read_text())
        mode, qps, inp, outl, it = key
        data.setdefault("kvpush", {}).update(
            {
                "mode": mode,
                "router": router_of_name(path.name),
                "qps": qps,
                "input_len": inp,
                "output_len": outl,
                "iteration": it,
            }
        )
        out.append(data)
    return out


def compact(result: Mapping[str, Any]) -> dict[str, Any]:
    """A copy without the per-token ``itls`` and texts (the bulk of a file).

    What a committed results folder keeps: every statistic, and per request
    its TTFT, latency and token counts, enough to recompute TTFT/TPOT/E2E
    percentiles across iterations; only ITL percentiles are then frozen at
    the per-run values. The stack description (server flags, connector
    configs), equal for all runs of a sweep, is left to ``sweep.json``.
    """
    out = {k: v for k, v in result.items() if k not in ("itls", "generated_texts")}
    out["itls_dropped"] = True
    if isinstance(out.get("kvpush"), dict) and "stack" in out["kvpush"]:
        # The same for every run of a sweep: sweep.json holds it once.
        out["kvpush"] = {k: v for k, v in out["kvpush"].items() if k != "stack"}
    return out


# --------------------------------------------------------------------------- #
# Aggregation across iterations, ratios, the summary table
# --------------------------------------------------------------------------- #


def request_metrics(result: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per successful request of one run: ttft, tpot, e2el (seconds), from vLLM's arrays."""
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2el": []}
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    for ttft, lat, n, err in zip(result["ttfts"], result["latencies"], result["output_lens"], errors, strict=True):
        if err:
            continue
        out["ttft"].append(ttft)
        out["e2el"].append(lat)
        if n > 1:
            out["tpot"].append((lat - ttft) / (n - 1))
    return out


Point = tuple[int, float]  # (input_len, qps)


def aggregate(results: Iterable[Mapping[str, Any]]) -> dict[tuple[int, float, str], dict[str, Any]]:
    """Per (input_len, qps, mode): percentiles over the requests of all iterations.

    Pooling requests (rather than averaging per-iteration medians) weighs every
    request equally; the per-iteration medians are kept too
    (``iter_median_ttft_ms``) to show how much the point moved between
    iterations, i.e. the noise floor of a shared 2-core machine.
    """
    pooled: dict[tuple[int, float, str], dict[str, Any]] = {}
    for r in results:
        k = r["kvpush"]
        key = (int(k["input_len"]), float(k["qps"]), str(k["mode"]))
        agg = pooled.setdefault(
            key,
            {"ttft": [], "tpot": [], "e2el": [], "itl_p50": [], "completed": 0, "failed": 0, "iters": {}, "runs": 0},
        )
        m = request_metrics(r)
        for name in ("ttft", "tpot", "e2el"):
            agg[name] += m[name]
        agg["itl_p50"].append(r.get("median_itl_ms", 0.0))
        agg["completed"] += int(r.get("completed", 0))
        agg["failed"] += int(r.get("failed", 0))
        agg["runs"] += 1
        for side, means in (k.get("server_means_ms") or {}).items():
            for name, v in means.items():
                agg.setdefault("server", {}).setdefault(side, {}).setdefault(name, []).append(v)
        agg["iters"][int(k["iteration"])] = {
            "median_ttft_ms": percentile(m["ttft"], 50) * 1000,
            "median_tpot_ms": percentile(m["tpot"], 50) * 1000,
        }
    out: dict[tuple[int, float, str], dict[str, Any]] = {}
    for key, agg in pooled.items():
        row: dict[str, Any] = {
            "input_len": key[0],
            "qps": key[1],
            "mode": key[2],
            "runs": agg["runs"],
            "completed": agg["completed"],
            "failed": agg["failed"],
        }
        for name in ("ttft", "tpot", "e2el"):
            for p in DEFAULT_PERCENTILES:
                row[f"p{pword(p)}_{name}_ms"] = percentile(agg[name], p) * 1000
            row[f"median_{name}_ms"] = row[f"p50_{name}_ms"]
        row["median_itl_ms"] = statistics.median(agg["itl_p50"]) if agg["itl_p50"] else 0.0
        its = [agg["iters"][i] for i in sorted(agg["iters"])]
        row["iterations"] = sorted(agg["iters"])
        row["iter_median_ttft_ms"] = [x["median_ttft_ms"] for x in its]
        row["iter_median_tpot_ms"] = [x["median_tpot_ms"] for x in its]
        if agg.get("server"):
            # vLLM's own per-request histograms (queue, prefill, decode, TTFT) on P and D, averaged over runs.
            row["server_means_ms"] = {
                side: {name: statistics.fmean(v) for name, v in sorted(names.items())}
                for side, names in agg["server"].items()
            }
        out[key] = row
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is 0 (never a fake infinity)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(
    agg: Mapping[tuple[int, float, str], Mapping[str, Any]], metric: str = "median_ttft_ms"
) -> list[dict[str, Any]]:
    """Per point: kvpush/vllm-pull and kvpush/vllm-push of ``metric``.

    Below 1 means kvpush is lower (better); a point where a mode is missing
    gets None for that ratio.
    """
    rows = []
    selective = any(k[2] == "kvpush-selective" for k in agg)
    for inp, qps in sorted({(k[0], k[1]) for k in agg}):

        def get(mode: str, inp: int = inp, qps: float = qps) -> float | None:
            row = agg.get((inp, qps, mode))
            return None if row is None else float(row[metric])

        rows.append(
            {
                "input_len": inp,
                "qps": qps,
                "kvpush/vllm-pull": ratio(get("kvpush"), get("vllm-pull")),
                "kvpush/vllm-push": ratio(get("kvpush"), get("vllm-push")),
            }
        )
        if selective:
            rows[-1]["kvpush-selective/kvpush"] = ratio(get("kvpush-selective"), get("kvpush"))
    return rows


def _f(x: float | None, spec: str = "7.0f") -> str:
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 7
    return f"{x:{spec}}" if x is not None else "-".rjust(width)


def summary_table(agg: Mapping[tuple[int, float, str], Mapping[str, Any]], modes: Sequence[str] = MODES) -> str:
    """The end-of-sweep table: medians per mode, ratios, p90/p99 TTFT and failures per point."""
    modes = [m for m in modes if any(k[2] == m for k in agg)]
    short = {"kvpush": "kvpush", "vllm-pull": "pull", "vllm-push": "push", "kvpush-selective": "select"}
    head1 = f"{'in':>5} {'qps':>4} | " + " ".join(f"{short[m]:>7}" for m in modes)
    head = (
        head1
        + " | k/pull k/push | "
        + " ".join(f"{short[m]:>7}" for m in modes)
        + " | k/pull k/push | "
        + " ".join(f"{short[m] + ' p90/p99':>16}" for m in modes)
        + " | fail"
    )
    title = (
        f"{'':>10} | {'median TTFT (ms)':^{8 * len(modes) - 1}} | {'':13} | "
        f"{'median TPOT (ms)':^{8 * len(modes) - 1}} | {'':13} | {'TTFT p90/p99 (ms)':^{17 * len(modes) - 1}} |"
    )
    lines = [title, head, "-" * len(head)]
    rt = {(r["input_len"], r["qps"]): r for r in ratios(agg, "median_ttft_ms")}
    rp = {(r["input_len"], r["qps"]): r for r in ratios(agg, "median_tpot_ms")}
    for inp, qps in sorted({(k[0], k[1]) for k in agg}):
        rows = [agg.get((inp, qps, m)) for m in modes]
        ttft = " ".join(_f(r["median_ttft_ms"] if r else None) for r in rows)
        tpot = " ".join(_f(r["median_tpot_ms"] if r else None, "7.1f") for r in rows)
        tails = " ".join((f"{r['p90_ttft_ms']:7.0f}/{r['p99_ttft_ms']:<8.0f}" if r else f"{'-':>16}") for r in rows)
        fails = sum(int(r["failed"]) for r in rows if r)
        a, b = rt[(inp, qps)], rp[(inp, qps)]
        lines.append(
            f"{inp:>5} {fmt_qps(qps):>4} | {ttft} | {_f(a['kvpush/vllm-pull'], '6.2f')} "
            f"{_f(a['kvpush/vllm-push'], '6.2f')} | {tpot} | {_f(b['kvpush/vllm-pull'], '6.2f')} "
            f"{_f(b['kvpush/vllm-push'], '6.2f')} | {tails} | {fails}"
        )
    return "\n".join(lines)


def summary_json(agg: Mapping[tuple[int, float, str], Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregated rows and ratios as one JSON document (``summary.json``)."""
    return {
        "points": [agg[k] for k in sorted(agg)],
        "ratios_median_ttft": ratios(agg, "median_ttft_ms"),
        "ratios_median_tpot": ratios(agg, "median_tpot_ms"),
        "ratios_p90_ttft": ratios(agg, "p90_ttft_ms"),
        "ratios_p99_ttft": ratios(agg, "p99_ttft_ms"),
    }


# --------------------------------------------------------------------------- #
# The router dimension: cells, and ratios with their spread over iterations
# --------------------------------------------------------------------------- #


class Cell(NamedTuple):
    """One thing a sweep measures at every point: a KV connector mode behind one router."""

    mode: str
    router: str

    @property
    def label(self) -> str:
        """``kvpush`` behind kvpush's router (the seed's label), else ``<mode> via <router>``."""
        return self.mode if self.router == DEFAULT_ROUTER else f"{self.mode} via {self.router}"


def unsupported(mode: str, router: str) -> str | None:
    """Why ``router`` cannot drive ``mode`` (None when it can)."""
    if router not in ROUTERS:
        return f"unknown router {router!r}; expected one of {ROUTERS}"
    if mode not in ROUTER_MODES[router]:
        return f"{router} does not drive mode {mode} (it drives {', '.join(ROUTER_MODES[router])})"
    return None


def plan_cells(modes: Sequence[str], routers: Sequence[str]) -> tuple[list[Cell], list[tuple[Cell, str]]]:
    """(cells to run, (cell, reason) skipped): every mode behind every router that drives it.

    Router-major order (all of the first router's modes, then the next's), so
    with one router the cells are the modes in the order given, as before.
    The caller decides whether a skipped cell is an error (the user named
    that combination) or a stated skip (a sweep over all modes)."""
    cells: list[Cell] = []
    skipped: list[tuple[Cell, str]] = []
    for router in routers:
        for mode in modes:
            why = unsupported(mode, router)
            if why is None:
                cells.append(Cell(mode, router))
            else:
                skipped.append((Cell(mode, router), why))
    return cells, skipped


def split_by_router(results: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Run records per router (:data:`DEFAULT_ROUTER` for records without one), routers in :data:`ROUTERS` order."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by.setdefault(str(r["kvpush"].get("router") or DEFAULT_ROUTER), []).append(r)
    order = [*ROUTERS, *sorted(set(by) - set(ROUTERS))]
    return {k: by[k] for k in order if k in by}


def ratio_spread(
    agg: Mapping[tuple[int, float, str], Mapping[str, Any]], metric: str = "ttft", base: str = "vllm-pull"
) -> list[dict[str, Any]]:
    """Per point: kvpush/``base`` of the median ``metric``, pooled and per iteration, with min..max.

    The per-iteration ratio divides kvpush's median of one iteration by
    ``base``'s median of the *same* iteration: the two ran back to back at
    that point (interleaved), so they shared that moment's load, and the
    spread over iterations is how far one run's ratio can be trusted. Points
    where either mode is missing are left out."""
    rows = []
    for inp, qps in sorted({(k[0], k[1]) for k in agg}):
        a, b = agg.get((inp, qps, "kvpush")), agg.get((inp, qps, base))
        if a is None or b is None:
            continue
        key = f"iter_median_{metric}_ms"
        ia = dict(zip(a.get("iterations", range(len(a[key]))), a[key], strict=True))
        ib = dict(zip(b.get("iterations", range(len(b[key]))), b[key], strict=True))
        per = [ratio(ia[i], ib[i]) for i in sorted(set(ia) & set(ib))]
        vals = [x for x in per if x is not None]
        rows.append(
            {
                "input_len": inp,
                "qps": qps,
                "metric": f"median_{metric}_ms",
                f"kvpush/{base}": ratio(a[f"median_{metric}_ms"], b[f"median_{metric}_ms"]),
                "iterations": sorted(set(ia) & set(ib)),
                "per_iteration": per,
                "min": min(vals) if vals else None,
                "max": max(vals) if vals else None,
                "kvpush_iter_medians_ms": [ia[i] for i in sorted(ia)],
                f"{base}_iter_medians_ms": [ib[i] for i in sorted(ib)],
            }
        )
    return rows


def spread_table(router: str, agg: Mapping[tuple[int, float, str], Mapping[str, Any]]) -> str:
    """Per point behind ``router``: each iteration's median TTFT and TPOT of kvpush and vllm-pull, and
    their ratio per iteration (min..max), next to the pooled ratio."""
    lines = [f"behind {router}: per-iteration medians (ms) and kvpush/vllm-pull per iteration, pooled [min..max]"]
    for metric in ("ttft", "tpot"):
        for r in ratio_spread(agg, metric):
            ks = " ".join(f"{x:.1f}" for x in r["kvpush_iter_medians_ms"])
            ps = " ".join(f"{x:.1f}" for x in r["vllm-pull_iter_medians_ms"])
            per = " ".join(_f(x, "4.2f") for x in r["per_iteration"])
            lines.append(
                f"  {metric.upper():4} in {r['input_len']:>5} qps {fmt_qps(r['qps']):>4}: kvpush [{ks}] pull [{ps}]"
                f" -> ratios [{per}], pooled {_f(r['kvpush/vllm-pull'], '4.2f')}"
                f" [{_f(r['min'], '4.2f')}..{_f(r['max'], '4.2f')}]"
            )
    return "\n".join(lines)
