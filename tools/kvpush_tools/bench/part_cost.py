"""What one more part costs a push in rounds, by least squares over the transfer bench's rows; and the figures
of ``kvpush bench transfer --sizes``.

A push of ``B`` bytes in parts of ``b`` takes about ``a + B / bw + n c`` with
``n = B / b`` parts of fixed cost ``c`` each (D's notification poll, its unpack
launch and poll, the credit's trip, P's wake-up and post), plus a pipeline's
fill and drain that grow with ``b`` (the first pack and the last unpack are not
overlapped). ``fits`` gives, per transport, pattern and GIL mode:

- per size, the slope of total time over part count (every measured run a
  point): ``c`` with the fill term folded in, which makes larger parts look a
  little less worth it than they are;
- across sizes, ``t = a + B x + n c + b y``: ``c`` with the bytes and the fill
  apart (where two sizes and three part sizes ran).

Only rows planned in rounds count (a push no larger than the ring takes one slot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvpush_tools.bench.transfer_plans import base_plan, size_label


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients of ``y ~ x`` (columns of ``x``) and their standard errors."""
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    dof = x.shape[0] - x.shape[1]
    if rank < x.shape[1] or dof <= 0:
        return coef, np.full_like(coef, np.nan)
    resid = y - x @ coef
    cov = np.linalg.inv(x.T @ x) * float(resid @ resid) / dof
    return coef, np.sqrt(np.diag(cov))


def fits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-part cost of each (transport, pattern, order, GIL mode): per size, and across sizes."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if base_plan(r["plan"]) == "rounds" and r.get("plan_chosen") == "rounds" and r.get("parts"):
            key = (r.get("nixl", ""), r["pattern"], r.get("order", ""), r.get("gil", ""))
            groups.setdefault(key, []).append(r)
    out: list[dict[str, Any]] = []
    for (nixl, pattern, order, gil), rs in groups.items():
        head = {"nixl": nixl, "pattern": pattern, "order": order, "gil": gil}
        pts = [(r["size"], r["parts"], r["size"] / r["parts"], it["total_s"]) for r in rs for it in r["iters"]]
        for size in sorted({p[0] for p in pts}):
            mine = [p for p in pts if p[0] == size]
            if len({p[1] for p in mine}) < 2:
                continue
            n = np.array([p[1] for p in mine], dtype=float)
            coef, se = _lstsq(np.column_stack([np.ones_like(n), n]), np.array([p[3] for p in mine]))
            out.append(
                {
                    **head,
                    "size": size,
                    "fit": "t = a + n c (one size)",
                    "per_part_ms": 1e3 * coef[1],
                    "per_part_ms_se": 1e3 * se[1],
                    "intercept_ms": 1e3 * coef[0],
                    "parts": sorted({p[1] for p in mine}),
                    "runs": len(mine),
                }
            )
        if len({p[0] for p in pts}) >= 2 and len({p[2] for p in pts}) >= 2 and len(pts) > 4:
            x = np.array([[1.0, p[0] / 2**30, p[1], p[2] / 2**20] for p in pts])
            coef, se = _lstsq(x, np.array([p[3] for p in pts]))
            out.append(
                {
                    **head,
                    "size": 0,
                    "fit": "t = a + B x + n c + b y (every size)",
                    "per_part_ms": 1e3 * coef[2],
                    "per_part_ms_se": 1e3 * se[2],
                    "intercept_ms": 1e3 * coef[0],
                    "ms_per_gib": 1e3 * coef[1],
                    "ms_per_part_mib": 1e3 * coef[3],
                    "parts": sorted({p[1] for p in pts}),
                    "runs": len(pts),
                }
            )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The fits as text, ms per part with its standard error."""
    head = f"{'nixl':<10}{'pattern':<11}{'GIL mode':<13}{'size':>6}  {'ms per part':>16}  fit"
    lines = ["per-part cost, least squares over every run:", head, "-" * (len(head) + 30)]
    for f in rows:
        size = size_label(f["size"]) if f["size"] else "all"
        cost = f"{f['per_part_ms']:.2f} ± {f['per_part_ms_se']:.2f}"
        extra = ""
        if not f["size"]:
            extra = f", {f['ms_per_gib']:.0f} ms/GiB, {f['ms_per_part_mib']:.2f} ms per MiB of part"
        lines.append(f"{f['nixl']:<10}{f['pattern']:<11}{f['gil'] or '-':<13}{size:>6}  {cost:>16}  {f['fit']}{extra}")
    return "\n".join(lines)


def _series(r: dict[str, Any], orders: bool, ring: str) -> str:
    """A row's line in the sizes figure: its plan said plainly, its order where several ran, its GIL mode."""
    name = {"coalesced": "direct", "staged": "one slot sized to the push", "rounds": f"rounds, {ring} region"}
    plan = name.get(r["plan"], r["plan"])
    return " ".join(x for x in (plan, r.get("order", "") if orders else "", r.get("gil", "")) if x)


def plot_sizes(report: dict[str, Any], path: Path) -> None:
    """GB/s over push size, a row of panels per transport and a column per pattern, a line per plan (and
    order, GIL mode): medians, bars from the slowest to the fastest run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    nets = list(dict.fromkeys(r["nixl"] for r in res))
    patterns = list(dict.fromkeys(r["pattern"] for r in res))
    orders = len({r.get("order", "") for r in res}) > 1
    ring = size_label(report.get("ring_bytes") or 0)
    fig, axes = plt.subplots(
        len(nets), len(patterns), figsize=(5 * len(patterns), 3.6 * len(nets)), squeeze=False, sharey="row"
    )
    for i, nixl in enumerate(nets):
        for j, pattern in enumerate(patterns):
            ax = axes[i][j]
            mine = [r for r in res if (r["nixl"], r["pattern"]) == (nixl, pattern)]
            for name in dict.fromkeys(_series(r, orders, ring) for r in mine):
                rs = sorted((r for r in mine if _series(r, orders, ring) == name), key=lambda r: r["size"])
                x = [r["size"] for r in rs]
                y = [r["bytes"] / r["total_s_median"] / 1e9 for r in rs]
                lo = [yy - r["bytes"] / r["total_s_max"] / 1e9 for yy, r in zip(y, rs, strict=True)]
                hi = [r["bytes"] / r["total_s_min"] / 1e9 - yy for yy, r in zip(y, rs, strict=True)]
                ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(report["sizes"], [size_label(s) for s in report["sizes"]])
            ax.set_title(f"{nixl}, D blocks {pattern}", fontsize=9)
            ax.set_xlabel("push size")
            ax.set_ylabel("GB/s, P's hand-over to D's result", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"kvpush bench transfer --sizes: median of {report['iters']} (bars: slowest to fastest run); "
        f"P and D on {report['host']['cpus']} shared CPUs",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_parts(report: dict[str, Any], path: Path) -> None:
    """Total time over part count per push size (panels) and GIL mode (lines), with each size's fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in report["results"] if r.get("plan_chosen") == "rounds" and base_plan(r["plan"]) == "rounds"]
    panels = list(dict.fromkeys((r["nixl"], r["pattern"], r["size"]) for r in res))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    fitted = {(f["nixl"], f["pattern"], f["gil"], f["size"]): f for f in report["part_cost"] if f["size"]}
    for ax, (nixl, pattern, size) in zip(axes[0], panels, strict=True):
        mine = [r for r in res if (r["nixl"], r["pattern"], r["size"]) == (nixl, pattern, size)]
        for k, gil in enumerate(dict.fromkeys(r.get("gil", "") for r in mine)):
            rs = sorted((r for r in mine if r.get("gil", "") == gil), key=lambda r: r["parts"])
            n = np.array([r["parts"] for r in rs], dtype=float)
            med = np.array([1e3 * r["total_s_median"] for r in rs])
            err = [med - [1e3 * r["total_s_min"] for r in rs], [1e3 * r["total_s_max"] for r in rs] - med]
            f = fitted.get((nixl, pattern, gil, size))
            label = (gil or "as started") + (f": {f['per_part_ms']:.2f} ms/part" if f else "")
            ax.errorbar(n, med, yerr=err, marker="o", capsize=3, color=f"C{k}", linestyle="none", label=label)
            if f is not None:
                ax.plot(n, f["intercept_ms"] + f["per_part_ms"] * n, color=f"C{k}", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{nixl}, {pattern}, {size_label(size)} push", fontsize=9)
        ax.set_xlabel("parts (push size / part size)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("ms, P's hand-over to D's result")
    fig.suptitle(
        "rounds: total time over part count, per GIL mode (busy: a pure-Python thread in P and D; cpu: the same\n"
        f"in a process beside each); median of {report['iters']}, bars min to max, dashed: least squares over "
        "every run",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
