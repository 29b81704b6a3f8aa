"""``kvpush bench serve --profile overload``: how each mode degrades when P cannot keep up.

P is slowed by its configuration (``--overload-prefill-args``: a small step
budget and few sequences at a time, so it does about half the offered
load); prompts are long (3072 tokens), 30 requests per point, the modes
interleaved as in the default sweep. Right after every heavy point the same
stack serves a *light* point (256 tokens, 1 QPS): its TTFT against the
mode's light-load TTFT measured before the sweep is the recovery.

Per run (``overload_<mode>_qps<q>_in<in>_iter<i>.json``) and in
``overload_summary.json``: the share of requests completed, TTFT p50/p90 of
the completed ones, failures by cause (``overloaded``: the router's
retryable 503; ``http_5xx``, ``http_4xx``, ``stream``: an error inside the
stream, ``client``: a timeout or broken connection), wasted prefill tokens
(tokens P computed whose KV never reached D: P's locally computed prompt
tokens minus D's transferred ones) and the recovery point's TTFT p50 and
its ratio to the light-load one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench import loadgen, serve_files
from kvpush_tools.bench.client import run_load, wait_drained, warm_up
from kvpush_tools.bench.loadgen import RequestOutput
from kvpush_tools.bench.server_metrics import prompt_token_sources
from kvpush_tools.bench.stacks import Stack, activate

HEAVY_INPUT = 3072
HEAVY_QPS = (1.0, 4.0)
LIGHT = (256, 1.0)
REQUESTS = 30
PREFILL_ARGS = "--max-num-batched-tokens 512 --max-num-seqs 2"
KVPUSH_ROUTER_ARGS = "--max-prefill-queue 8"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--profile",
        choices=("sweep", "overload", "multi-turn"),
        default="sweep",
        help="sweep: TTFT/TPOT per point (default); overload: completion share, failures by cause, wasted "
        "prefills and recovery with a P slowed to about half the offered load; multi-turn: conversations, "
        "TTFT per turn (kvpush_tools.bench.multi_turn)",
    )
    ap.add_argument(
        "--overload-prefill-args",
        default=PREFILL_ARGS,
        metavar="ARGS",
        help=f"overload: vLLM flags that slow P (default {PREFILL_ARGS!r})",
    )
    ap.add_argument(
        "--overload-router-args",
        default=KVPUSH_ROUTER_ARGS,
        metavar="ARGS",
        help=f"overload: extra flags of kvpush's router (default {KVPUSH_ROUTER_ARGS!r}; '' for none)",
    )


def apply_profile(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    """The overload profile's points, unless the command line chose them."""
    if args.inputs == defaults.inputs:
        args.inputs = [HEAVY_INPUT]
    if args.qps == defaults.qps:
        args.qps = list(HEAVY_QPS)
    if args.output == defaults.output:
        args.output = 16
    args.min_requests = args.max_requests = REQUESTS


def failure_cause(error: str) -> str:
    """The cause of one failed request, from the client's error text."""
    if error.startswith("HTTP 503") and '"overloaded"' in error:
        return "overloaded"
    if error.startswith("HTTP 5"):
        return "http_5xx"
    if error.startswith("HTTP 4"):
        return "http_4xx"
    if error.startswith(("stream error", "no chunk")):
        return "stream"
    return "client"


def _p_computed(stack: Stack) -> float:
    url = stack.prefill.url if stack.prefill is not None else None
    return prompt_token_sources(url).get("local_compute", 0.0)


def _d_pushed(stack: Stack) -> float:
    return prompt_token_sources(stack.d_url).get("external_kv_transfer", 0.0)


def measure(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Completion share, TTFT p50/p90 of the completed requests (ms), failures by cause."""
    ok = [o.ttft * 1000 for o in outs if o.ok]
    causes: dict[str, int] = {}
    for o in outs:
        if not o.ok:
            c = failure_cause(o.error)
            causes[c] = causes.get(c, 0) + 1
    return {
        "requests": len(outs),
        "completed": len(ok),
        "completed_share": len(ok) / len(outs) if outs else 0.0,
        "ttft_p50_ms": loadgen.percentile(ok, 50) if ok else None,
        "ttft_p90_ms": loadgen.percentile(ok, 90) if ok else None,
        "failures": causes,
        "first_errors": sorted({o.error[:200] for o in outs if not o.ok})[:5],
    }


def _load(stack: Stack, inp: int, q: float, seed: int, output: int) -> list[RequestOutput]:
    from kvpush_tools.demo.words import prompt_words

    arrivals = loadgen.poisson_arrivals(REQUESTS, q, seed)
    prompts = [prompt_words(inp, seed=seed * 1000 + j) for j in range(REQUESTS)]
    return asyncio.run(run_load(stack.url, prompts, [inp] * REQUESTS, arrivals, output))[0]


def run(args: argparse.Namespace, stacks: dict[str, Stack], out_dir: Path, say: Any) -> list[dict[str, Any]]:
    """Light-load baselines, then every (iteration, heavy point, mode) followed by its recovery point."""
    light: dict[str, float | None] = {}
    for mode, stack in stacks.items():
        activate(stacks, stack)
        warm_up(stack, LIGHT[0], args.seed + 17)
        light[mode] = measure(_load(stack, *LIGHT, args.seed + 1, args.output))["ttft_p50_ms"]
        say(f"{mode}: light-load TTFT p50 {light[mode]} ms")
    runs: list[dict[str, Any]] = []
    k = 0
    for it in range(args.iterations):
        for inp in args.inputs:
            for q in args.qps:
                modes = list(stacks)
                order = [*modes[k % len(modes) :], *modes[: k % len(modes)]]
                k += 1
                seed = loadgen.point_seed(args.seed, it, inp, q)
                for mode in order:
                    stack = stacks[mode]
                    activate(stacks, stack)
                    warm_up(stack, LIGHT[0], seed + 7919)
                    p0, d0 = _p_computed(stack), _d_pushed(stack)
                    heavy = measure(_load(stack, inp, q, seed, args.output))
                    drained = wait_drained(stack, timeout=120.0)
                    wasted = (_p_computed(stack) - p0) - (_d_pushed(stack) - d0)
                    rec = measure(_load(stack, *LIGHT, seed + 3, args.output))
                    base = light.get(mode)
                    r = {
                        "mode": mode,
                        "iteration": it,
                        "input_len": inp,
                        "qps": q,
                        **heavy,
                        "wasted_prefill_tokens": wasted,
                        "drained": drained,
                        "recovery_ttft_p50_ms": rec["ttft_p50_ms"],
                        "recovery_completed_share": rec["completed_share"],
                        "light_ttft_p50_ms": base,
                        "recovery_ratio": rec["ttft_p50_ms"] / base if base and rec["ttft_p50_ms"] else None,
                        "stack": stack.info,
                    }
                    name = f"overload_{mode}_qps{serve_files.fmt_qps(q)}_in{inp}_iter{it}.json"
                    (out_dir / name).write_text(json.dumps(r, indent=1) + "\n")
                    runs.append(r)
                    stack.pause()
                    say(
                        f"iter {it} in {inp} qps {serve_files.fmt_qps(q)} {mode}: {heavy['completed']}/{REQUESTS} "
                        f"completed, failures {heavy['failures']}, TTFT p50 {heavy['ttft_p50_ms']} ms, wasted "
                        f"{wasted:.0f} prefill tokens; recovery TTFT p50 {rec['ttft_p50_ms']} ms (light {base})"
                    )
    (out_dir / "overload_summary.json").write_text(json.dumps(summary(runs), indent=1) + "\n")
    return runs


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per (point, mode): runs' completion shares, TTFT medians, failures summed, wasted tokens, recovery."""
    out: dict[str, Any] = {}
    for r in runs:
        key = f"in{r['input_len']}_qps{serve_files.fmt_qps(r['qps'])}"
        m = out.setdefault(key, {}).setdefault(
            r["mode"],
            {"completed_share": [], "ttft_p50_ms": [], "ttft_p90_ms": [], "failures": {}, "wasted": [], "rec": []},
        )
        m["completed_share"].append(r["completed_share"])
        m["ttft_p50_ms"].append(r["ttft_p50_ms"])
        m["ttft_p90_ms"].append(r["ttft_p90_ms"])
        m["wasted"].append(r["wasted_prefill_tokens"])
        m["rec"].append(r["recovery_ratio"])
        for c, n in r["failures"].items():
            m["failures"][c] = m["failures"].get(c, 0) + n
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "points": out}
