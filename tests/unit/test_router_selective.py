"""Selective disaggregation: the choice from learned costs (pure), and the router serving D alone (stand-ins)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_router import COMPLETION, cluster, run

from kvpush.integrations.router import Instance, dp_engines
from kvpush.integrations.router.engine_metrics import PrefillRate, prefill_totals, push_totals
from kvpush.integrations.router.selective import Route, Selector, fit_line


def trained(prefill_s_per_token: float = 1e-4, fixed: float = 0.05, per_token: float = 1e-5) -> Selector:
    s = Selector(min_samples=4, explore_every=5)
    for n in (100, 500, 1000, 2000, 4000):
        s.observe_transfer(n, fixed + per_token * n)
    s.observe_prefill(prefill_s_per_token * 10_000, 10_000)
    for n in (100, 2000):
        s.observe_prompt(n * 5, n)  # five characters per token
    return s


def test_line_fit_recovers_fixed_and_per_token_costs() -> None:
    fit = fit_line([(n, 0.02 + 3e-5 * n) for n in (10, 100, 1000)])
    assert fit is not None and abs(fit.fixed - 0.02) < 1e-9 and abs(fit.per_token - 3e-5) < 1e-12
    assert fit_line([(10, 1.0), (10, 2.0)]) is None  # one length says nothing about the slope
    assert fit_line([(10, 1.0)]) is None


def test_disaggregates_until_both_costs_are_measured() -> None:
    s = Selector(min_samples=4)
    assert s.choose({"prompt": [1] * 10}).route is Route.DISAGGREGATE  # nothing learned yet
    for n in (10, 20, 30, 40):
        s.observe_transfer(n, 1.0)
    assert s.choose({"prompt": [1] * 10}).route is Route.DISAGGREGATE  # no prefill rate yet
    s.observe_prefill(1.0, 1000)
    assert s.choose({"prompt": [1] * 10}).route is Route.LOCAL


def test_threshold_follows_the_measured_costs() -> None:
    """Crossover where prefill(n) = transfer(n): 1e-4 n = 0.05 + 1e-5 n, n ~ 556 tokens."""
    s = trained()
    assert s.choose({"prompt": "x" * (5 * 300)}).local  # ~300 tokens: transfer costs more
    assert not s.choose({"prompt": "x" * (5 * 900)}).local
    assert not s.choose({"prompt": [7] * 900}).local and s.choose({"prompt": [7] * 300}).route in (
        Route.LOCAL,
        Route.EXPLORE,
    )
    faster = trained(fixed=0.005)  # a cheaper transfer moves the crossover down (~56 tokens)
    assert not faster.choose({"prompt": [7] * 300}).local
    slower_prefill = trained(prefill_s_per_token=1e-5 + 1e-7)  # prefill barely above the per-token transfer
    assert slower_prefill.choose({"prompt": [7] * 3000}).local


def test_push_stats_set_the_slope_so_a_busy_d_does_not_pass_for_a_slow_transfer() -> None:
    """Under load long prompts meet a busier D: their timings grow, but the bytes' cost is kvpush's push rate."""
    s = Selector(min_samples=4)
    for n in (64, 64, 64, 2048, 2048, 2048):
        s.observe_transfer(n, 0.05 + (0.6 if n == 2048 else 0.0))  # the long ones waited for a busy D
    s.observe_prefill(1e-4 * 10_000, 10_000)
    fitted = s.choose({"prompt": [1] * 2048})
    assert fitted.local  # a line through these timings calls the long prompt's transfer slow
    s.observe_push(0.01, 1_000_000, 100)  # kvpush pushed 10,000 tokens' KV in 10 ms: 1 us a token
    model = s.transfer_model()
    assert model is not None and abs(model.per_token - 1e-6) < 1e-12 and abs(model.fixed - 0.05) < 0.01
    assert not s.choose({"prompt": [1] * 2048}).local  # 0.2 s of prefill against ~0.05 s of transfer
    assert s.choose({"prompt": [1] * 64}).local  # 6 ms of prefill against ~0.05 s


def test_some_would_be_local_requests_still_measure_the_transfer() -> None:
    s = trained()
    routes = [s.choose({"prompt": [1] * 50}).route for _ in range(10)]
    assert routes.count(Route.EXPLORE) == 2 and routes.count(Route.LOCAL) == 8


def test_unknown_lengths_are_disaggregated() -> None:
    s = Selector(min_samples=1)
    s.observe_transfer(10, 1.0)
    s.observe_transfer(20, 1.0)
    s.observe_prefill(1.0, 1000)
    assert s.choose({"prompt": "no text seen yet"}).route is Route.DISAGGREGATE  # no characters per token yet
    assert s.choose({"prompt": ["a", "b"]}).route is Route.DISAGGREGATE  # a prompt list
    assert s.choose({"messages": [{"role": "user", "content": "hi"}]}).route is Route.DISAGGREGATE


def test_prefill_totals_from_vllm_metrics() -> None:
    text = "\n".join(
        [
            "# HELP vllm:request_prefill_time_seconds x",
            'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.5',
            'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 3000.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 64.0',
        ]
    )
    assert prefill_totals(text) == (1.5, 3000.0)
    kv = "\n".join(
        [
            'kvpush_transfer_latency_seconds_sum{engine="0",model_name="m"} 0.25',
            'vllm:kvpush_transfer_bytes_total{engine="0",model_name="m"} 1000000.0',
            'kvpush_kv_bytes_per_token{engine="0",model_name="m"} 4096.0',
            'kvpush_transfer_latency_seconds_count{engine="0",model_name="m"} 9.0',
        ]
    )
    assert push_totals(kv) == (0.25, 1_000_000.0, 4096.0)


def test_router_serves_a_short_prompt_on_d_alone() -> None:
    async def go() -> None:
        async with cluster(selective=True) as c:
            assert c.router.selector is not None
            trained_state = trained()
            c.router.selector = trained_state
            body: dict[str, Any] = {**COMPLETION, "prompt": [5] * 40}
            status, _, _ = await c.post("/v1/completions", body)
            assert status == 200
            assert not c.p[0].seen  # P never asked
            (d,) = c.d[0].seen
            assert "kv_transfer_params" not in d.body and d.body["prompt"] == [5] * 40
            status, _, _ = await c.post("/v1/completions", {**COMPLETION, "prompt": [5] * 3000})
            assert status == 200 and len(c.p[0].seen) == 1  # a long one is disaggregated
            assert c.d[0].seen[1].body["kv_transfer_params"]["do_remote_prefill"] is True
            assert trained_state.counts["local"] == 1 and trained_state.counts["disaggregate"] == 1
            _, pending = await c.get_json("/kvpush/pending")
            assert pending["selective"]["choices"]["local"] == 1
            await asyncio.sleep(0)

    run(go())


def test_router_learns_the_transfer_from_its_own_timings() -> None:
    """Disaggregated requests teach the selector: P's answer to D's first byte, P's token count, characters."""

    async def go() -> None:
        async with cluster(selective=True) as c:
            c.p[0].delay, c.d[0].delay = 0.05, 0.25  # D's first byte comes ~0.2 s after P's answer
            for n in (10, 20, 30):
                assert (await c.post("/v1/completions", {**COMPLETION, "prompt": [3] * n}))[0] == 200
            assert (await c.post("/v1/completions", {**COMPLETION, "prompt": "one two three four"}))[0] == 200
            await asyncio.sleep(0.05)
            sel = c.router.selector
            assert sel is not None
            samples = sel.transfer_samples()
            assert [n for n, _ in samples] == [10, 20, 30, 4]
            assert all(0.0 <= s < 0.3 for _, s in samples), samples  # at most D's delay past P's answer
            assert max(s for _, s in samples) > 0.1
            assert sel.tokens_of({"prompt": "x" * 36}) == 8  # 4.5 characters a token, from "one two three four"

    run(go())


def test_a_data_parallel_p_is_scraped_once_for_all_its_ranks() -> None:
    """The DP ranks of one P share its API server's ``/metrics``: one scrape per server, not per rank."""
    scrapes: list[str] = []

    async def metrics(req: web.Request) -> web.Response:
        scrapes.append(req.path)
        return web.Response(text="")

    async def go() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        server = TestServer(app)
        await server.start_server()
        try:
            p = Instance(str(server.make_url("")), "prefill", "h", 5600, 1)
            async with aiohttp.ClientSession() as session:
                await PrefillRate(Selector(), lambda: session).read(dp_engines(p, 2, "kvpush"))
        finally:
            await server.close()

    run(go())
    assert scrapes == ["/metrics"]
