"""Plot a GPU sweep (:mod:`kvpush_tools.bench.gpu_sweep`): TTFT and TPOT against request rate, one panel
per input length, one line per connector (median solid, p90 dashed), as the published push-vs-pull figures.

``python -m kvpush_tools.bench.plot_gpu_sweep DIR [DIR...] --out FIG.png [--json ALL.json]``: each DIR holds
``<mode>_summary.json`` files of one pass; a mode found in several DIRs is a repeat, drawn once per pass
(pass k: the k-th DIR holding that mode), so the spread between passes shows beside the difference between
connectors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

LABELS = {
    "kvpush": "kvpush defaults",
    "kvpush-hosts": "kvpush defaults, peer copies off (between hosts)",
    "kvpush-staged": "kvpush, staged plan (3 GiB staging)",
    "kvpush-peer": "kvpush, peer copies",
    "vllm-pull": "vLLM NixlConnector (pull)",
    "vllm-push": "vLLM NixlPushConnector",
}
COLORS = {
    "kvpush": "tab:red",
    "kvpush-hosts": "tab:brown",
    "kvpush-staged": "tab:purple",
    "kvpush-peer": "tab:orange",
    "vllm-pull": "tab:blue",
    "vllm-push": "tab:green",
}


MARKERS = ("o", "s", "^", "D")


def load(dirs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Mode -> its summaries, one per pass, in the order of ``dirs``."""
    out: dict[str, list[dict[str, Any]]] = {}
    for d in dirs:
        for f in sorted(d.glob("*_summary.json")):
            s = json.loads(f.read_text())
            out.setdefault(s["mode"], []).append(s)
    return out


def plot(summaries: dict[str, list[dict[str, Any]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({p["input_len"] for passes in summaries.values() for s in passes for p in s.get("points", [])})
    if not lengths:
        raise SystemExit("no points in the summaries")
    fig, axes = plt.subplots(2, len(lengths), figsize=(4.2 * len(lengths), 7), squeeze=False)
    for col, length in enumerate(lengths):
        for row, (metric, label) in enumerate((("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))):
            ax = axes[row][col]
            for mode, passes in summaries.items():
                for k, s in enumerate(passes):
                    pts = sorted((p for p in s.get("points", []) if p["input_len"] == length), key=lambda p: p["rate"])
                    if not pts:
                        continue
                    rates = [p["rate"] for p in pts]
                    color = COLORS.get(mode)
                    name = LABELS.get(mode, mode) + (f", pass {k + 1}" if len(passes) > 1 else "")
                    marker = MARKERS[k % len(MARKERS)]
                    ax.plot(rates, [p[f"median_{metric}_ms"] for p in pts], marker + "-", color=color, label=name)
                    ax.plot(rates, [p[f"p90_{metric}_ms"] for p in pts], "x--", color=color, alpha=0.5)
            if metric == "ttft":
                ax.set_yscale("log")  # connectors can differ by orders of magnitude
            ax.set_xlabel("request rate (QPS)")
            ax.set_ylabel(label)
            ax.set_title(f"input {length} tokens")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title + "  (solid: median, dashed: p90)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="all modes' summaries in one file")
    ap.add_argument("--title", default="P and D on one H200, vLLM 0.24.0, Qwen3-8B shape (random bf16)")
    args = ap.parse_args(argv)
    summaries = load(args.dirs)
    plot(summaries, args.out, args.title)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
