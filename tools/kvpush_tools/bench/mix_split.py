"""``python -m kvpush_tools.bench.mix_split RESULTS``: a mixed-length sweep's TTFT and TPOT per prompt length.

``kvpush bench serve --mix`` runs points whose requests have two lengths;
its summary pools them. This splits each (QPS, mode) by prompt length, pools
the iterations, and writes ``mix_split.json`` (medians, counts, the ratio of
each mode to ``kvpush``) and ``mix_split.png`` (median TTFT vs QPS, one
panel per length) next to the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench import serve_files, serve_summary

Key = tuple[float, str, int]  # (qps, mode, prompt length)


def split(results: Sequence[dict[str, Any]]) -> dict[Key, dict[str, list[float]]]:
    """Per (qps, mode, prompt length): the completed requests' TTFT and TPOT in ms, over all iterations."""
    out: dict[Key, dict[str, list[float]]] = defaultdict(lambda: {"ttft_ms": [], "tpot_ms": []})
    for r in results:
        k = r["kvpush"]
        for i, n in enumerate(r["input_lens"]):
            if r["errors"][i]:
                continue
            row = out[(float(k["qps"]), str(k["mode"]), int(n))]
            row["ttft_ms"].append(r["ttfts"][i] * 1000)
            outl = r["output_lens"][i]
            if outl > 1:
                row["tpot_ms"].append((r["latencies"][i] - r["ttfts"][i]) / (outl - 1) * 1000)
    return out


def table(groups: dict[Key, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for (qps, mode, n), v in sorted(groups.items()):
        base = groups.get((qps, "kvpush", n))
        med = statistics.median(v["ttft_ms"]) if v["ttft_ms"] else None
        base_med = statistics.median(base["ttft_ms"]) if base and base["ttft_ms"] else None
        tpot = statistics.median(v["tpot_ms"]) if v["tpot_ms"] else None
        base_tpot = statistics.median(base["tpot_ms"]) if base and base["tpot_ms"] else None
        rows.append(
            {
                "qps": qps,
                "mode": mode,
                "prompt_len": n,
                "requests": len(v["ttft_ms"]),
                "median_ttft_ms": med,
                "median_tpot_ms": tpot,
                "ttft_vs_kvpush": serve_summary.ratio(med, base_med),
                "tpot_vs_kvpush": serve_summary.ratio(tpot, base_tpot),
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvpush_tools.bench.plot_serve import COLORS, LABELS

    lengths = sorted({r["prompt_len"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.6), squeeze=False)
    for ax, n in zip(axes[0], lengths, strict=True):
        for mode in sorted({r["mode"] for r in rows}):
            pts = [(r["qps"], r["median_ttft_ms"]) for r in rows if r["prompt_len"] == n and r["mode"] == mode]
            pts = [(q, t) for q, t in pts if t is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, "o-", color=COLORS.get(mode), label=LABELS.get(mode, mode))
        ax.set_title(f"{n}-token prompts")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("median TTFT (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush_tools.bench.mix_split", description=__doc__)
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: RESULTS)")
    a = ap.parse_args(argv)
    out = a.out or a.results
    out.mkdir(parents=True, exist_ok=True)
    rows = table(split(serve_files.load_results(a.results)))
    (out / "mix_split.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    plot(rows, out / "mix_split.png")
    for r in rows:
        ratio = r["ttft_vs_kvpush"]
        print(
            f"qps {r['qps']:>4} {r['mode']:<17} {r['prompt_len']:>5} tok: {r['requests']:>3} req, "
            f"TTFT p50 {r['median_ttft_ms']:7.1f} ms, TPOT p50 {r['median_tpot_ms'] or 0:5.1f} ms"
            + (f", x{ratio:.2f} of kvpush" if ratio is not None and r["mode"] != "kvpush" else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
