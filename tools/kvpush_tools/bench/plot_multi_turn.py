"""The figure of ``kvpush bench serve --profile multi-turn``: median TTFT (top) and TPOT (bottom) per turn index,
one column per turn length, one colour per cell, error bars from the lowest to the highest iteration's median."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

COLORS = {
    "kvpush": "#d62728",
    "kvpush-multi-turn": "#ff7f0e",
    "kvpush-multi-turn-i0": "#8c564b",
    "vllm-pull": "#1f77b4",
    "vllm-push": "#2ca02c",
    "kvpush-selective": "#9467bd",
}


def plot(summary: Mapping[str, Any], path: Path) -> Path:
    """Draw ``summary`` (``multi_turn_summary.summary_json``) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["per_turn"]
    points = sorted({r["turn_tokens"] for r in rows})
    fig, axes = plt.subplots(2, len(points), figsize=(5.5 * len(points), 7), squeeze=False, sharex=True)
    for col, tokens in enumerate(points):
        cells = list(dict.fromkeys(r["cell"] for r in rows if r["turn_tokens"] == tokens))
        for row, metric in enumerate(("ttft", "tpot")):
            ax = axes[row][col]
            for i, cell in enumerate(cells):
                mine = [r for r in rows if r["turn_tokens"] == tokens and r["cell"] == cell]
                mine.sort(key=lambda r: r["turn"])
                x = [r["turn"] + (i - (len(cells) - 1) / 2) * 0.06 for r in mine]
                y = [r[f"median_{metric}_ms"] for r in mine]
                its = [r[f"iter_median_{metric}_ms"] or [r[f"median_{metric}_ms"]] for r in mine]
                pairs = list(zip(y, its, strict=True))
                err = [[max(0.0, m - min(v)) for m, v in pairs], [max(0.0, max(v) - m) for m, v in pairs]]
                color = COLORS.get(cell.split(" ")[0])
                style = "--" if " via " in cell else "-"
                ax.errorbar(x, y, yerr=err, fmt="o" + style, color=color, label=cell, capsize=3, lw=1.5, ms=4)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.set_title(f"new message {tokens} tokens per turn")
                ax.set_ylabel("median TTFT (ms)")
            else:
                ax.set_ylabel("median TPOT (ms)")
                ax.set_xlabel("turn")
                ax.set_xticks(sorted({r["turn"] for r in rows}))
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
