"""``kvpush bench idle``: how much CPU an idle P/D pair burns, per KV connector.

vLLM's NIXL connectors run NIXL's built-in progress thread, which polls UCX
without sleeping: each agent spins a core even when no request is in flight.
On this 2-core machine a vLLM P/D pair then keeps both cores busy doing
nothing; on a GPU host it steals a core per rank from the engine loops.
kvpush drives NIXL progress from its own engine thread, which sleeps while
nothing is in flight (goal: under 5% of one core per pair).

For each mode the pair (and its router) is measured in three states, each
after a settling period with no request:

* ``fresh``: started, no request served yet;
* ``connected``: after a few requests (P and D have handshaken, NIXL
  peers are loaded);
* ``after_burst``: after a burst of concurrent long requests, to show the
  engine goes back to sleep rather than spinning on.

CPU is the user+system time of each server's whole process tree (API
server, engine core, every thread) over the window, read with psutil, as
% of one core. The busiest threads are listed by name, which is how the
spinning thread is identified (kvpush names its engine threads
``kvpush-push``/``kvpush-recv``; NIXL's progress thread inherits its
process's name, ``VLLM::EngineCore``). The baseline ``none`` is the same pair
without any connector: what idle vLLM servers cost anyway.

Modes are measured one after the other, each stack alone on the machine
(started, measured, stopped), so neither another mode's startup nor its spin
pollutes a window; ``--together`` starts all stacks at once and pauses the
idle ones (SIGSTOP), as ``bench serve`` does. Writes ``idle.json`` and
``idle_cpu.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush_tools.bench.loadgen import DEFAULT_MODES, MODES
from kvpush_tools.bench.stack_build import BASELINE, build_stacks
from kvpush_tools.bench.stack_options import add_stack_arguments, comma_list, stack_options
from kvpush_tools.bench.stacks import Stack, activate, run_with_stacks, start_stacks, stop_stacks

PHASES = ("fresh", "connected", "after_burst")
GOAL_PCT = 5.0


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# CPU accounting (psutil, /proc fallback)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ThreadTime:
    pid: int
    tid: int
    name: str
    cpu_s: float


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants."""
    try:
        import psutil

        p = psutil.Process(root)
        return [root, *(c.pid for c in p.children(recursive=True))]
    except ImportError:
        return proc_tree(root)
    except Exception:
        return []


def proc_tree(root: int) -> list[int]:
    """``root`` and all its descendants, read from /proc alone (``tree_pids`` without psutil)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def thread_times(pids: Sequence[int]) -> list[ThreadTime]:
    """User+system seconds of every thread of ``pids`` (from /proc: psutil's
    per-thread times come from the same file, and /proc also gives names)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out.append(ThreadTime(pid, int(t), name, (int(fields[11]) + int(fields[12])) / tick))
    return out


def process_cpu_s(pids: Sequence[int]) -> float:
    """User+system seconds of ``pids`` themselves (exited threads included)."""
    try:
        import psutil

        total = 0.0
        for pid in pids:
            try:
                ct = psutil.Process(pid).cpu_times()
                total += ct.user + ct.system
            except psutil.Error:
                pass
        return total
    except ImportError:
        return sum(t.cpu_s for t in thread_times(pids))


def measure(groups: Mapping[str, int], window_s: float, top: int = 4) -> dict[str, Any]:
    """CPU % of one core of each named process tree over ``window_s``, plus its busiest threads."""
    pids = {name: tree_pids(root) for name, root in groups.items()}
    c0 = {name: process_cpu_s(p) for name, p in pids.items()}
    t0 = {name: {(t.pid, t.tid): t for t in thread_times(p)} for name, p in pids.items()}
    w0 = time.monotonic()
    time.sleep(window_s)
    dt = time.monotonic() - w0
    out: dict[str, Any] = {"window_s": dt}
    for name, p in pids.items():
        c1 = process_cpu_s(p)
        threads = []
        for t in thread_times(p):
            before = t0[name].get((t.pid, t.tid))
            used = t.cpu_s - (before.cpu_s if before else 0.0)
            if used > 0:
                threads.append({"name": t.name, "pid": t.pid, "tid": t.tid, "pct": 100 * used / dt})
        threads.sort(key=lambda x: -x["pct"])
        out[name] = {"pct": 100 * (c1 - c0[name]) / dt, "processes": len(p), "top_threads": threads[:top]}
    return out


# --------------------------------------------------------------------------- #
# Procedure
# --------------------------------------------------------------------------- #


def _burst(stack: Stack, n: int, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    from kvpush_tools.bench.client import run_load
    from kvpush_tools.demo.words import prompt_words

    prompts = [prompt_words(input_len, seed=seed + i) for i in range(n)]
    t0 = time.perf_counter()
    outs, _ = asyncio.run(run_load(stack.url, prompts, [input_len] * n, [0.0] * n, output_len, timeout_s=600))
    return {
        "requests": n,
        "input_len": input_len,
        "output_len": output_len,
        "failed": sum(not o.ok for o in outs),
        "seconds": time.perf_counter() - t0,
    }


def measure_mode(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """The three phases of one (resumed) stack."""
    from kvpush_tools.bench.client import warm_up

    groups = {"prefill": stack.prefill, "decode": stack.decode, "router": stack.router}
    roots = {k: s.proc.pid for k, s in groups.items() if s is not None and s.proc is not None}
    res: dict[str, Any] = {"mode": stack.mode, "phases": {}}
    for phase in PHASES:
        if phase == "connected":
            res["warmup"] = warm_up(stack, 512, seed=4242, n=3)
        elif phase == "after_burst":
            res["burst"] = _burst(stack, args.burst, args.burst_input, args.burst_output, seed=777)
        time.sleep(args.settle)
        load = os.getloadavg()[0]
        m = measure(roots, args.window)
        m["pair_pct"] = m["prefill"]["pct"] + m["decode"]["pct"]
        m["loadavg"] = load
        res["phases"][phase] = m
        say(
            f"{stack.mode:<9} {phase:<11}: P {m['prefill']['pct']:6.1f}%  D {m['decode']['pct']:6.1f}%  "
            f"pair {m['pair_pct']:6.1f}% of one core (router {_pct(m.get('router'))}); busiest: "
            + ", ".join(
                f"{t['name']} {t['pct']:.0f}%"
                for side in ("prefill", "decode")
                for t in m[side]["top_threads"][:1]
                if t["pct"] >= 1
            )
        )
    return res


def _pct(side: Mapping[str, Any] | None) -> str:
    return f"{side['pct']:.1f}%" if side else "none"


def table(results: Sequence[Mapping[str, Any]]) -> str:
    lines = [f"{'mode':<10} {'phase':<12} {'P %':>7} {'D %':>7} {'pair %':>7}  busiest thread per side"]
    lines.append("-" * 90)
    for r in results:
        for phase, m in r["phases"].items():
            busy = "; ".join(
                f"{side[0].upper()}: {m[side]['top_threads'][0]['name']} {m[side]['top_threads'][0]['pct']:.0f}%"
                for side in ("prefill", "decode")
                if m[side]["top_threads"]
            )
            lines.append(
                f"{r['mode']:<10} {phase:<12} {m['prefill']['pct']:7.1f} {m['decode']['pct']:7.1f} "
                f"{m['pair_pct']:7.1f}  {busy}"
            )
    lines.append(f"(% of one core over each window; goal for kvpush: pair < {GOAL_PCT:g}%)")
    return "\n".join(lines)


def plot(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Grouped bars: pair CPU % per mode, one bar per phase; the 5% goal as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = [r["mode"] for r in results]
    x = np.arange(len(modes))
    width = 0.8 / len(PHASES)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, phase in enumerate(PHASES):
        vals = [r["phases"].get(phase, {}).get("pair_pct", 0.0) for r in results]
        bars = ax.bar(x + (i - (len(PHASES) - 1) / 2) * width, vals, width, label=phase.replace("_", " "))
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(GOAL_PCT, color="r", lw=0.8, ls="--", label=f"kvpush goal ({GOAL_PCT:g}%)")
    ax.set_xticks(x, modes)
    ax.set_ylabel("CPU of the idle P+D pair (% of one core)")
    ax.set_title("Idle CPU per P/D pair (no request in flight)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Measure every mode; 0 on success (the numbers are reported, not judged)."""
    ap = argparse.ArgumentParser(prog="kvpush bench idle", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--modes",
        default=",".join((BASELINE, *DEFAULT_MODES)),
        help=f"'{BASELINE}' = plain vLLM servers without connector (the baseline an idle server costs anyway)",
    )
    ap.add_argument("--settle", type=float, default=10.0, help="seconds with no request before each window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of CPU accounting per phase")
    ap.add_argument("--burst", type=int, default=12, help="concurrent requests of the burst")
    ap.add_argument("--burst-input", type=int, default=1024)
    ap.add_argument("--burst-output", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None, help="default results/bench_idle/<time>")
    add_stack_arguments(ap, debug_log=False)
    ap.add_argument(
        "--together",
        action="store_true",
        help="start all stacks at once and pause the idle ones (quicker, but about 2 GB per server at once)",
    )
    args = ap.parse_args(argv)
    modes = comma_list(args.modes)
    if any(m not in (BASELINE, *MODES) for m in modes):
        print(f"unknown mode in {modes}; choose from {(BASELINE, *MODES)}", file=sys.stderr)
        return 2
    out = args.out or Path("results/bench_idle") / time.strftime("run-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    def make_model() -> Path:
        from kvpush_tools.demo.tiny_model import make_tiny_model

        return make_tiny_model(args.model_dir)

    stacks = build_stacks(modes, make_model, out / "logs", stack_options(args))
    results: list[dict[str, Any]] = []

    def run() -> None:
        if args.together:
            start_stacks(list(stacks.values()), say, timeout=args.startup_timeout)
        for m in modes:
            st = stacks[m]
            if not args.together:
                start_stacks([st], say, timeout=args.startup_timeout)
            activate(stacks, st)
            results.append(measure_mode(st, args))
            if args.together:
                st.pause()
            else:
                say(f"stopping {m}")
                stop_stacks([st])

    rc = run_with_stacks(stacks, run, say)
    if rc:
        return rc
    doc = {
        "goal_pct_of_one_core_per_pair": GOAL_PCT,
        "settle_s": args.settle,
        "window_s": args.window,
        "cpus": os.cpu_count(),
        "results": results,
        "stacks": {m: s.info for m, s in stacks.items()},
    }
    (out / "idle.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, out / "idle_cpu.png")
    print(table(results))
    print(f"idle.json and idle_cpu.png in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
