"""``kvpush bench serve``: kvpush against vLLM's NIXL connectors under a Poisson load.

For each mode -- ``kvpush`` (our connector), ``vllm-pull`` (vLLM's
``NixlConnector``) and ``vllm-push`` (vLLM's ``NixlPushConnector``) -- a 1P1D
pair with the same tiny model and flags runs behind the router in the
matching mode (see :mod:`kvpush_tools.bench.stack_build`). A streaming client sends
Poisson arrivals and measures, per request, TTFT, the inter-token gaps
(ITL), TPOT and end-to-end latency, the way ``vllm bench serve`` does.

The sweep is QPS x input length, several iterations, with the modes
*interleaved*: for each iteration, for each point, every mode runs once, in
an order rotated from point to point. Drift of a shared machine (other
people's jobs come and go) then hits all modes alike, and each mode runs
first, second and third equally often. All three stacks stay up; the two
not being measured are paused (SIGSTOP), so they cost neither CPU nor
restarts. Every mode of a point sees the same arrival times and the same
prompts.

The router is a dimension too (``--routers kvpush,vllm-router``): a *cell*
is (mode, router), and every cell of a point runs once per iteration, the
cells' order rotated as the modes' is. kvpush's own router drives every
mode; vllm-router (the vLLM project's, in its P/D mode) drives ``kvpush``
and ``vllm-pull`` only (:data:`kvpush_tools.bench.loadgen.ROUTER_MODES`): naming
another mode with it is refused, a sweep over the default modes skips it and
says so. The two routers of one mode share that mode's P and D
(:func:`kvpush_tools.bench.stack_build.behind_vllm_router` says why that is sound).

Each run is written as ``<mode>_via-<router>_qps<q>_in<in>_out<out>_iter<i>.json``
(fields of ``vllm bench serve`` where they overlap, see
:mod:`kvpush_tools.bench.serve_files`); at the end come ``summary.json``, a table with,
per router, the ratios kvpush/vllm-pull and kvpush/vllm-push per point and
each iteration's kvpush/vllm-pull ratio with its min..max, and the
TTFT/TPOT-vs-QPS figures (:mod:`kvpush_tools.bench.plot_serve`). Three
iterations by default: one load cell of a 2-core host moves several fold
between runs, so a ratio is only worth its spread.

Examples::

    kvpush bench serve --quick                       # one point, one iteration (~5 min with startup)
    kvpush bench serve                               # the default sweep, 3 iterations (~45-60 min on 2 busy cores)
    kvpush bench serve --inputs 1024 --qps 1,2 --iterations 3
    kvpush bench serve --modes kvpush,vllm-pull --routers kvpush,vllm-router --inputs 1024 --qps 1
    kvpush bench serve --attach kvpush=http://127.0.0.1:8000 --modes kvpush
    kvpush bench serve --profile multi-turn --turn-tokens 1024,4096 --turns 4 --conversations 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench import multi_turn, overload, serve_summary
from kvpush_tools.bench.loadgen import DEFAULT_MODES, DEFAULT_ROUTER, MODES, ROUTERS
from kvpush_tools.bench.serve_summary import Cell
from kvpush_tools.bench.serve_sweep import parse_mix, run_sweep, say
from kvpush_tools.bench.stack_build import behind_vllm_router, build_stacks
from kvpush_tools.bench.stack_options import StackOptions, add_stack_arguments, comma_list, floats, ints, stack_options
from kvpush_tools.bench.stacks import Stack, run_with_stacks, start_stacks

DEFAULT_INPUTS = (256, 1024, 2048)
DEFAULT_QPS = (0.5, 1.0, 2.0, 4.0)
DEFAULT_OUTPUT = 64
DEFAULT_ITERATIONS = 3


def choose_cells(modes: Sequence[str], routers: Sequence[str], named_modes: bool) -> tuple[list[Cell], str | None]:
    """The cells of a sweep, or an error: (cells, None) or ([], why).

    A combination no router drives is refused when the user named the modes
    (they asked for it: running something else silently would answer another
    question), and skipped with the reason said when the modes are the
    default set (a sweep "over all" means all that exist)."""
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        return [], f"unknown router(s) {bad or routers}; choose from {ROUTERS}"
    cells, skipped = serve_summary.plan_cells(modes, routers)
    if skipped and named_modes:
        return [], "refused: " + "; ".join(f"{c.mode} behind {c.router}: {why}" for c, why in skipped)
    for c, why in skipped:
        say(f"skipping {c.mode} behind {c.router}: {why}")
    if not cells:
        return [], "nothing to run"
    return cells, None


def build_cells(
    cells: Sequence[Cell],
    model: Callable[[], str | os.PathLike[str]],
    log_dir: Path,
    opts: StackOptions,
    attached: Mapping[str, str] | None = None,
) -> dict[Cell, Stack]:
    """A stack per cell, in the cells' order: one P/D pair per mode, behind
    kvpush's router and/or a vllm-router sharing that pair
    (:func:`~kvpush_tools.bench.stack_build.behind_vllm_router`). An attached
    stack (``--attach MODE=URL``) is its mode's kvpush-router cell only."""
    base = build_stacks(list(dict.fromkeys(c.mode for c in cells)), model, log_dir, opts, attached)
    out: dict[Cell, Stack] = {}
    for c in cells:
        out[c] = base[c.mode] if c.router == DEFAULT_ROUTER else behind_vllm_router(base[c.mode], log_dir)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush bench serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated subset of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)}: the modes a router "
        "does not drive are then skipped, with the reason; named ones are refused)",
    )
    ap.add_argument(
        "--routers",
        default=DEFAULT_ROUTER,
        help=f"comma-separated subset of {', '.join(ROUTERS)}: each mode runs behind each router that drives it",
    )
    ap.add_argument("--inputs", type=ints, default=list(DEFAULT_INPUTS), help="input lengths in tokens")
    ap.add_argument(
        "--mix",
        type=parse_mix,
        default=None,
        metavar="TOKENS:SHARE",
        help="mixed lengths: each request is TOKENS long with probability SHARE, else the point's input length "
        "(e.g. 64:0.5); the draw is seeded per point, the same for every mode",
    )
    ap.add_argument("--qps", type=floats, default=list(DEFAULT_QPS), help="request rates (requests/s)")
    ap.add_argument("--output", type=int, default=DEFAULT_OUTPUT, help="output tokens per request (ignore_eos)")
    ap.add_argument(
        "--iterations", type=int, default=DEFAULT_ITERATIONS, help="interleaved repeats; the spread shown is over them"
    )
    ap.add_argument("--window", type=float, default=10.0, help="seconds of arrivals per point: N = ceil(qps*window)")
    ap.add_argument("--min-requests", type=int, default=6, help="at least this many requests per point")
    ap.add_argument("--max-requests", type=int, default=24, help="at most this many requests per point")
    ap.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson (gamma shape of the gaps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds between warm-up and a run")
    ap.add_argument("--quick", action="store_true", help="one point (1024 tokens, 1 QPS), one iteration, 6 requests")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default results/bench_serve/<time>)")
    add_stack_arguments(ap)
    ap.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="MODE=URL",
        help="use a running router for MODE instead of starting a stack (never paused)",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    overload.add_arguments(ap)
    multi_turn.add_arguments(ap)
    return ap


def source_state() -> dict[str, Any]:
    """The commit benchmarked and the kvpush files that differed from it.

    Servers import kvpush from the working tree (editable install), which
    others edit concurrently; a result is only reproducible with this."""
    import subprocess

    root = Path(__file__).resolve().parents[3]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=20).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "kvpush").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty_kvpush_files": dirty}


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; 0 when every request of every run succeeded, 1 if some failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    named_modes = args.modes is not None
    args.modes = comma_list(args.modes) if named_modes else list(DEFAULT_MODES)
    if args.profile == "multi-turn":
        multi_turn.apply_profile(args, parser.parse_args([]), named_modes)
    args.routers = comma_list(args.routers)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        print(f"unknown mode(s) {bad}; choose from {MODES}", file=sys.stderr)
        return 2
    cells, why_not = choose_cells(args.modes, args.routers, named_modes)
    if not why_not and args.profile == "overload" and args.routers != [DEFAULT_ROUTER]:
        why_not = "--profile overload runs behind kvpush's router only"
    if why_not:
        print(why_not, file=sys.stderr)
        return 2
    if args.quick:
        args.inputs, args.qps, args.iterations = [1024], [1.0], 1
        args.min_requests = args.max_requests = 6
    opts = stack_options(args)
    if args.profile == "multi-turn":
        env = {} if args.onednn_cache < 0 else {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(args.onednn_cache)}
        opts = stack_options(args, prefix_caching=True, max_model_len=args.max_model_len, server_env=env)
    if args.profile == "overload":
        overload.apply_profile(args, parser.parse_args([]))
        opts = stack_options(
            args,
            prefill_args=tuple(args.overload_prefill_args.split()),
            kvpush_router_args=tuple(args.overload_router_args.split()),
        )
    attached = dict(a.split("=", 1) for a in args.attach)
    out_dir = args.out or Path("results/bench_serve") / time.strftime("run-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"results in {out_dir}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    def make_model() -> Path:
        from kvpush_tools.demo.tiny_model import make_tiny_model

        if args.profile == "multi-turn":
            return multi_turn.make_model(args.model_dir)
        return make_tiny_model(args.model_dir)

    try:
        stacks = build_cells(cells, make_model, out_dir / "logs", opts, attached)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2

    def run() -> int | None:
        t0 = time.monotonic()
        start_stacks(list(stacks.values()), say, timeout=args.startup_timeout)
        say(f"all stacks healthy after {time.monotonic() - t0:.0f} s")
        (out_dir / "sweep.json").write_text(
            json.dumps(
                {
                    "argv": sys.argv[1:] if argv is None else argv,
                    "modes": args.modes,
                    "routers": args.routers,
                    "cells": [list(c) for c in stacks],
                    "profile": args.profile,
                    "multi_turn": {
                        k: getattr(args, k)
                        for k in ("turns", "turn_tokens", "first_tokens", "conversations", "stagger", "think")
                    }
                    if args.profile == "multi-turn"
                    else None,
                    "inputs": args.inputs,
                    "mix": args.mix,
                    "qps": args.qps,
                    "output": args.output,
                    "iterations": args.iterations,
                    "window_s": args.window,
                    "min_requests": args.min_requests,
                    "max_requests": args.max_requests,
                    "stacks": {c.label: s.info for c, s in stacks.items()},
                    "source": source_state(),
                },
                indent=1,
            )
            + "\n"
        )
        t1 = time.monotonic()
        if args.profile == "multi-turn":
            rc = multi_turn.run(args, stacks, out_dir, say)
            say(f"multi-turn done in {(time.monotonic() - t1) / 60:.1f} min")
            return rc
        if args.profile == "overload":
            overload.run(args, {c.mode: s for c, s in stacks.items()}, out_dir, say)
            return
        run_sweep(args, stacks, out_dir)
        say(f"sweep done in {(time.monotonic() - t1) / 60:.1f} min")

    rc = run_with_stacks(stacks, run, say)
    if rc or args.profile != "sweep":
        return rc
    from kvpush_tools.bench import plot_serve

    return plot_serve.report(out_dir, plot=not args.no_plot)


if __name__ == "__main__":
    raise SystemExit(main())
