"""``kvpush bench plot``: summary table and TTFT/TPOT-vs-QPS figures of a ``bench serve`` folder.

Reads every ``<mode>[_via-<router>]_qps<q>_in<in>_out<out>_iter<i>.json`` in
the folder (ours, or ``vllm bench serve`` files renamed to that scheme: no
router named means kvpush's), pools the requests of all iterations per
(router, input length, QPS, mode), and writes:

* ``summary.json``: per router (``routers``), per point and mode the
  p50/p90/p99 of TTFT, TPOT and E2E, completed and failed counts,
  per-iteration medians; the ratios kvpush/vllm-pull and kvpush/vllm-push of
  the median TTFT and TPOT (and of the p90/p99 TTFT) per point; and the
  kvpush/vllm-pull ratio of each iteration's medians with its min..max (a
  ratio is only worth its spread). With one router, its rows and ratios are
  also at the top level, as before the router was a dimension;
* ``summary.txt``: the table printed at the end of a sweep (a block per router);
* ``ttft_vs_qps.png`` and ``tpot_vs_qps.png``: the seed's four-panel figures,
  one panel per input length with one colour per mode and one line style per
  router (the median, error bars from the lowest to the highest iteration's
  median; p90 dashed when there is one router), and a last panel with the
  kvpush/vLLM median ratios, error bars over the iterations' ratios.

``--compact-to DIR`` copies the run files without their per-token ``itls``
(the bulk of each file) plus the summary and figures, which is what
``docs/results/serve/`` holds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench import serve_files, serve_summary
from kvpush_tools.bench.loadgen import MODES

COLORS = {
    "kvpush": "#d62728",
    "vllm-pull": "#1f77b4",
    "vllm-push": "#2ca02c",
    "kvpush-selective": "#9467bd",
    "kvpush-multi-turn": "#ff7f0e",
    "kvpush-multi-turn-i0": "#8c564b",
}
LABELS = {
    "kvpush": "kvpush (push)",
    "vllm-pull": "vLLM NixlConnector (pull)",
    "vllm-push": "vLLM NixlPushConnector",
    "kvpush-selective": "kvpush, selective router",
    "kvpush-multi-turn": "kvpush, --multi-turn router",
    "kvpush-multi-turn-i0": "kvpush, --multi-turn --turn-interference 0",
}
Agg = Mapping[tuple[int, float, str], Mapping[str, Any]]


ROUTER_STYLES = {"kvpush": "-", "vllm-router": "--"}
ROUTER_MARKERS = {"kvpush": "o", "vllm-router": "s"}  # filled / hollow, so a lone point still shows its router
ROUTER_LABELS = {"kvpush": "kvpush router", "vllm-router": "vllm-router"}


def _spread(row: Mapping[str, Any], metric: str) -> tuple[float, float]:
    """(below, above) the pooled median: down to the lowest and up to the highest iteration's median."""
    mid = float(row[f"p50_{metric}_ms"])
    its = row.get(f"iter_median_{metric}_ms") or [mid]
    return max(0.0, mid - min(its)), max(0.0, max(its) - mid)


def plot_metric(aggs: Mapping[str, Agg], metric: str, path: Path, title: str = "") -> Path:
    """One figure: a panel per input length (``metric`` vs QPS, one colour
    per mode, one line style per router; the median with error bars from the
    lowest to the highest iteration's median; p90 dashed when there is one
    router), then a panel of the kvpush/vLLM median ratios per router, each
    with error bars over the per-iteration ratios (min..max).

    ``aggs``: per router, :func:`kvpush_tools.bench.loadgen.aggregate` of its runs.
    With three input lengths that is the seed's four panels (2 x 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = [k for agg in aggs.values() for k in agg]
    inputs = sorted({k[0] for k in every})
    modes = [m for m in MODES if any(k[2] == m for k in every)]
    routers = list(aggs)
    several = len(routers) > 1
    npanels = len(inputs) + 1
    ncols = 2 if npanels > 1 else 1
    nrows = math.ceil(npanels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    name = metric.upper()

    def shift(qps: float, i: int) -> float:
        """Routers side by side at one QPS, so their error bars do not hide each other."""
        return qps * (1 + 0.04 * (i - (len(routers) - 1) / 2))

    for ax, inp in zip(flat, inputs, strict=False):
        for ri, router in enumerate(routers):
            agg = aggs[router]
            for mode in modes:
                rows = sorted((r for k, r in agg.items() if k[0] == inp and k[2] == mode), key=lambda r: r["qps"])
                if not rows:
                    continue
                qps = [shift(r["qps"], ri) for r in rows]
                p50 = [r[f"p50_{metric}_ms"] for r in rows]
                err = list(zip(*(_spread(r, metric) for r in rows), strict=True))
                label = LABELS[mode] + (f", {ROUTER_LABELS.get(router, router)}" if several else "") + " p50"
                ax.errorbar(
                    qps,
                    p50,
                    yerr=err,
                    marker=ROUTER_MARKERS.get(router, "^") if several else "o",
                    mfc="white" if several and router != "kvpush" else COLORS[mode],
                    ls=ROUTER_STYLES.get(router, ":"),
                    color=COLORS[mode],
                    capsize=3,
                    label=label,
                )
                if not several:
                    ax.plot(qps, [r[f"p90_{metric}_ms"] for r in rows], "--", color=COLORS[mode], alpha=0.6, lw=1)
                for r, x in zip(rows, qps, strict=True):
                    if r["failed"]:
                        ax.annotate(f"{r['failed']} failed", (x, r[f"p50_{metric}_ms"]), fontsize=7)
        ax.set_title(f"{name}, input {inp} tokens")
        ax.set_xlabel("request rate (QPS)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    ax = flat[len(inputs)]
    marks = "osd^v<>"
    for ri, router in enumerate(routers):
        agg = aggs[router]
        for i, inp in enumerate(inputs):
            sub = {k: v for k, v in agg.items() if k[0] == inp}
            for other, style in (("vllm-pull", "-"), ("vllm-push", ":")):
                spreads = {(r["input_len"], r["qps"]): r for r in serve_summary.ratio_spread(sub, metric, other)}
                pts = [
                    (r["qps"], r[f"kvpush/{other}"], spreads.get((inp, r["qps"])))
                    for r in serve_summary.ratios(sub, f"median_{metric}_ms")
                    if r[f"kvpush/{other}"] is not None
                ]
                if not pts:
                    continue
                lo = [max(0.0, y - (s["min"] if s and s["min"] is not None else y)) for _, y, s in pts]
                hi = [max(0.0, (s["max"] if s and s["max"] is not None else y) - y) for _, y, s in pts]
                ax.errorbar(
                    [shift(p[0], ri) for p in pts],
                    [p[1] for p in pts],
                    yerr=[lo, hi],
                    ls=ROUTER_STYLES.get(router, style) if several else style,
                    marker=ROUTER_MARKERS.get(router, "^") if several else marks[i % len(marks)],
                    mfc="white" if several and router != "kvpush" else COLORS[other],
                    color=COLORS[other],
                    capsize=3,
                    label=f"kvpush/{other.removeprefix('vllm-')}, in {inp}"
                    + (f", {ROUTER_LABELS.get(router, router)}" if several else ""),
                )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(f"median {name} ratio (< 1: kvpush lower; bars: min..max over iterations)", fontsize=9)
    ax.set_xlabel("request rate (QPS)")
    ax.set_ylabel("ratio")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    qps_all = sorted({k[1] for k in every})
    for a in flat[:npanels]:
        a.set_xticks(qps_all, [serve_files.fmt_qps(q) for q in qps_all])  # the routers' side-by-side shift hidden
        if len(qps_all) == 1:
            a.set_xlim(qps_all[0] * 0.8, qps_all[0] * 1.2)
    for extra in flat[npanels:]:
        extra.set_visible(False)
    handles, labels = flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.962),
            ncol=min(len(handles), 3 if several else len(handles)),
            fontsize=8,
            frameon=False,
        )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.suptitle(title or f"{name} vs QPS (median, bars: min..max of the iterations' medians)", y=0.99, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.86 if several else 0.92))
    fig.savefig(path, dpi=90 if several else 110)
    plt.close(fig)
    return path


def summary(results: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    """(``summary.json``'s document, the printed table) of some runs.

    Per router (``routers``): the aggregated rows, the ratios of kvpush to
    vLLM's connectors, and ``spread_median_ttft``/``spread_median_tpot``,
    the kvpush/vllm-pull ratio per iteration with its min..max. With one
    router its rows and ratios are also at the top level, where the seed's
    summary had them."""
    aggs = {router: serve_summary.aggregate(rs) for router, rs in serve_summary.split_by_router(results).items()}
    doc: dict[str, Any] = {"sweep": _sweep_info(results)}
    if len(aggs) == 1:
        doc.update(serve_summary.summary_json(next(iter(aggs.values()))))
    doc["routers"] = {
        router: {
            **serve_summary.summary_json(agg),
            "spread_median_ttft": serve_summary.ratio_spread(agg, "ttft"),
            "spread_median_tpot": serve_summary.ratio_spread(agg, "tpot"),
        }
        for router, agg in aggs.items()
    }
    blocks = []
    for router, agg in aggs.items():
        head = f"=== behind {ROUTER_LABELS.get(router, router)} ===\n" if len(aggs) > 1 else ""
        blocks.append(head + serve_summary.summary_table(agg) + "\n\n" + serve_summary.spread_table(router, agg))
    return doc, "\n\n".join(blocks)


def write_outputs(results: Sequence[Mapping[str, Any]], out_dir: Path, plot: bool = True) -> tuple[str, int]:
    """summary.json, summary.txt and (``plot``) the two figures; returns the
    table and the total number of failed requests."""
    aggs = {router: serve_summary.aggregate(rs) for router, rs in serve_summary.split_by_router(results).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    doc, table = summary(results)
    info = doc["sweep"]
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / "summary.txt").write_text(table + "\n")
    if plot and any(aggs.values()):
        outs = "/".join(map(str, info["output_lens"]))
        its = info["iterations"]
        via = ", behind " + " / ".join(ROUTER_LABELS.get(r, r) for r in aggs) if len(aggs) > 1 else ""
        subtitle = f"{outs} output tokens, {its} iteration{'s' if its != 1 else ''}, 1P1D{via}"
        lines = "line style: router" if len(aggs) > 1 else "solid: median, dashed: p90"
        for metric in ("ttft", "tpot"):
            plot_metric(
                aggs,
                metric,
                out_dir / f"{metric}_vs_qps.png",
                f"{metric.upper()} vs QPS ({subtitle}; {lines}; bars: min..max of the iterations' medians)",
            )
    return table, sum(int(r["failed"]) for agg in aggs.values() for r in agg.values())


def _sweep_info(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ks = [r["kvpush"] for r in results]
    loads = [k["loadavg_start"][0] for k in ks if k.get("loadavg_start")]
    return {
        "runs": len(results),
        "iterations": len({k["iteration"] for k in ks}),
        "output_lens": sorted({int(k["output_len"]) for k in ks}),
        "requests": sum(len(r.get("ttfts", [])) for r in results),
        "loadavg_1min_min_median_max": ([min(loads), sorted(loads)[len(loads) // 2], max(loads)] if loads else None),
    }


def compact_copy(src: Path, dst: Path) -> int:
    """Copy every run file of ``src`` into ``dst`` without per-token ITLs; returns bytes written."""
    dst.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(src.glob("*.json")):
        if serve_files.parse_result_name(path.name) is None:
            continue
        data = serve_files.compact(json.loads(path.read_text()))
        text = json.dumps(data, separators=(",", ":")) + "\n"
        (dst / path.name).write_text(text)
        total += len(text)
    return total


def report(results_dir: Path, plot: bool = True, out_dir: Path | None = None) -> int:
    """Print the summary of ``results_dir`` and write its files; 1 if any request failed."""
    results = serve_files.load_results(results_dir)
    if not results:
        print(f"no result files in {results_dir}", file=sys.stderr)
        return 2
    out = out_dir or results_dir
    table, failed = write_outputs(results, out, plot)
    print(table)
    print(
        "\nratios are kvpush / vLLM of the medians over all iterations' requests (per iteration: of that "
        "iteration's medians): below 1 means kvpush is faster."
    )
    print(f"summary, table{' and figures' if plot else ''} in {out}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``kvpush bench plot RESULTS [--out DIR] [--compact-to DIR]``."""
    ap = argparse.ArgumentParser(prog="kvpush bench plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a kvpush bench serve results folder")
    ap.add_argument("--out", type=Path, default=None, help="where summary and figures go (default: RESULTS)")
    ap.add_argument("--compact-to", type=Path, default=None, help="also copy the runs without ITL arrays there")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    rc = report(args.results, plot=not args.no_plot, out_dir=args.out)
    if args.compact_to is not None and rc != 2:
        n = compact_copy(args.results, args.compact_to)
        write_outputs(serve_files.load_results(args.compact_to), args.compact_to, plot=not args.no_plot)
        print(f"compact copy: {n / 1024:.0f} KiB of run files in {args.compact_to}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
