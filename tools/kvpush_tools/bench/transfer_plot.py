"""The figure of ``kvpush bench transfer``: each case's median time split by phase, grouped by block pattern."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PHASES = (
    ("D registers (finished)", "register_s_median", "#cc79a7"),
    ("prep", "prep_s_median", "#8c8c8c"),
    ("pack", "pack_s_median", "#e69f00"),
    ("WRITE (post + done)", None, "#0072b2"),
    ("unpack", "unpack_s_median", "#009e73"),
    ("other (wake-ups, notification)", None, "#d0d0d0"),
)


def _when(r: dict[str, Any]) -> str:
    """A row's order, and its GIL mode when it has one."""
    return " ".join(x for x in (r.get("order", ""), r.get("gil", "")) if x)


def plot(report: dict[str, Any], path: Path) -> None:
    """Stacked bars: median time per request split by phase, one bar per plan, grouped by block pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    patterns = list(dict.fromkeys(r["pattern"] for r in res))
    series = list(dict.fromkeys((r.get("nixl", ""), r["plan"], _when(r)) for r in res))
    several = len({n for n, _, _ in series}) > 1
    orders = len({o for _, _, o in series if o}) > 1
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(10 + 3 * several, 5))
    seen: set[str] = set()
    for i, pat in enumerate(patterns):
        for j, (nixl, plan, order) in enumerate(series):
            key = (nixl, plan, order)
            r = next(
                (x for x in res if x["pattern"] == pat and (x.get("nixl", ""), x["plan"], _when(x)) == key),
                None,
            )
            if r is None:
                continue
            x = i + (j - (len(series) - 1) / 2) * width
            m = r["median_run"]
            parts = [m.get("register_s", 0.0), m["prep_s"], m["pack_s"], m["post_s"] + m["complete_s"], m["unpack_s"]]
            parts.append(max(0.0, m["total_s"] - sum(parts)))
            bottom = 0.0
            for (name, _, color), v in zip(PHASES, parts, strict=True):
                ax.bar(x, 1e3 * v, width * 0.92, bottom=bottom, color=color, label=None if name in seen else name)
                seen.add(name)
                bottom += 1e3 * v
            chosen = f" ({r['plan_chosen']})" if plan == "auto" else ""
            over = f"{nixl}\n" if several else ""
            when = f"\n{order}" if orders and order else ""
            ax.annotate(
                f"{over}{plan}{chosen}{when}\n{r['descriptors_after']} desc\n{r['gbps']:.2f} GB/s",
                (x, bottom),
                ha="center",
                va="bottom",
                fontsize=6,
            )
    sh = report["shape"]
    ax.set_xticks(range(len(patterns)), [f"D blocks: {p}" for p in patterns])
    ax.set_ylabel("median time per request, ms")
    ax.margins(y=0.18)
    ax.set_title(
        f"one request: {sh['tokens']} tokens x {sh['layers']} layers x K/V = {sh['bytes'] / 2**20:.0f} MiB, "
        f"block {sh['block_size']} ({sh['blocks'] * sh['layers'] * 2} block-layer pieces)\n"
        f"{' vs '.join(report.get('transports', ['+'.join(report['nixl_backends'])]))} between two processes on one "
        f"host; median of {report['iters']} runs",
        fontsize=9,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="phase", title_fontsize=8)
    h = report.get("host", {})
    if "loadavg_1m_start" in h:
        fig.text(
            0.01,
            0.01,
            f"host: {h['cpus']} CPUs, load average {h['loadavg_1m_start']:.1f} -> {h['loadavg_1m_end']:.1f} "
            f"(other work on the host inflates every bar); nixl {h['nixl']}",
            fontsize=7,
            color="#555555",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
