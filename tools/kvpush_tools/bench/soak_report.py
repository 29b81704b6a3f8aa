"""The soak's report: the summary (counts, faults, memory slopes, KV usage at the end, the servers' own
counters, the verdict) as ``soak.json`` with the samples thinned to a few hundred rows, a short text for the
terminal, and ``soak.png``: memory and KV usage over time with the fault windows shaded.

The JSON stays well under 200 KiB however long the run (samples thinned, failures and mismatches listed up
to a cap): it is committed beside the results page.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpush_tools.bench.soak_rules import FAILED, MISMATCH, OK, Record, Window, explained

MAX_ROWS = 400
MAX_LISTED = 40
SIDES = ("prefill", "decode")


def thin(rows: Sequence[dict[str, Any]], most: int = MAX_ROWS) -> list[dict[str, Any]]:
    """Every k-th row, k the smallest that keeps at most ``most`` (the last row always kept)."""
    if len(rows) <= most:
        return list(rows)
    k = -(-len(rows) // (most - 1))
    return [*rows[::k], rows[-1]] if (len(rows) - 1) % k else list(rows[::k])


def host() -> dict[str, Any]:
    """The machine and the tree: CPU model, cores, load, the commit (and whether the tree had changes)."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "tree": git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else ""),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def fault_rows(windows: Sequence[Window], records: Sequence[Record], grace_s: float) -> list[dict[str, Any]]:
    """Each fault: its window, what it did, how many failures it explains, and whether a request completed
    after its recovery (the stack served again, not only answered its health check)."""
    out = []
    for w in windows:
        mine = sum(1 for r in records if explained(r, windows, grace_s) is w)
        served = w.recovered is not None and any(r.outcome == OK and r.start >= w.recovered for r in records)
        out.append({**asdict(w), "failures_explained": mine, "served_after": served})
    return out


def listed(records: Sequence[Record], windows: Sequence[Window], grace_s: float) -> dict[str, Any]:
    """The failures (each with the fault that explains it, or none) and the mismatches, up to a cap each."""
    fails = [r for r in records if r.outcome == FAILED]
    rows = []
    for r in fails[:MAX_LISTED]:
        w = explained(r, windows, grace_s)
        rows.append({**asdict(r), "start": round(r.start, 2), "end": round(r.end, 2), "fault": w and w.name})
    mism = [asdict(r) for r in records if r.outcome == MISMATCH][:MAX_LISTED]
    return {"failures": rows, "failures_total": len(fails), "mismatches": mism}


def write(out: Path, summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Path:
    """``soak.json``: the summary and the thinned samples."""
    path = out / "soak.json"
    path.write_text(json.dumps({**summary, "series": thin(rows)}, indent=1, default=str))
    return path


def text(summary: dict[str, Any]) -> str:
    """The summary for the terminal: counts, faults, slopes, KV usage at the end, the verdict."""
    c = summary["counts"]
    lines = [
        f"requests {c['requests']}: ok {c['ok']}, aborted by the client {c['aborted']}, failed and explained"
        f" {c['failed_explained']} {c['by_fault']}, failed unexplained {c['failed_unexplained']},"
        f" mismatched {c['mismatched']}; wall {summary['wall_s'] / 60:.1f} min, load {summary['load_s'] / 60:.1f} min",
    ]
    for f in summary["faults"]:
        rec = f["recovered"]
        took = f"serving again after {rec - f['start']:.0f} s" if rec is not None else "NEVER recovered"
        lines.append(f"  {f['name']} at {f['start']:.0f} s: {took}, {f['failures_explained']} failures it explains")
    for side, m in summary["memory"].items():
        if "error" in m:
            lines.append(f"  memory {side}: {m['error']}")
        else:
            lines.append(
                f"  memory {side}: {m['mb_per_1k_requests']:+.2f} MB per 1,000 requests, {m['mb_per_min']:+.3f} MB/min"
                f" over {m['window_s'][0]:.0f}-{m['window_s'][1]:.0f} s ({m['points']} samples,"
                f" RSS {m['rss_mb_first_last'][0]:.0f} -> {m['rss_mb_first_last'][1]:.0f} MB)"
            )
    for side, e in summary["kv_at_end"].items():
        state = f"zero {e['after_s']:.1f} s after the load" if e.get("zero") else "NOT zero"
        lines.append(f"  KV usage {side}: {state} ({e.get('last')})")
    lines.append("PASSED" if not summary["verdict"] else "FAILED: " + "; ".join(summary["verdict"]))
    return "\n".join(lines)


def plot(out: Path, summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Path:
    """``soak.png``: RSS of P and D, KV usage of P and D (and D's withheld blocks), requests ended; faults
    shaded, each server's slope window drawn with its fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    mins = [r["t"] / 60 for r in rows]
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    for side in SIDES:
        axes[0].plot(mins, [r.get(f"{side}_rss_mb") for r in rows], color=colors[side], lw=1, label=f"{side} RSS")
        kv = [(r[side] or {}).get("kv") if r.get(side) is not None else None for r in rows]
        axes[1].plot(mins, [None if v is None else 100 * v for v in kv], color=colors[side], lw=1, label=f"{side}")
        m = summary["memory"].get(side, {})
        if "error" not in m and "fit_line" in m:
            (t0, y0), (t1, y1) = m["fit_line"]
            axes[0].plot([t0 / 60, t1 / 60], [y0, y1], color=colors[side], lw=3, alpha=0.5)
    quarantined = [(r.get("decode") or {}).get("quarantined") for r in rows]
    twin = axes[1].twinx()
    twin.plot(mins, quarantined, color="tab:red", lw=1, ls=":", label="decode: withheld blocks")
    twin.set_ylabel("withheld blocks")
    twin.set_ylim(0, max([1.0, *(q for q in quarantined if q is not None)]) * 1.1)
    axes[2].plot(mins, [r["ended"] for r in rows], color="k", lw=1)
    axes[0].set_ylabel("RSS of the process tree (MB)")
    axes[1].set_ylabel("vLLM KV-cache usage (%)")
    axes[2].set_ylabel("requests ended")
    axes[2].set_xlabel("minutes since the load began")
    for ax in axes:
        for f in summary["faults"]:
            end = f["recovered"] if f["recovered"] is not None else rows[-1]["t"] if rows else f["start"]
            ax.axvspan(f["start"] / 60, end / 60, color="grey", alpha=0.25)
    for f in summary["faults"]:
        axes[0].annotate(f["name"], (f["start"] / 60, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=8)
    axes[0].legend(loc="lower right", fontsize=8)
    lines, labels = axes[1].get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    axes[1].legend(lines + more, labels + more_labels, loc="upper right", fontsize=8)
    c = summary["counts"]
    fig.suptitle(
        f"soak: {c['requests']} requests, {c['ok']} ok, {c['aborted']} aborted, {c['failed_explained']} failed"
        f" (explained), {c['failed_unexplained']} unexplained, {c['mismatched']} mismatched; faults shaded",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "soak.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
