"""What ``kvpush bench serve`` reports from its result files: each point's requests pooled over the iterations, the
ratio of each mode to kvpush's, the summary table and JSON, and the router dimension (which cells a sweep runs,
the ratios behind each router with their spread over iterations). Pure: no process, no socket."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kvpush_tools.bench.loadgen import (
    DEFAULT_PERCENTILES,
    DEFAULT_ROUTER,
    MODES,
    ROUTER_MODES,
    ROUTERS,
    percentile,
    pword,
)
from kvpush_tools.bench.serve_files import fmt_qps


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
        if any(k[2] == "kvpush-multi-turn" for k in agg):
            rows[-1]["kvpush-multi-turn/kvpush"] = ratio(get("kvpush-multi-turn"), get("kvpush"))
    return rows


def _f(x: float | None, spec: str = "7.0f") -> str:
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 7
    return f"{x:{spec}}" if x is not None else "-".rjust(width)


def summary_table(agg: Mapping[tuple[int, float, str], Mapping[str, Any]], modes: Sequence[str] = MODES) -> str:
    """The end-of-sweep table: medians per mode, ratios, p90/p99 TTFT and failures per point."""
    modes = [m for m in modes if any(k[2] == m for k in agg)]
    short = {
        "kvpush": "kvpush",
        "vllm-pull": "pull",
        "vllm-push": "push",
        "kvpush-selective": "select",
        "kvpush-multi-turn": "multi",
        "kvpush-multi-turn-i0": "multi0",
    }
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
