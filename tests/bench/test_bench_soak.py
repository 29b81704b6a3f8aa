"""``kvpush bench soak``'s pure parts: the explained-failure rule and the counts, the memory slope and its
window, the verdict, the samplers' parsers, the plan, and the client's judgement of an answer (against stub
servers). The soak itself, with real vLLM servers, is ``tests/e2e/test_e2e_soak.py`` (heavy)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpush_tools.bench import soak_report
from kvpush_tools.bench.soak_faults import parse_faults, points
from kvpush_tools.bench.soak_load import Spec, body, one, plan, prompt_lengths
from kvpush_tools.bench.soak_probe import at_rest, counter_breakdown, gauges, metric_sums, parent_of, rss_kib
from kvpush_tools.bench.soak_rules import (
    ABORTED,
    FAILED,
    MISMATCH,
    OK,
    Limits,
    Record,
    Window,
    explained,
    fit,
    memory_slope,
    slope_window,
    tally,
    verdict,
)

# --------------------------------------------------------------------------- #
# The explained-failure rule
# --------------------------------------------------------------------------- #

D_RESTART = Window("d_restart", start=100.0, recovered=160.0)
NET = Window("net_drop", start=300.0, recovered=330.0)


def failed(start: float, end: float, **kw: Any) -> Record:
    return Record(0, 0, "plain", start=start, end=end, outcome=FAILED, **kw)


@pytest.mark.parametrize(
    ("start", "end", "fault"),
    [
        (99.0, 101.0, "d_restart"),  # in flight when D was killed
        (120.0, 121.0, "d_restart"),  # sent while D was down
        (165.0, 166.0, "d_restart"),  # within the grace after recovery
        (50.0, 100.0, "d_restart"),  # ended the moment the fault began
        (171.0, 172.0, None),  # after the grace: the stack was serving again
        (10.0, 99.0, None),  # ended before the fault
        (320.0, 325.0, "net_drop"),
    ],
)
def test_a_failure_is_explained_by_the_fault_it_was_in_flight_during(start: float, end: float, fault: str) -> None:
    w = explained(failed(start, end), [D_RESTART, NET], grace_s=10.0)
    assert (w.name if w else None) == fault


def test_a_failure_in_flight_during_two_faults_is_the_later_ones() -> None:
    p_restart = Window("p_restart", start=50.0, recovered=80.0)
    net = Window("net_drop", start=82.5, recovered=105.0)
    assert explained(failed(83.0, 92.6), [p_restart, net], grace_s=10.0) is net
    assert explained(failed(79.0, 81.0), [p_restart, net], grace_s=10.0) is p_restart


def test_a_timeout_is_never_explained_and_an_unrecovered_fault_explains_all_after_it() -> None:
    assert explained(failed(120.0, 125.0, timed_out=True), [D_RESTART], 10.0) is None
    never = Window("p_restart", start=200.0)
    assert explained(failed(900.0, 901.0), [never], 10.0) is never
    assert explained(Record(0, 0, "plain", 120.0, 121.0, outcome=OK), [D_RESTART], 10.0) is None


def test_tally_counts_each_request_once_by_kind_of_ending() -> None:
    recs = [
        Record(0, 0, "plain", 1.0, 2.0, outcome=OK),
        Record(1, 0, "abort-mid", 1.0, 2.0, outcome=ABORTED),
        Record(2, 0, "stream", 1.0, 2.0, outcome=MISMATCH),
        failed(120.0, 121.0),
        failed(500.0, 501.0),
    ]
    c = tally(recs, [D_RESTART, NET], 10.0)
    assert (c["requests"], c["ok"], c["aborted"], c["mismatched"]) == (5, 1, 1, 1)
    assert (c["failed_explained"], c["failed_unexplained"]) == (1, 1)
    assert c["by_fault"] == {"d_restart": 1, "net_drop": 0}


# --------------------------------------------------------------------------- #
# Memory: the slope and its window
# --------------------------------------------------------------------------- #


def test_fit_is_least_squares() -> None:
    assert fit([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx((2.0, 1.0))
    assert fit([0, 1, 2], [0, 2, 1])[0] == pytest.approx(0.5)
    for xs, ys in (([1.0], [1.0]), ([2.0, 2.0], [1.0, 3.0])):
        with pytest.raises(ValueError):
            fit(xs, ys)


def test_the_slope_window_is_the_last_half_after_the_last_restart() -> None:
    assert slope_window(0.0, 1000.0, None) == (500.0, 1000.0)
    assert slope_window(0.0, 1000.0, 400.0) == (700.0, 1000.0)
    assert slope_window(100.0, 1000.0, 50.0) == (550.0, 1000.0)  # up before the load began


def _samples(mb_per_request: float, n: int = 200) -> list[tuple[float, float, float | None]]:
    """A sample every 2 s, 5 requests ended between samples, RSS growing ``mb_per_request`` per request with a
    sawtooth of +-3 MB (batches)."""
    return [(2.0 * i, 5.0 * i, 2000.0 + mb_per_request * 5 * i + (3.0 if i % 2 else -3.0)) for i in range(n)]


def test_memory_slope_per_request_and_per_minute() -> None:
    flat = memory_slope(_samples(0.0), slope_window(0.0, 400.0, None))
    assert abs(flat["mb_per_1k_requests"]) < 1.0 and abs(flat["mb_per_min"]) < 0.2 and flat["points"] == 100
    leak = memory_slope(_samples(0.05), slope_window(0.0, 400.0, None))  # 50 kB a request
    assert leak["mb_per_1k_requests"] == pytest.approx(50.0, rel=0.05)
    assert leak["mb_per_min"] == pytest.approx(0.05 * 5 * 30, rel=0.05)  # 2.5 requests a second
    gone = [(t, n, None) for t, n, _ in _samples(0.0)]  # the server was down the whole window
    assert "error" in memory_slope(gone, (0.0, 400.0))


# --------------------------------------------------------------------------- #
# The verdict
# --------------------------------------------------------------------------- #


def _summary(**over: Any) -> dict[str, Any]:
    good_memory = {"mb_per_1k_requests": 0.5, "mb_per_min": 0.1}
    s = {
        "counts": {"requests": 2000, "ok": 1800, "aborted": 190, "mismatched": 0, "failed_explained": 10,
                   "failed_unexplained": 0, "by_fault": {}},
        "faults": [{"name": n, "recovered": 10.0, "served_after": True} for n in ("d_restart", "p_restart")],
        "memory": {"prefill": dict(good_memory), "decode": dict(good_memory)},
        "kv_at_end": {"prefill": {"zero": True}, "decode": {"zero": True}},
    }  # fmt: skip
    for key, value in over.items():
        part, _, field = key.partition("__")
        if field:
            s[part][field] = value
        else:
            s[part] = value
    return s


LIMITS = Limits(requests=2000, max_slope_mb_per_1k=10.0, faults=("d_restart", "p_restart"))


def test_a_clean_run_passes() -> None:
    assert verdict(_summary(), LIMITS) == []


def test_memory_is_not_judged_under_an_infinite_limit() -> None:
    short = _summary(memory__prefill={"error": "no requests ended in the window"})
    assert verdict(short, Limits(2000, float("inf"), ("d_restart", "p_restart"))) == []
    assert verdict(short, LIMITS) != []


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"counts__mismatched": 3}, "outputs differing"),
        ({"counts__failed_unexplained": 1}, "unexplained failures"),
        ({"counts__requests": 1999}, "requests"),
        (
            {
                "faults": [
                    {"name": n, "recovered": None if n == "d_restart" else 9.0, "served_after": n != "d_restart"}
                    for n in ("d_restart", "p_restart")
                ]
            },
            "fault d_restart: the stack never served",
        ),
        ({"faults": [{"name": "d_restart", "recovered": 5.0, "served_after": True}]}, "fault p_restart: never ran"),
        ({"memory__decode": {"mb_per_1k_requests": 12.0, "mb_per_min": 1.0}}, "memory decode"),
        ({"memory__prefill": {"error": "2 samples"}}, "memory prefill"),
        ({"kv_at_end__decode": {"zero": False, "last": {"kv": 0.01}}}, "KV usage decode"),
    ],
)
def test_each_failed_condition_is_named(change: dict[str, Any], named: str) -> None:
    bad = verdict(_summary(**change), LIMITS)
    assert len(bad) == 1 and named in bad[0], bad


# --------------------------------------------------------------------------- #
# What the sampler parses
# --------------------------------------------------------------------------- #

PAGE = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125
vllm:kvpush_quarantined_blocks{engine="0",model_name="m",side="decode"} 3.0
kvpush_quarantined_blocks{engine="0",model_name="m",side="decode"} 3.0
vllm:kvpush_transfers_total{engine="0",model_name="m",outcome="ok",side="decode"} 12.0
vllm:kvpush_transfers_total{engine="0",model_name="m",outcome="failed",side="decode"} 2.0
vllm:kvpush_transfers_total{engine="1",model_name="m",outcome="ok",side="decode"} 1.0
vllm:kvpush_transfers_total{engine="1",model_name="m",outcome="aborted",side="decode"} 0.0
"""


def test_metric_pages_are_summed_over_engines_by_their_vllm_names() -> None:
    sums = metric_sums(PAGE, ["vllm:kv_cache_usage_perc", "vllm:kvpush_quarantined_blocks", "vllm:absent"])
    assert sums == {"vllm:kv_cache_usage_perc": 0.375, "vllm:kvpush_quarantined_blocks": 3.0}  # bare name not twice
    assert gauges(PAGE) == {"kv": 0.375, "quarantined": 3.0} and gauges(None) is None
    assert counter_breakdown(PAGE, "vllm:kvpush_transfers_total") == {
        "outcome=ok,side=decode": 13.0,
        "outcome=failed,side=decode": 2.0,
    }


def test_at_rest_needs_an_answer_and_every_holding_at_zero() -> None:
    assert at_rest({"kv": 0.0, "quarantined": 0.0, "pending": 2.0})  # pending registrations hold no block
    assert not at_rest({"kv": 0.0, "quarantined": 1.0})
    assert not at_rest({"kv": 0.01})
    assert not at_rest(None) and not at_rest({})


def test_proc_parsers() -> None:
    assert rss_kib("Name:\tpython\nVmPeak:\t 9 kB\nVmRSS:\t  123456 kB\n") == 123456
    assert rss_kib("Name:\tkthreadd\n") == 0
    assert parent_of("4242 (VLLM::Engine (core)) S 4200 4242 4242 0 -1") == 4200


# --------------------------------------------------------------------------- #
# The plan and the faults' points
# --------------------------------------------------------------------------- #


def test_the_plan_is_deterministic_with_its_shares() -> None:
    a, b = plan(4000, 36, 0.10, 0.30, seed=1), plan(4000, 36, 0.10, 0.30, seed=1)
    assert a == b and a != plan(4000, 36, 0.10, 0.30, seed=2)
    kinds = [s.kind for s in a]
    aborts = kinds.count("abort-early") + kinds.count("abort-mid")
    assert 0.08 < aborts / 4000 < 0.12 and 0.27 < kinds.count("stream") / (4000 - aborts) < 0.33
    assert {s.prompt for s in a} == set(range(36))
    assert all(0.05 <= s.abort_after_s <= 1.0 for s in a if s.kind == "abort-early")
    lengths = prompt_lengths(36, 16, 600)
    assert lengths[0] == 16 and lengths[-1] == 600 and lengths == sorted(lengths)


def test_faults_parse_and_land_on_their_points() -> None:
    assert parse_faults("d,p,net") == ("d_restart", "p_restart", "net_drop")
    assert parse_faults("none") == ()
    with pytest.raises(ValueError):
        parse_faults("d,x")
    assert points(("d_restart", "net_drop"), (0.15, 0.45), 2000) == [("d_restart", 300), ("net_drop", 900)]


# --------------------------------------------------------------------------- #
# The client's judgement, against a stub server
# --------------------------------------------------------------------------- #


def _stub(answer: str, status: int = 200, stream_error: bool = False, finish: str = "length") -> web.Application:
    async def completions(req: web.Request) -> web.StreamResponse:
        ask = await req.json()
        if status != 200:
            return web.json_response({"error": {"message": "down"}}, status=status)
        if not ask["stream"]:
            return web.json_response({"choices": [{"text": answer, "finish_reason": finish}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        words = answer.split(" ")
        for i, word in enumerate(words):
            piece = {"text": word if i == 0 else " " + word, "finish_reason": finish if i == len(words) - 1 else None}
            await resp.write(f"data: {json.dumps({'choices': [piece]})}\n\n".encode())
            await asyncio.sleep(0.05)
        if stream_error:
            await resp.write(b'data: {"error": {"message": "D broke", "retryable": true}}\n\n')
        else:
            await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def _judge(app: web.Application, kind: str, want: str = "the right answer", abort_after_s: float = 0.0) -> Record:
    async def go() -> Record:
        server = TestServer(app)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                payload = body("m", "a prompt", 3, kind != "plain")
                url = str(server.make_url("")).rstrip("/")
                return await one(session, url, Spec(0, 0, kind, abort_after_s), payload, want, 0.0, 30.0)
        finally:
            await server.close()

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["plain", "stream"])
def test_a_completed_answer_is_compared_with_the_reference(kind: str) -> None:
    assert _judge(_stub("the right answer"), kind).outcome == OK
    wrong = _judge(_stub("the wrong answer"), kind)
    assert wrong.outcome == MISMATCH and "wrong" in wrong.error


@pytest.mark.parametrize(
    ("app", "kind"),
    [
        (_stub("x", status=503), "plain"),
        (_stub("x", status=502), "stream"),
        (_stub("the right answer", stream_error=True), "stream"),
        (_stub("the right answer", finish="error"), "plain"),  # vLLM's answer to a KV load that failed
        (_stub("the right", finish="abort"), "plain"),  # an engine that dropped the request
        (_stub("the right", finish="abort"), "stream"),
    ],
)
def test_an_answer_that_failed_is_a_failure_not_a_text(app: web.Application, kind: str) -> None:
    rec = _judge(app, kind)
    assert rec.outcome == FAILED and rec.error and not rec.timed_out


def test_the_client_closes_aborted_requests() -> None:
    assert _judge(_stub("the right answer"), "abort-mid").outcome == ABORTED
    assert _judge(_stub("the right answer"), "abort-early", abort_after_s=0.01).outcome == ABORTED
    # an answer complete before its abort time is an answer like any other
    assert _judge(_stub("the right answer"), "abort-early", abort_after_s=20.0).outcome == OK


# --------------------------------------------------------------------------- #
# The report
# --------------------------------------------------------------------------- #


def test_the_report_is_small_and_draws(tmp_path: Path) -> None:
    rows = [
        {"t": 2.0 * i, "ended": 3 * i, "prefill_rss_mb": 2000.0, "decode_rss_mb": 2100.0 + i % 3,
         "prefill": {"kv": 0.01, "in_flight": 0.0}, "decode": None if i == 5 else {"kv": 0.02, "quarantined": 0.0}}
        for i in range(5000)
    ]  # fmt: skip
    assert len(soak_report.thin(rows)) <= soak_report.MAX_ROWS and soak_report.thin(rows)[-1] == rows[-1]
    summary = _summary(faults=[{"name": "d_restart", "start": 100.0, "recovered": 160.0, "failures_explained": 2}])
    summary.update(wall_s=100.0, load_s=90.0, verdict=[])
    summary["kv_at_end"] = {"prefill": {"zero": True, "after_s": 1.0, "last": {}}, "decode": {"zero": False}}
    summary["memory"]["prefill"].update(window_s=[1.0, 2.0], points=9, rss_mb_first_last=[1.0, 2.0])
    summary["memory"]["decode"] = {"error": "no samples"}
    path = soak_report.write(tmp_path, summary, rows)
    assert path.stat().st_size < 200 * 1024
    assert soak_report.plot(tmp_path, summary, rows).read_bytes()[:4] == b"\x89PNG"
    said = soak_report.text(summary)
    assert "d_restart" in said and "NOT zero" in said and "no samples" in said
