"""``kvpush bench serve --profile multi-turn``: the harness without vLLM servers.

What the published per-turn numbers rest on: each turn resends the previous
prompt and answer (so a prefix cache can serve it), every cell sends the same
conversations under its own cache salt, the cells rotate, the per-turn
statistics and the later turns' speedup are computed from the right requests,
kvpush-multi-turn runs on kvpush's own P and D with the one extra flag, and
prefix caching is on for this profile only. Nothing here asserts a duration;
the one test that starts real servers is marked heavy.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush_tools.bench import conversation, multi_turn, multi_turn_summary
from kvpush_tools.bench.serve_summary import Cell
from kvpush_tools.bench.stack_build import build_stacks
from kvpush_tools.bench.stack_options import StackOptions

# --------------------------------------------------------------------------- #
# Conversations
# --------------------------------------------------------------------------- #


def test_scripts_are_seeded_sized_and_differ_between_conversations() -> None:
    a = conversation.scripts(3, 4, 50, seed=7, first_tokens=20)
    assert a == conversation.scripts(3, 4, 50, seed=7, first_tokens=20)
    assert a != conversation.scripts(3, 4, 50, seed=8, first_tokens=20)
    assert [s.turns for s in a] == [4, 4, 4]
    assert all(len(s.first.split()) == 20 and [len(m.split()) for m in s.messages] == [50] * 3 for s in a)
    assert len({s.first for s in a}) == 3 and len({m for s in a for m in s.messages}) == 9
    with pytest.raises(ValueError):
        conversation.scripts(0, 4, 50, seed=1)


def test_next_turn_starts_with_the_previous_prompt_and_answer() -> None:
    prompt = "a b c"
    nxt = conversation.next_prompt(prompt, " x y \n", "m n")
    assert nxt == "a b c x y m n" and nxt.startswith(prompt + " x y")
    assert len(nxt.split()) == 3 + 2 + 2  # one token per word
    assert conversation.next_prompt(prompt, "", "m") == "a b c m"  # an empty answer adds no space


def test_salts_differ_per_cell_point_and_iteration() -> None:
    salts = {conversation.cache_salt(it, tok, cell) for it in range(3) for tok in (1024, 4096) for cell in "ab"}
    assert len(salts) == 12
    assert " " not in conversation.cache_salt(0, 1, "vllm-pull via vllm-router")


def test_rotations_put_every_cell_first_equally_often() -> None:
    plan = conversation.rotations(["a", "b", "c", "d"], [1024, 4096], 2)
    assert [(it, tok) for it, tok, _ in plan] == [(0, 1024), (0, 4096), (1, 1024), (1, 4096)]
    assert [order[0] for _, _, order in plan] == ["a", "b", "c", "d"]
    assert all(sorted(order) == ["a", "b", "c", "d"] for _, _, order in plan)
    assert conversation.start_offsets(3, 1.5) == [0.0, 1.5, 3.0]


# --------------------------------------------------------------------------- #
# Per-turn summary
# --------------------------------------------------------------------------- #


def _run(cell: str, it: int, ttfts: dict[int, list[float]], tokens: int = 1024) -> dict[str, Any]:
    reqs = [
        {"conversation": c, "turn": t, "ttft": v, "latency": v + 0.9, "output_tokens": 10, "error": ""}
        for t, vals in ttfts.items()
        for c, v in enumerate(vals)
    ]
    return {
        "requests": reqs,
        "kvpush": {
            "cell": cell,
            "turn_tokens": tokens,
            "iteration": it,
            "d_prompt_tokens_by_source": {"local_cache_hit": 100.0, "external_kv_transfer": 5.0},
            "routes": {"d_alone": 2.0} if cell == "kvpush-multi-turn" else {},
        },
    }


def _runs() -> list[dict[str, Any]]:
    return [
        _run("kvpush", 0, {1: [1.0, 1.2], 2: [2.0, 2.2], 3: [3.0, 3.2]}),
        _run("kvpush-multi-turn", 0, {1: [1.0, 1.2], 2: [1.0, 1.1], 3: [1.5, 1.6]}),
        _run("kvpush", 1, {1: [2.0, 2.4], 2: [4.0, 4.4], 3: [6.0, 6.4]}),  # a slower moment of the host
        _run("kvpush-multi-turn", 1, {1: [2.0, 2.4], 2: [1.0, 1.1], 3: [1.5, 1.6]}),
    ]


def test_per_turn_pools_iterations_and_keeps_their_spread() -> None:
    rows = multi_turn_summary.per_turn(_runs())
    r = rows[(1024, "kvpush", 2)]
    assert r["requests"] == 4 and r["failed"] == 0
    assert r["median_ttft_ms"] == pytest.approx(3100.0)  # median of 2.0, 2.2, 4.0, 4.4 s
    assert r["iter_median_ttft_ms"] == pytest.approx([2100.0, 4200.0])
    assert r["ttft_spread_ms"] == pytest.approx([2100.0, 4200.0])
    assert r["median_tpot_ms"] == pytest.approx(100.0)  # (latency - ttft) / (10 - 1)


def test_later_turns_speedup_against_kvpush_per_iteration() -> None:
    later = {r["cell"]: r for r in multi_turn_summary.later_turns(_runs())}
    mt = later["kvpush-multi-turn"]
    # Iteration 0: kvpush's later-turn median 2.6 s, multi-turn's 1.3 s; iteration 1: 5.2 s against 1.3 s.
    assert mt["later_speedup_per_iteration"] == pytest.approx([2.0, 4.0])
    assert mt["later_speedup_spread"] == pytest.approx([2.0, 4.0])
    assert mt["later_iter_median_ttft_ms"] == pytest.approx([1300.0, 1300.0])
    assert mt["first_median_ttft_ms"] == pytest.approx(later["kvpush"]["first_median_ttft_ms"])
    assert mt["later_tpot_vs_kvpush"] == pytest.approx(1.0)
    assert later["kvpush"]["later_speedup_vs_kvpush"] == pytest.approx(1.0)


def test_sources_routes_table_names_and_figure(tmp_path: Path) -> None:
    runs = _runs()
    src = multi_turn_summary.sources(runs)
    assert src["kvpush-multi-turn tok1024"]["routes"] == {"d_alone": 4.0}
    assert src["kvpush tok1024"]["d"] == {"local_cache_hit": 200.0, "external_kv_transfer": 10.0}
    name = multi_turn_summary.run_name("vllm-pull via vllm-router", 4096, 2)
    assert multi_turn_summary.parse_run_name(name) == ("vllm-pull via vllm-router", 4096, 2)
    assert multi_turn_summary.parse_run_name("kvpush_qps1_in1024_out64_iter0.json") is None
    for r in runs:
        (tmp_path / multi_turn_summary.run_name(r["kvpush"]["cell"], 1024, r["kvpush"]["iteration"])).write_text(
            json.dumps(r)
        )
    multi_turn.report(tmp_path, say=lambda _m: None)
    text = (tmp_path / "multi_turn_summary.txt").read_text()
    assert "kvpush/this TTFT 2.77 [2.00..4.00]" in text  # later turns pooled: 3.6 s over 1.3 s
    assert (tmp_path / "multi_turn.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "multi_turn_summary.json").read_text())
    assert {r["cell"] for r in summary["later_turns"]} == {"kvpush", "kvpush-multi-turn"}


# --------------------------------------------------------------------------- #
# The client side of a conversation, against a stand-in server
# --------------------------------------------------------------------------- #


@pytest.fixture
def echo_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A /v1/completions that streams the answer "r<k>" (k: requests so far) word by word and records bodies."""
    from aiohttp import web

    seen: list[dict[str, Any]] = []

    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for i in range(body["max_tokens"]):
            await resp.write(f'data: {{"choices": [{{"text": " r{len(seen)}w{i}"}}]}}\n\n'.encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def test_converse_resends_history_with_the_salt(echo_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = echo_server
    scripts = conversation.scripts(2, 3, 5, seed=3)
    records, _ = asyncio.run(multi_turn.converse(url, scripts, 2, "salt-x", 0.05, 0.0))
    assert [(r["conversation"], r["turn"]) for r in records] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert all(not r["error"] and r["output_tokens"] == 2 for r in records)
    assert all(b["cache_salt"] == "salt-x" and b["stream"] for b in seen)
    for s in scripts:
        mine = [b["prompt"] for b in seen if b["prompt"].startswith(s.first)]
        assert len(mine) == 3
        for k in (1, 2):  # turn k+1 = turn k's prompt + its answer (two words) + the new message
            prev, nxt = mine[k - 1].split(), mine[k].split()
            assert nxt[: len(prev)] == prev and len(nxt) == len(prev) + 2 + 5
            assert nxt[len(prev)].startswith("r") and " ".join(nxt[-5:]) == s.messages[k - 1]
    assert [r["prompt_len"] for r in records[:3]] == [5, 12, 19]


# --------------------------------------------------------------------------- #
# Stacks: the profile's servers and routers (built, not started)
# --------------------------------------------------------------------------- #


def test_multi_turn_mode_shares_kvpushs_pair_with_one_more_flag(tmp_path: Path) -> None:
    opts = StackOptions(prefix_caching=True, max_model_len=20000)
    stacks = build_stacks(["kvpush", "kvpush-multi-turn", "vllm-pull"], lambda: "model", tmp_path, opts)
    assert list(stacks) == ["kvpush", "kvpush-multi-turn", "vllm-pull"]
    k, mt, pull = stacks["kvpush"], stacks["kvpush-multi-turn"], stacks["vllm-pull"]
    assert mt.prefill is k.prefill and mt.decode is k.decode and mt.router is not k.router
    assert mt.info["router_args"] == [*k.info["router_args"], "--multi-turn"]
    assert "--multi-turn" not in pull.info["router_args"]
    for s in (k.prefill, k.decode, pull.prefill, pull.decode):
        assert s is not None and "--no-enable-prefix-caching" not in s.cmd
        assert s.cmd[s.cmd.index("--max-model-len") + 1] == "20000"
    plain = build_stacks(["kvpush"], lambda: "model", tmp_path, StackOptions())
    assert "--no-enable-prefix-caching" in plain["kvpush"].prefill.cmd  # type: ignore[union-attr]


def test_profile_defaults_and_cells() -> None:
    from kvpush_tools.bench import serve

    ap = serve.build_parser()
    args = ap.parse_args(["--profile", "multi-turn", "--turn-tokens", "1024,4096", "--turns", "4"])
    multi_turn.apply_profile(args, ap.parse_args([]), named_modes=False)
    assert args.modes == ["kvpush", "kvpush-multi-turn", "vllm-pull", "vllm-push"]
    assert args.model_dir == multi_turn.MODEL_DIR
    assert args.max_model_len >= 4 * 4096 + 4 * args.output
    cells, why = serve.choose_cells(args.modes, ["kvpush", "vllm-router"], named_modes=False)
    assert why is None and Cell("kvpush-multi-turn", "vllm-router") not in cells
    assert Cell("kvpush-multi-turn", "kvpush") in cells


# --------------------------------------------------------------------------- #
# End to end (real vLLM servers; run on purpose with -m heavy)
# --------------------------------------------------------------------------- #


@pytest.mark.heavy
def test_multi_turn_profile_end_to_end(tmp_path: Path) -> None:
    from kvpush_tools.bench import serve

    argv = ["--profile", "multi-turn", "--modes", "kvpush,kvpush-multi-turn", "--turn-tokens", "64", "--turns", "3"]
    argv += ["--conversations", "2", "--iterations", "1", "--output", "8", "--out", str(tmp_path), "--no-progress"]
    assert serve.main(argv) == 0
    runs = multi_turn.load_runs(tmp_path)
    by = {r["kvpush"]["cell"]: r for r in runs}
    assert set(by) == {"kvpush", "kvpush-multi-turn"} and all(r["failed"] == 0 for r in runs)
    # Later turns through P still reuse D's cache for the earlier turns; the multi-turn router sends short ones
    # to D alone.
    assert by["kvpush"]["kvpush"]["d_prompt_tokens_by_source"].get("external_kv_transfer", 0) > 0
    assert by["kvpush-multi-turn"]["kvpush"]["routes"].get("d_alone", 0) > 0
