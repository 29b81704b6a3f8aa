"""The sweep of ``kvpush bench serve``: every (iteration, point, cell) in an order that rotates point by point, each
run against the one active stack (the others paused), its requests, its timing and the servers' own view, written
as one result file per run (:mod:`kvpush_tools.bench.serve_files`)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvpush_tools.bench import loadgen, serve_files
from kvpush_tools.bench.client import run_load, wait_drained, warm_up
from kvpush_tools.bench.loadgen import DEFAULT_ROUTER, RequestOutput
from kvpush_tools.bench.serve_summary import Cell
from kvpush_tools.bench.server_metrics import histogram_means_ms, prompt_token_sources, server_histograms
from kvpush_tools.bench.stack_build import MODEL_NAME
from kvpush_tools.bench.stacks import Stack, activate

T = TypeVar("T")


def say(msg: str) -> None:
    """A timestamped line that does not tear the progress bar."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    try:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
    except ImportError:
        print(line, file=sys.stderr, flush=True)


def sweep_plan(
    inputs: Sequence[int], qps: Sequence[float], modes: Sequence[T], iterations: int
) -> list[tuple[int, int, float, list[T]]]:
    """(iteration, input_len, qps, cell order) for every run group, in run order.

    ``modes`` are the cells (a mode, or a (mode, router) :class:`~kvpush_tools.bench.serve_summary.Cell`).
    Points go by input length, then QPS; the order rotates by one per point
    (and on across iterations), so over any ``len(modes)`` consecutive points
    each cell runs first, second, ... once.
    """
    out = []
    k = 0
    for it in range(iterations):
        for inp in inputs:
            for q in qps:
                r = k % len(modes)
                out.append((it, inp, q, [*modes[r:], *modes[:r]]))
                k += 1
    return out


def run_sweep(args: argparse.Namespace, stacks: Mapping[Cell, Stack], out_dir: Path) -> list[Path]:
    """Run every (iteration, point, cell); returns the JSON files written."""
    from kvpush_tools.demo.words import prompt_words

    plan = sweep_plan(args.inputs, args.qps, list(stacks), args.iterations)
    sizes = {q: loadgen.requests_for(q, args.window, args.min_requests) for q in args.qps}
    sizes = {q: min(n, args.max_requests) for q, n in sizes.items()}
    total = sum(sizes[q] * len(order) for _, _, q, order in plan)
    bar = _bar(total, args.no_progress)
    written: list[Path] = []
    try:
        for it, inp, q, order in plan:
            n = sizes[q]
            seed = loadgen.point_seed(args.seed, it, inp, q)
            arrivals = loadgen.poisson_arrivals(n, q, seed, args.burstiness)
            lens = mixed_lengths(inp, n, args.mix, seed)
            prompts = [prompt_words(k, seed=seed * 1000 + j) for j, k in enumerate(lens)]
            for pos, cell in enumerate(order):
                stack = stacks[cell]
                activate(stacks, stack)
                warm = warm_up(stack, inp, seed + 7919)
                time.sleep(args.settle)
                bar.set_description(f"iter {it} in {inp} qps {serve_files.fmt_qps(q)} {cell.label}")
                src0 = prompt_token_sources(stack.d_url)
                h0 = {side: server_histograms(u) for side, u in _server_urls(stack).items()}
                load0 = os.getloadavg()
                t_wall = time.time()
                outs, dur = asyncio.run(
                    run_load(stack.url, prompts, lens, arrivals, args.output, on_done=lambda _r: bar.update(1))
                )
                drained = wait_drained(stack)
                src1 = prompt_token_sources(stack.d_url)
                h1 = {side: server_histograms(u) for side, u in _server_urls(stack).items()}
                result = _result(args, stack, outs, dur, it, inp, q, seed, pos, order, warm, src0, src1, load0, t_wall)
                result["kvpush"]["drained"] = drained
                result["kvpush"]["server_means_ms"] = {
                    side: histogram_means_ms(h0[side], h1[side]) for side in h1 if h1[side]
                }
                written.append(serve_files.write_result(out_dir, result))
                stack.pause()
                fails = result["failed"]
                say(
                    f"iter {it} in {inp:>5} qps {serve_files.fmt_qps(q):>4} {cell.label:<22}: "
                    f"TTFT p50 {result['median_ttft_ms']:7.0f} ms p99 {result['p99_ttft_ms']:7.0f} ms, "
                    f"TPOT p50 {result['median_tpot_ms']:6.1f} ms, {result['completed']}/{n} ok"
                    + (f", {fails} FAILED ({_first_error(outs)})" if fails else "")
                    + f", load {load0[0]:.1f}"
                )
    finally:
        bar.close()
    return written


def parse_mix(text: str) -> tuple[int, float]:
    tokens, sep, share = text.partition(":")
    try:
        mix = int(tokens), float(share)
    except ValueError:
        mix = (0, -1.0)
    if not sep or mix[0] < 1 or not 0.0 <= mix[1] <= 1.0:
        raise argparse.ArgumentTypeError(f"expected TOKENS:SHARE (e.g. 64:0.5), got {text!r}")
    return mix


def mixed_lengths(inp: int, n: int, mix: tuple[int, float] | None, seed: int) -> list[int]:
    """Each request's prompt length: ``inp``, or with ``mix=(tokens, share)`` ``tokens`` for that share."""
    if mix is None:
        return [inp] * n
    import random

    rng = random.Random(seed ^ 0x5EED)
    return [mix[0] if rng.random() < mix[1] else inp for _ in range(n)]


def _server_urls(stack: Stack) -> dict[str, str | None]:
    """P's and D's own URLs (P unknown for an attached stack)."""
    return {"prefill": stack.prefill.url if stack.prefill is not None else None, "decode": stack.d_url}


def _first_error(outs: Sequence[RequestOutput]) -> str:
    return next((o.error for o in outs if o.error), "")[:160]


def _result(
    args: argparse.Namespace,
    stack: Stack,
    outs: list[RequestOutput],
    dur: float,
    it: int,
    inp: int,
    q: float,
    seed: int,
    pos: int,
    order: Sequence[Cell],
    warm: dict[str, Any],
    src0: dict[str, float],
    src1: dict[str, float],
    load0: tuple[float, float, float],
    t_wall: float,
) -> dict[str, Any]:
    """One run's JSON: vLLM's top-level keys, then kvpush's bookkeeping."""
    res: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(t_wall)),
        "endpoint_type": "openai",
        "backend": "openai",
        "label": stack.mode if stack.router_name == DEFAULT_ROUTER else f"{stack.mode}_via-{stack.router_name}",
        "model_id": MODEL_NAME,
        "tokenizer_id": MODEL_NAME,
        "num_prompts": len(outs),
        "request_rate": q if not math.isinf(q) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": None,
    }
    res.update(loadgen.summarize(outs, dur, loadgen.DEFAULT_PERCENTILES))
    res["kvpush"] = {
        "mode": stack.mode,
        "router": stack.router_name,
        "qps": q,
        "input_len": inp,
        "output_len": args.output,
        "iteration": it,
        "seed": seed,
        "position_in_point": pos,
        "mode_order": [c.mode for c in order],
        "cell_order": [list(c) for c in order],
        "warmup": warm,
        "settle_s": args.settle,
        "d_prompt_tokens_by_source": {k: src1.get(k, 0.0) - src0.get(k, 0.0) for k in sorted(set(src0) | set(src1))},
        "loadavg_start": list(load0),
        "loadavg_end": list(os.getloadavg()),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "stack": stack.info,
    }
    return res


class _NoBar:
    """Stand-in when tqdm is missing or ``--no-progress``: prints nothing per request."""

    def update(self, _n: int) -> None:
        return

    def set_description(self, _d: str) -> None:
        return

    def close(self) -> None:
        return


def _bar(total: int, disabled: bool) -> Any:
    if disabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
