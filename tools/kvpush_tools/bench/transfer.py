"""``kvpush bench transfer``: what one large request costs to push, per plan and block pattern.

A push's cost is set less by its bytes than by its descriptor count: UCX posts
each descriptor for microseconds, so the same megabytes cost milliseconds when
they are contiguous and far more when D's blocks are scattered. This benchmark
moves one request shaped like a long prompt of a Qwen3-32B TP8 rank (64 layers
x K/V, 1 KV head x 128 dims, 2-byte elements, 16-token blocks: 4 KiB per block
and layer) between two processes over real NIXL agents, for

- block patterns (both sides draw their block ids independently): ``shuffled``
  (random ids), ``runs16`` (random runs of 16 consecutive ids), ``contiguous``;
- plans: ``per-block`` (one descriptor per block and layer, what a connector
  without coalescing posts; built here from the layouts and posted with
  ``Agent.write``), ``coalesced`` (the engine, ``plan="direct"``), ``staged``
  (the engine, ``plan="staged"``: pack, one WRITE, unpack, through one slot of
  a region sized to the push), ``rounds`` (staged in rounds through a small
  region's ring) and ``auto`` (the engine's cost model choosing); their
  settings: ``kvpush_tools.bench.transfer_plans``.

Engine plans run in each ``--orders`` (the order in which P's prefill and D's
registration meet; every total ends at D's result):

- ``registered`` (the default): D registered first, then P's prefill is
  handed over finished; from the hand-over (P plans then);
- ``finished``: what a sequential router does (P answers, then the router
  sends D): P's finished prefill is parked, then D registers; from D's
  register call, so D's and P's planning are on it;
- ``ahead``: D registered while P computes: P announces the prefill, pairs
  and plans before its KV is ready; from "KV ready" (``forward_done``).

``--tree PATH`` (repeatable) runs each kvpush tree's engines in their own
pair of processes, side by side with the same cases (an A/B against another
checkout or an old commit); ``--push-parts`` with ``--min-part-bytes`` cuts a
small staged push into parts, so per-part costs show without large copies.
``--busy-gil`` and ``--switch-intervals`` add GIL modes that take turns (a busy
Python thread in each process, as vLLM's engine loop: ``busy_gil``);
``--sizes`` runs the cases at several push sizes (``transfer_sizes``).
Each row also carries P's and D's stage times after the order's start
(``at_<side>_<stage>_s_median``) and the CPU time of each engine thread per
transfer (``p_cpu_s``, ``d_cpu_s``), which a loaded host does not inflate.

Each case runs one warm-up and ``--iters`` measured transfers, the cases
taking turns; the medians are printed, saved as JSON and drawn as a bar chart. D's cache is
zeroed before every case and compared with P's bytes after it, so a plan that
is fast because it moved the wrong bytes fails loudly.

This module is the command (its options, the table, the timeline); the request is
:mod:`~kvpush_tools.bench.transfer_shape`'s, the two processes
:mod:`~kvpush_tools.bench.transfer_side`'s, the run :mod:`~kvpush_tools.bench.transfer_run`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpush_tools.bench import busy_gil, stages, transfer_plans, transfer_plot, transfer_sizes
from kvpush_tools.bench.transfer_run import run
from kvpush_tools.bench.transfer_shape import PATTERNS

PLANS = ("per-block", "coalesced", "staged", "rounds", "auto")
ORDERS = ("registered", "finished", "ahead")


def table(report: dict[str, Any]) -> str:
    """The report as a fixed-width text table (medians; times in ms)."""
    head = (
        f"{'nixl':<11}{'pattern':<11}{'plan':<11}{'order':<11}{'chosen':<8}{'MiB':>7}{'desc before':>12}{'after':>8}"
        f"{'prep':>8}{'pack':>8}{'post':>8}{'done':>8}{'unpack':>8}{'total':>9}{'GB/s':>7}"
    )
    gil = any("gil" in r for r in report["results"])
    head += f"{'  GIL mode':<13}" if gil else ""
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        ms = {k: 1e3 * r[f"{k}_s_median"] for k in ("prep", "pack", "post", "complete", "unpack", "total")}
        lines.append(
            f"{r.get('nixl', '+'.join(report['nixl_backends'])):<11}"
            f"{r['pattern']:<11}{r['plan']:<11}{r.get('order', ''):<11}{r['plan_chosen']:<8}{r['bytes'] / 2**20:>7.0f}"
            f"{r['descriptors_before']:>12}{r['descriptors_after']:>8}"
            f"{ms['prep']:>8.1f}{ms['pack']:>8.1f}{ms['post']:>8.1f}{ms['complete']:>8.1f}{ms['unpack']:>8.1f}"
            f"{ms['total']:>9.1f}{r['gbps']:>7.2f}" + (f"  {r.get('gil', '')}" if gil else "")
        )
    for r in report["results"]:
        if "x_ahead" in r:
            lines.append(
                f"{r.get('nixl', '')} {r['pattern']} {r['plan']}: D registering after P finished takes "
                f"{r['x_ahead']:.2f}x the time of D registered ahead ({1e3 * r['total_s_median']:.2f} ms)"
            )
    return "\n".join(lines)


def timeline_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """Each engine case's median stage times (ms after its start), labelled, for ``stages``."""
    rows = []
    for r in report["results"]:
        marks = stages.medians_ms(r)
        if marks:
            label = f"{r.get('nixl', '')} {r['pattern']} {r['plan']}/{r.get('order', '')} ({r['plan_chosen']})"
            label += f" {r['gil']}" if "gil" in r else ""
            rows.append((label.strip(), marks))
    return rows


def _csv(kind: tuple[str, ...]) -> Any:
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in kind]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(kind)} (got {s!r})")
        return items

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush bench transfer",
        description="Push one long-prompt request between two processes over real NIXL, per plan and block pattern.",
    )
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096: 128 MiB per request)")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=1, help="KV heads on this rank (Qwen3-32B TP8: 1)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element (bf16: 2)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--patterns", type=_csv(PATTERNS), default=list(PATTERNS))
    ap.add_argument("--plans", type=_csv(PLANS), default=list(PLANS))
    ap.add_argument(
        "--orders",
        type=_csv(ORDERS),
        default=["registered"],
        help="when D registers: registered (before P's prefill is handed over; P plans then), finished (after "
        "it: a sequential router), ahead (while P computes: P plans before the KV is ready); several compare",
    )
    ap.add_argument("--iters", type=int, default=5, help="measured transfers per case (medians reported)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured transfers per case first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--nixl-backends", type=lambda s: s.split(","), default=["UCX"], help="the agents' NIXL backends (default UCX)"
    )
    ap.add_argument(
        "--nixl-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="compare NIXL backends: every case over each (repeatable, e.g. --nixl-backend UCX --nixl-backend "
        "LIBFABRIC; LIBFABRIC needs its libraries on LD_LIBRARY_PATH: tools/libfabric/setup.sh --ld-path)",
    )
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="PATH",
        help="run the engine of this kvpush tree (repeatable: trees side by side, cases taking turns)",
    )
    ap.add_argument("--push-parts", type=int, default=None, help="the engines' push_parts (default: kvpush's)")
    ap.add_argument(
        "--min-part-bytes",
        type=int,
        default=None,
        help="smallest part of a staged push (config min_part_bytes; lower it to cut small payloads into parts)",
    )
    ap.add_argument(
        "--part-cost-us",
        type=float,
        default=None,
        help="the cost model's fixed cost of a part (config part_cost_us; 0: always --push-parts parts)",
    )
    transfer_plans.add_arguments(ap)
    busy_gil.add_arguments(ap)
    transfer_sizes.add_arguments(ap)
    ap.add_argument("--out", type=Path, default=Path("results/bench_transfer"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpush bench transfer``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.tokens < 1 or args.iters < 1:
        print("--tokens and --iters must be >= 1", file=sys.stderr)
        return 2
    args.argv = argv
    args.plans = transfer_plans.expand(args.plans, args.ring_parts)
    if args.sizes:
        return transfer_sizes.main(args, run)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer_{args.tokens}tok"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    print("\nstage timeline (median ms after the start; ahead: P's KV ready, else the order's first call):")
    rows = timeline_rows(report)
    for label, marks in rows:
        print("\n".join(stages.lines(label, marks)))
    h = report["host"]
    print(f"(host load average {h['loadavg_1m_start']:.1f} -> {h['loadavg_1m_end']:.1f} on {h['cpus']} CPUs)")
    print(f"\nwrote {args.out / (stem + '.json')}", end="")
    if not args.no_plot:
        transfer_plot.plot(report, args.out / f"{stem}.png")
        stages.plot(rows, args.out / f"{stem}_timeline.png", f"kvpush bench transfer: {args.tokens} tokens, stages")
        print(f" and {args.out / (stem + '.png')}, {stem}_timeline.png", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
