"""``kvpush bench serve`` / ``plot`` / ``idle``: the harness without vLLM servers.

What is checked is what the published numbers rest on: the load schedule is
the one claimed (seeded, equal across modes), statistics follow ``vllm bench
serve``'s definitions, result files are named and shaped as promised, the
streaming client times chunks the way vLLM's does, and the figures are drawn
from synthetic results. Nothing here asserts a duration. The one test that
starts real servers (``--quick`` end to end) is marked heavy.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpush_tools.bench import idle, loadgen, plot_serve, serve_files, serve_summary
from kvpush_tools.bench.client import request_body, run_load, send_one
from kvpush_tools.bench.loadgen import DEFAULT_MODES, RequestOutput
from kvpush_tools.bench.serve_sweep import sweep_plan

# --------------------------------------------------------------------------- #
# Load schedule
# --------------------------------------------------------------------------- #


def test_poisson_arrivals_are_seeded_and_start_at_zero() -> None:
    a = loadgen.poisson_arrivals(50, 2.0, seed=3)
    assert a == loadgen.poisson_arrivals(50, 2.0, seed=3)
    assert a != loadgen.poisson_arrivals(50, 2.0, seed=4)
    assert a[0] == 0.0 and len(a) == 50
    assert all(y >= x for x, y in itertools.pairwise(a))


def test_poisson_gaps_have_the_requested_rate() -> None:
    gaps = np.diff(loadgen.poisson_arrivals(20001, 4.0, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # Exponential: the standard deviation equals the mean (burstiness 1).
    assert gaps.std() == pytest.approx(0.25, rel=0.05)
    bursty = np.diff(loadgen.poisson_arrivals(20001, 4.0, seed=1, burstiness=0.25))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05) and bursty.std() > 1.5 * gaps.std()


def test_poisson_edge_cases() -> None:
    assert loadgen.poisson_arrivals(0, 1.0, 0) == []
    assert loadgen.poisson_arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        loadgen.poisson_arrivals(3, 0.0, 0)


def test_requests_per_point() -> None:
    assert loadgen.requests_for(0.5, 10, 6) == 6
    assert loadgen.requests_for(4, 10, 6) == 40
    assert loadgen.requests_for(1.5, 3, 1) == 5  # rounded up


def test_point_seed_differs_between_points_not_modes() -> None:
    seeds = {loadgen.point_seed(0, it, inp, q) for it in range(3) for inp in (256, 1024) for q in (0.5, 1, 2, 4)}
    assert len(seeds) == 24


def test_sweep_plan_interleaves_and_rotates_modes() -> None:
    plan = sweep_plan([256, 1024], [1.0, 2.0, 4.0], list(DEFAULT_MODES), 2)
    assert len(plan) == 12
    assert [(it, inp, q) for it, inp, q, _ in plan[:3]] == [(0, 256, 1.0), (0, 256, 2.0), (0, 256, 4.0)]
    for _, _, _, order in plan:
        assert sorted(order) == sorted(DEFAULT_MODES)
    firsts = [order[0] for _, _, _, order in plan]
    assert {m: firsts.count(m) for m in DEFAULT_MODES} == {m: 4 for m in DEFAULT_MODES}


# --------------------------------------------------------------------------- #
# Statistics and result files
# --------------------------------------------------------------------------- #


def test_percentile_is_numpys_linear_and_zero_when_empty() -> None:
    vals = [5.0, 1.0, 3.0, 2.0, 4.0]
    for p in (50, 90, 99):
        assert loadgen.percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)))
    assert loadgen.percentile([1.0, 2.0], 50) == 1.5
    assert loadgen.percentile([], 99) == 0.0
    assert loadgen.pword(99.0) == "99" and loadgen.pword(99.9) == "99.9"


def _outputs() -> list[RequestOutput]:
    return [
        RequestOutput(100, True, ttft=0.1, itl=[0.01] * 3, latency=0.13, output_tokens=4, start_time=0.0),
        RequestOutput(100, True, ttft=0.3, itl=[0.02] * 3, latency=0.36, output_tokens=4, start_time=0.5),
        RequestOutput(100, False, error="HTTP 502: boom", start_time=1.0),
    ]


def test_summarize_uses_vllm_keys_and_definitions() -> None:
    res = loadgen.summarize(_outputs(), duration_s=2.0)
    for key in (
        "completed",
        "failed",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "ttfts",
        "itls",
        "latencies",
        "input_lens",
        "output_lens",
        "errors",
    ):
        assert key in res, key
    assert res["completed"] == 2 and res["failed"] == 1
    assert res["request_throughput"] == 1.0  # 2 completed in 2 s
    assert res["output_throughput"] == 4.0
    assert res["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (latency - ttft) / (tokens - 1): 10 ms and 20 ms.
    assert res["median_tpot_ms"] == pytest.approx(15.0)
    assert res["median_itl_ms"] == pytest.approx(15.0)
    assert res["output_lens"] == [4, 4, 0]
    assert res["errors"][2].startswith("HTTP 502")
    assert len(res["ttfts"]) == len(res["itls"]) == 3


def test_result_name_round_trip_and_rejects_unknown_modes() -> None:
    name = serve_files.result_name("vllm-pull", 0.5, 1024, 64, 2)
    assert name == "vllm-pull_qps0.5_in1024_out64_iter2.json"
    assert serve_files.result_name("kvpush", 4.0, 256, 128, 0) == "kvpush_qps4_in256_out128_iter0.json"
    assert serve_files.parse_result_name(name) == ("vllm-pull", 0.5, 1024, 64, 2)
    assert serve_files.parse_result_name("summary.json") is None
    assert serve_files.parse_result_name("other_qps1_in1_out1_iter0.json") is None
    with pytest.raises(ValueError):
        serve_files.result_name("sglang", 1, 1, 1, 0)


def _synthetic(tmp: Path, failed_at: tuple[int, float] | None = None) -> Path:
    """Results where vllm-pull is 1.5x and vllm-push 1.25x kvpush everywhere."""
    rng = np.random.default_rng(0)
    for it in range(2):
        for inp in (256, 1024, 2048):
            for q in (0.5, 1.0, 2.0):
                for mode, f in (("kvpush", 1.0), ("vllm-pull", 1.5), ("vllm-push", 1.25)):
                    outs = []
                    for j in range(6):
                        ttft = f * (0.02 + inp * q / 1e4) * (1 + 0.01 * rng.random())
                        outs.append(RequestOutput(inp, True, ttft, [0.02 * f] * 15, ttft + 15 * 0.02 * f, 16, j / q))
                    if failed_at == (inp, q) and mode == "vllm-pull":
                        outs.append(RequestOutput(inp, False, error="boom"))
                    r: dict[str, Any] = {
                        "kvpush": {
                            "mode": mode,
                            "qps": q,
                            "input_len": inp,
                            "output_len": 16,
                            "iteration": it,
                            "loadavg_start": [2.0, 2.0, 2.0],
                        }
                    }
                    r.update(loadgen.summarize(outs, 6 / q))
                    serve_files.write_result(tmp, r)
    return tmp


def test_results_load_aggregate_and_ratios(tmp_path: Path) -> None:
    d = _synthetic(tmp_path, failed_at=(1024, 2.0))
    results = serve_files.load_results(d)
    assert len(results) == 2 * 3 * 3 * 3
    agg = serve_summary.aggregate(results)
    row = agg[(1024, 2.0, "vllm-pull")]
    assert row["runs"] == 2 and row["completed"] == 12 and row["failed"] == 2
    assert len(row["iter_median_ttft_ms"]) == 2
    for r in serve_summary.ratios(agg, "median_ttft_ms"):
        assert r["kvpush/vllm-pull"] == pytest.approx(1 / 1.5, rel=0.02)
        assert r["kvpush/vllm-push"] == pytest.approx(1 / 1.25, rel=0.02)
    for r in serve_summary.ratios(agg, "median_tpot_ms"):
        assert r["kvpush/vllm-pull"] == pytest.approx(1 / 1.5, rel=1e-6)
    table = serve_summary.summary_table(agg)
    assert "k/pull" in table and " 0.67 " in table and " 0.80 " in table


def test_server_histogram_means_between_scrapes() -> None:
    from kvpush_tools.bench.server_metrics import histogram_means_ms

    before = {"vllm:request_queue_time_seconds": (1.0, 10.0), "vllm:time_to_first_token_seconds": (2.0, 4.0)}
    after = {"vllm:request_queue_time_seconds": (1.5, 15.0), "vllm:time_to_first_token_seconds": (2.0, 4.0)}
    # 0.5 s over 5 new requests; TTFT had no new observation and is left out.
    assert histogram_means_ms(before, after) == {"request_queue_time": pytest.approx(100.0)}


def test_ratio_is_none_when_a_mode_is_missing() -> None:
    agg = {(256, 1.0, "kvpush"): {"median_ttft_ms": 10.0}}
    assert serve_summary.ratios(agg) == [
        {"input_len": 256, "qps": 1.0, "kvpush/vllm-pull": None, "kvpush/vllm-push": None}
    ]
    assert serve_summary.ratio(1.0, 0.0) is None


def test_plot_and_compact_copy_from_synthetic_results(tmp_path: Path) -> None:
    d = _synthetic(tmp_path / "runs")
    assert plot_serve.main([str(d), "--compact-to", str(tmp_path / "compact")]) == 0
    for name in ("ttft_vs_qps.png", "tpot_vs_qps.png", "summary.json", "summary.txt"):
        assert (d / name).stat().st_size > 0
        assert (tmp_path / "compact" / name).exists()
    assert (d / "ttft_vs_qps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((d / "summary.json").read_text())
    assert len(summary["points"]) == 27 and len(summary["ratios_median_ttft"]) == 9
    full = d / "kvpush_qps2_in2048_out16_iter1.json"
    small = tmp_path / "compact" / full.name
    assert "itls" not in json.loads(small.read_text()) and small.stat().st_size < full.stat().st_size
    # The compact copy still gives the same pooled medians.
    a = serve_summary.aggregate(serve_files.load_results(d))
    b = serve_summary.aggregate(serve_files.load_results(tmp_path / "compact"))
    assert a[(2048, 2.0, "kvpush")]["p99_ttft_ms"] == pytest.approx(b[(2048, 2.0, "kvpush")]["p99_ttft_ms"])


def test_compact_keeps_statistics_and_drops_bulk() -> None:
    res = {**loadgen.summarize(_outputs(), 2.0), "kvpush": {"mode": "kvpush", "stack": {"server_args": ["--x"]}}}
    small = serve_files.compact(res)
    assert "itls" not in small and small["itls_dropped"] is True
    assert small["kvpush"] == {"mode": "kvpush"} and res["kvpush"]["stack"]  # the original is untouched
    assert small["ttfts"] == res["ttfts"] and small["p99_ttft_ms"] == res["p99_ttft_ms"]


def test_report_returns_1_when_requests_failed(tmp_path: Path) -> None:
    assert plot_serve.report(_synthetic(tmp_path, failed_at=(256, 1.0)), plot=False) == 1
    assert plot_serve.report(tmp_path / "empty", plot=False) == 2


# --------------------------------------------------------------------------- #
# Streaming client against an in-process SSE stand-in (no vLLM)
# --------------------------------------------------------------------------- #


@pytest.fixture
def sse_server() -> Iterator[str]:
    """A /v1/completions that streams 4 token chunks 20 ms apart, then usage;
    a prompt "fail" gets HTTP 500, "empty" a stream with no choice."""
    import asyncio

    from aiohttp import web

    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        if body["prompt"] == "fail":
            return web.json_response({"error": "boom"}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        if body["prompt"] != "empty":
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.02)
                await resp.write(f'data: {{"choices": [{{"text": " w{i}"}}]}}\n\n'.encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": 3}}
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
    port = runner.addresses[0][1]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def test_client_times_chunks_like_vllm_bench(sse_server: str) -> None:
    import asyncio

    outs, dur = asyncio.run(run_load(sse_server, ["a b c", "fail", "empty"], [3, 3, 3], [0.0, 0.0, 0.05], 4))
    ok, fail, empty = outs
    assert ok.ok and ok.output_tokens == 4 and len(ok.itl) == 3
    assert ok.ttft > 0 and ok.latency == pytest.approx(ok.ttft + sum(ok.itl))
    assert ok.tpot == pytest.approx(sum(ok.itl) / 3)
    assert not fail.ok and fail.error.startswith("HTTP 500")
    assert not empty.ok and "no chunk" in empty.error
    assert empty.start_time >= 0.05  # sent at its arrival time, not before
    assert dur >= ok.latency


def test_request_body_asks_for_exact_length() -> None:
    body = request_body("x y", 64)
    assert body["max_tokens"] == 64 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_send_one_reports_connection_errors() -> None:
    import asyncio

    import aiohttp

    from kvpush_tools.demo.launcher import free_port

    async def go() -> RequestOutput:
        async with aiohttp.ClientSession() as s:
            return await send_one(s, f"http://127.0.0.1:{free_port()}", request_body("x", 2), 1, time.perf_counter())

    out = asyncio.run(go())
    assert not out.ok and "Connect" in out.error


# --------------------------------------------------------------------------- #
# Idle CPU accounting (structure only: no CPU share is asserted)
# --------------------------------------------------------------------------- #


def test_idle_measure_reads_threads_of_a_process_tree() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, name="kvpush-test-spin", daemon=True)
    t.start()
    try:
        m = idle.measure({"me": os.getpid()}, 0.3)
    finally:
        stop.set()
        t.join()
    assert m["me"]["processes"] >= 1 and m["me"]["pct"] >= 0
    assert m["me"]["top_threads"] and {"name", "pct", "tid"} <= set(m["me"]["top_threads"][0])
    assert os.getpid() in idle.tree_pids(os.getpid())
    assert os.getpid() in idle.proc_tree(os.getpid())


def test_idle_table_and_plot(tmp_path: Path) -> None:
    def phase(p: float, d: float) -> dict[str, Any]:
        side = {"pct": p, "processes": 2, "top_threads": [{"name": "x", "pct": p, "pid": 1, "tid": 1}]}
        return {"prefill": side, "decode": {**side, "pct": d}, "router": {**side, "pct": 0.1}, "pair_pct": p + d}

    results = [
        {"mode": "kvpush", "phases": {ph: phase(0.5, 0.7) for ph in idle.PHASES}},
        {"mode": "vllm-pull", "phases": {ph: phase(99.0, 98.0) for ph in idle.PHASES}},
    ]
    text = idle.table(results)
    assert "kvpush" in text and "197.0" in text
    assert idle.plot(results, tmp_path / "idle.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- #
# End to end (real vLLM servers; run on purpose with -m heavy)
# --------------------------------------------------------------------------- #


@pytest.mark.heavy
def test_quick_sweep_end_to_end(tmp_path: Path) -> None:
    from kvpush_tools.bench import serve

    rc = serve.main(["--quick", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    results = serve_files.load_results(tmp_path)
    assert sorted(r["kvpush"]["mode"] for r in results) == sorted(DEFAULT_MODES)
    for r in results:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0
        # D took the prompts from the transfer, not from its own prefill.
        assert r["kvpush"]["d_prompt_tokens_by_source"].get("external_kv_transfer", 0) > 0
    assert (tmp_path / "ttft_vs_qps.png").exists() and (tmp_path / "summary.json").exists()


def test_overload_profile_points_causes_and_measures() -> None:
    """The overload profile's defaults (3072 tokens, 1 and 4 QPS, 30 requests) unless chosen; failures are told
    apart by cause, and TTFT counts only the completed requests."""
    from kvpush_tools.bench import overload
    from kvpush_tools.bench.serve import build_parser

    ap = build_parser()
    args = ap.parse_args(["--profile", "overload"])
    overload.apply_profile(args, ap.parse_args([]))
    assert (args.inputs, args.qps, args.min_requests, args.max_requests) == ([3072], [1.0, 4.0], 30, 30)
    chosen = ap.parse_args(["--profile", "overload", "--inputs", "2048", "--qps", "2"])
    overload.apply_profile(chosen, ap.parse_args([]))
    assert (chosen.inputs, chosen.qps) == ([2048], [2.0])
    errors = {
        'HTTP 503: {"error": {"message": "overloaded: ...", "type": "overloaded"}}': "overloaded",
        'HTTP 503: {"error": {"type": "service_unavailable"}}': "http_5xx",
        "HTTP 500: Internal Server Error": "http_5xx",
        "HTTP 400: bad": "http_4xx",
        "stream error: {'message': 'x'}": "stream",
        "TimeoutError: ": "client",
    }
    assert {e: overload.failure_cause(e) for e in errors} == errors
    outs = [RequestOutput(prompt_len=8, ok=True, ttft=t) for t in (0.1, 0.2, 0.3)]
    outs += [RequestOutput(prompt_len=8, error=e) for e in errors]
    m = overload.measure(outs)
    assert (m["completed"], m["requests"]) == (3, 9) and m["completed_share"] == pytest.approx(1 / 3)
    assert m["ttft_p50_ms"] == pytest.approx(200.0) and m["ttft_p90_ms"] == pytest.approx(280.0)
    assert m["failures"] == {"overloaded": 1, "http_5xx": 2, "http_4xx": 1, "stream": 1, "client": 1}
