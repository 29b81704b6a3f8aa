"""``kvpush bench transfer --sizes``: the transfer bench's cases at several push sizes, and what a part costs.

Each size runs in its own pair of processes per transport, one after the
other (at 2 GiB a pair holds P's and D's caches and regions: two pairs at
once would not fit a shared 24 GiB host); inside a pair, plans, patterns and
GIL modes take turns as in every run of the bench. The prompt length of each
size is the size over the shape's bytes per token; the block pool is the
request's own blocks unless ``--pool-factor`` (a shuffled request then takes
every block of the cache, in random order).

The merged report keeps every row with its size (without the per-part stage
times: thousands at small parts), a compact summary (medians, quartiles,
extremes) for docs/results, and, where plans in rounds with several part
sizes ran (``--ring-parts``), the least-squares cost of one more part
(``part_cost``). The run is handed in (``run_one``: ``transfer.run``), so this
module does not import the bench it drives.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpush_tools.bench import part_cost
from kvpush_tools.bench.transfer_plans import RING_BYTES, base_plan, parse_sizes, part_bytes_of, size_label

PEER_DEAD_S = 60.0
"""The engines' ``peer_dead_s`` unless ``--peer-dead-s``: the host backend packs a staged push's parts in one
engine step, sending no heartbeat meanwhile, and the first 2 GiB into a region not touched yet takes more
than kvpush's 10 s on a loaded 2-core host (D then rightly gives P up, and P the push)."""
_PART = re.compile(r"^at_[pd]_part\d+_")
Run = Callable[[argparse.Namespace], dict[str, Any]]
SUMMARY_KEYS = (
    "nixl",
    "size",
    "pattern",
    "plan",
    "order",
    "gil",
    "plan_chosen",
    "bytes",
    "parts",
    "descriptors_after",
    "total_s_median",
    "total_s_q1",
    "total_s_q3",
    "total_s_min",
    "total_s_max",
    "gbps",
    "pack_s_median",
    "unpack_s_median",
    "p_cpu_s_median",
    "d_cpu_s_median",
)
"""What a row of the compact summary keeps."""


def token_bytes(args: argparse.Namespace) -> int:
    """Bytes one token of the bench's shape pushes (every layer, K and V)."""
    return int(args.kv_heads * args.head_dim * args.dtype_bytes * args.layers * 2)


def tokens_for(size: int, args: argparse.Namespace) -> int:
    """The prompt length whose push is ``size`` bytes (rounded up to a whole token)."""
    return max(1, -(-size // token_bytes(args)))


def memory_estimate(args: argparse.Namespace, size: int) -> int:
    """Bytes P's and D's processes hold together at ``size``: the caches and every plan's staging region."""
    pool = 1.0 if args.pool_factor is None else args.pool_factor
    region = 0
    for plan in args.plans:
        part = part_bytes_of(plan)
        if part is not None:
            region += (args.ring_slots or 4) * part
        elif base_plan(plan) == "rounds":
            region += args.ring_bytes or RING_BYTES
        elif plan in ("staged", "auto"):
            region += size + (2 << 20)
    return int(2 * (pool * size + region))


def run_sizes(args: argparse.Namespace, run_one: Run) -> dict[str, Any]:
    """Every size in turn, each transport in its own pair of processes; the merged report."""
    nets = [(b,) for b in args.nixl_backend] if args.nixl_backend else [tuple(args.nixl_backends)]
    rows: list[dict[str, Any]] = []
    segments: list[dict[str, Any]] = []
    sub_report: dict[str, Any] = {}
    for size in args.sizes:
        for net in nets:
            sub = copy.copy(args)
            sub.tokens, sub.nixl_backend, sub.nixl_backends = tokens_for(size, args), [], list(net)
            sub.pool_factor = 1.0 if args.pool_factor is None else args.pool_factor
            sub.peer_dead_s = PEER_DEAD_S if args.peer_dead_s is None else args.peer_dead_s
            t0 = time.monotonic()
            sub_report = run_one(sub)
            h = sub_report["host"]
            segments.append(
                {
                    "size": size,
                    "nixl": "+".join(net),
                    "tokens": sub.tokens,
                    "seconds": time.monotonic() - t0,
                    "loadavg_1m_start": h["loadavg_1m_start"],
                    "loadavg_1m_end": h["loadavg_1m_end"],
                }
            )
            rows += [_lean({**r, "size": size}) for r in sub_report["results"]]
    report = {
        **{k: v for k, v in sub_report.items() if k not in ("results", "shape", "command")},
        "benchmark": "kvpush bench transfer --sizes",
        "command": " ".join(["kvpush bench transfer", *args.argv]),
        "sizes": list(args.sizes),
        "shape": {k: sub_report["shape"][k] for k in ("layers", "kv_heads", "head_dim", "dtype_bytes", "block_size")},
        "transports": ["+".join(n) for n in nets],
        "tree": _git_rev(),
        "segments": segments,
        "results": rows,
    }
    report["host"] = {**report["host"], "loadavg_1m_start": segments[0]["loadavg_1m_start"]}
    report["part_cost"] = part_cost.fits(rows)
    return report


def _git_rev() -> str:
    """The kvpush checkout's commit (``+dirty`` with changes), or ``?`` outside a git checkout."""
    import kvpush

    where = Path(kvpush.__file__).resolve().parents[1]
    git = ["git", "-C", str(where)]
    try:
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    except OSError:
        return "?"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if rev.returncode == 0 else "?"


def _lean(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its per-part stage times (``at_<side>_part<i>_...``), with the quartiles of its totals."""
    keep = {k: v for k, v in row.items() if not _PART.match(k)}
    keep["iters"] = [{k: v for k, v in r.items() if not _PART.match(k)} for r in row["iters"]]
    keep["median_run"] = {k: v for k, v in row["median_run"].items() if not k.startswith("at_")}
    totals = sorted(r["total_s"] for r in row["iters"])
    q = statistics.quantiles(totals, n=4, method="inclusive") if len(totals) > 1 else [totals[0]] * 3
    keep["total_s_q1"], keep["total_s_q3"] = q[0], q[2]
    return keep


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The compact summary of a report (docs/results): its setting, each row's medians and spread, the fits."""
    head = {k: v for k, v in report.items() if k not in ("results", "part_cost")}
    rows = [{k: r[k] for k in SUMMARY_KEYS if k in r} for r in report["results"]]
    return {**head, "results": rows, "part_cost": report["part_cost"]}


def table(report: dict[str, Any]) -> str:
    """Each row as text: median total in ms with its quartiles and extremes, GB/s, engine threads' CPU."""
    gil = any("gil" in r for r in report["results"])
    head = (
        f"{'nixl':<10}{'size':>6} {'pattern':<11}{'plan':<11}{'chosen':<8}{'parts':>6}"
        + (f" {'GIL mode':<13}" if gil else " ")
        + f"{'total ms':>10} {'[q1, q3]':<19}{'(min, max)':<19}{'GB/s':>6}{'P cpu':>7}{'D cpu':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        ms = {k: 1e3 * r[f"total_s_{k}"] for k in ("median", "q1", "q3", "min", "max")}
        quartiles, extremes = f"[{ms['q1']:.0f}, {ms['q3']:.0f}]", f"({ms['min']:.0f}, {ms['max']:.0f})"
        lines.append(
            f"{r['nixl']:<10}{size_label(r['size']):>6} {r['pattern']:<11}{r['plan']:<11}{r['plan_chosen']:<8}"
            f"{r['parts']:>6}"
            + (f" {r.get('gil', ''):<13}" if gil else " ")
            + f"{ms['median']:>10.1f} {quartiles:<19}{extremes:<19}"
            f"{r['gbps']:>6.2f}{1e3 * r['p_cpu_s_median']:>7.0f}{1e3 * r['d_cpu_s_median']:>7.0f}"
        )
    for s in report["segments"]:
        lines.append(
            f"({s['nixl']} {size_label(s['size'])}: {s['tokens']} tokens, {s['seconds']:.0f} s, load average "
            f"{s['loadavg_1m_start']:.1f} -> {s['loadavg_1m_end']:.1f})"
        )
    if report["part_cost"]:
        lines += ["", part_cost.table(report["part_cost"])]
    return "\n".join(lines)


def main(args: argparse.Namespace, run_one: Run) -> int:
    """``kvpush bench transfer --sizes``: run, print, write the report, its summary and figures."""
    biggest = memory_estimate(args, max(args.sizes))
    print(f"P and D hold about {biggest / 2**30:.1f} GiB together at {size_label(max(args.sizes))}", flush=True)
    report = run_sizes(args, run_one)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "transfer_sizes"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{stem}_summary.json").write_text(json.dumps(summary(report), indent=1))
    print(table(report))
    print(f"\nwrote {args.out / (stem + '.json')}, {stem}_summary.json", end="")
    if not args.no_plot:
        if len(report.get("gil_modes") or []) <= 1:  # a line per plan and mode: readable with one mode
            part_cost.plot_sizes(report, args.out / f"{stem}.png")
            print(f", {stem}.png", end="")
        if report["part_cost"]:
            part_cost.plot_parts(report, args.out / f"{stem}_parts.png")
            print(f", {stem}_parts.png", end="")
    print(f" (cpus {os.cpu_count()})")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The sizes' options of ``kvpush bench transfer``."""
    ap.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="run every case at each push size (e.g. 64M,512M,2G; overrides --tokens), a pair of processes "
        "per size and transport, one after the other",
    )
    ap.add_argument(
        "--pool-factor",
        type=float,
        default=None,
        help="blocks in each side's cache per block of the request (default 2, with --sizes 1)",
    )
