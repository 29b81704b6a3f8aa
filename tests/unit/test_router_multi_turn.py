"""The router's multi-turn shell: a turn whose start a D holds goes to that D alone when the rest is short."""

from __future__ import annotations

import json
from typing import Any

from test_router import COMPLETION, cluster, run

from kvpush.integrations.router import Instance, Pool, config_from_args
from kvpush.integrations.router.multi_turn import MultiTurn
from kvpush.integrations.router.turns import TurnRoute

TURN1 = "w " * 300  # 600 characters, 300 tokens as the stand-in P counts (words)


def pools() -> tuple[Pool, Pool]:
    return Pool([Instance("http://p", "prefill")]), Pool(
        [Instance("http://d1", "decode"), Instance("http://d2", "decode")]
    )


def answer(text: str, prompt: int, completion: int, cached: int | None = None) -> bytes:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return json.dumps({"choices": [{"index": 0, "text": text}], "usage": usage}).encode()


def test_the_next_turn_goes_to_the_d_that_served_the_last() -> None:
    mt, (ps, ds) = MultiTurn(), pools()
    body = {**COMPLETION, "prompt": TURN1}
    first = mt.plan(body, ps, ds, [], None)
    assert first is not None and not first.held and first.d is None
    mt.served(ds.instances[1], first, body, answer(" said", 300, 1))
    nxt = {**COMPLETION, "prompt": TURN1 + " said and more"}
    plan = mt.plan(nxt, ps, ds, [], None)
    assert plan is not None and plan.d is ds.instances[1]
    assert plan.turn.route is TurnRoute.D_ALONE and plan.turn.held_on_d == 301 * 512 // 605
    assert mt.plan(nxt, ps, ds, [ds.instances[1]], None).d is None  # type: ignore[union-attr]  # failed: not it
    long = {**COMPLETION, "prompt": TURN1 + " said " + "z " * 3000}
    mt.prefilled(ps.instances[0], first, {"usage": {"prompt_tokens": 300}})
    assert mt.plan(long, ps, ds, [], None).turn.route is TurnRoute.TODAY  # type: ignore[union-attr]
    assert mt.state()["routes"] == {"d_alone": 1, "today": 1, "push_back": 0, "unheld": 2, "misses": 0}


def test_a_d_alone_answer_that_reused_less_corrects_the_index_down() -> None:
    mt, (ps, ds) = MultiTurn(), pools()
    d = ds.instances[0]
    body = {**COMPLETION, "prompt": TURN1}
    mt.served(d, mt.plan(body, ps, ds, [], None), body, answer("", 300, 0))  # type: ignore[arg-type]
    plan = mt.plan(body, ps, ds, [], None)
    assert plan is not None and plan.turn.route is TurnRoute.D_ALONE
    mt.served(d, plan, body, answer("", 300, 0, cached=0))  # D had evicted it all
    assert mt.counts["misses"] == 1 and mt.index.corrected > 0
    assert mt.index.held(d.name, plan.units).tokens > 0  # and holds it again now: it just computed it


def test_an_unhealthy_d_is_forgotten() -> None:
    mt, (ps, ds) = MultiTurn(), pools()
    d = ds.instances[0]
    body = {**COMPLETION, "prompt": TURN1}
    mt.served(d, mt.plan(body, ps, ds, [], None), body, None)  # type: ignore[arg-type]  # a stream: nothing known
    assert len(mt.index) == 0
    plan = mt.plan(body, ps, ds, [], None)
    assert plan is not None
    mt.prefilled(ps.instances[0], plan, {"usage": {"prompt_tokens": 300}})
    mt.served(d, plan, body, None)  # a stream after P counted the prompt
    assert mt.index.entries_of(d.name) == 4
    d.healthy = False
    assert not mt.plan(body, ps, ds, [], None).held  # type: ignore[union-attr]
    assert mt.index.entries_of(d.name) == 0


def test_unkeyable_requests_are_left_to_the_router() -> None:
    mt, (ps, ds) = MultiTurn(), pools()
    assert mt.plan({"prompt": ["a", "b"]}, ps, ds, [], None) is None


def test_router_serves_the_next_turn_on_the_holding_d_alone() -> None:
    async def go() -> None:
        async with cluster(n_d=2, multi_turn=True) as c:
            for d in c.d:
                d.delay = 0.2  # P answers first: its token count teaches the index
            body = {**COMPLETION, "prompt": TURN1}
            assert (await c.post("/v1/completions", body))[0] == 200
            (served,) = [d for d in c.d if d.seen]
            assert "kv_transfer_params" in served.seen[0].body
            for d in c.d:  # the other D is less loaded from now on: the index, not the load, picks
                d.seen.clear()
            turn2 = {**COMPLETION, "prompt": TURN1 + "decoded and one more line"}
            assert (await c.post("/v1/completions", turn2))[0] == 200
            assert len(c.p[0].seen) == 1  # P was not asked
            (d2,) = served.seen
            assert "kv_transfer_params" not in d2.body and d2.body["prompt"] == turn2["prompt"]
            turn3 = {**COMPLETION, "prompt": turn2["prompt"] + "decoded" + " z" * 3000}
            assert (await c.post("/v1/completions", turn3))[0] == 200
            assert len(c.p[0].seen) == 2  # a long new message goes through P
            assert served.seen[1].body["kv_transfer_params"]["do_remote_prefill"] is True
            _, pending = await c.get_json("/kvpush/pending")
            assert pending["multi_turn"]["routes"]["d_alone"] == 1
            assert pending["multi_turn"]["routes"]["today"] == 1

    run(go())


def test_without_multi_turn_the_next_turn_goes_through_p() -> None:
    async def go() -> None:
        async with cluster() as c:
            c.d[0].delay = 0.2
            for prompt in (TURN1, TURN1 + "decoded and one more line"):
                assert (await c.post("/v1/completions", {**COMPLETION, "prompt": prompt}))[0] == 200
            assert len(c.p[0].seen) == 2
            assert c.router.proxy.turns is None

    run(go())


def test_the_command_line_turns_it_on() -> None:
    base = ["--prefill=http://a:1", "--prefill-kv=h:1", "--decode=http://c:1"]
    assert config_from_args([*base, "--multi-turn"]).multi_turn is True
    assert config_from_args(base).multi_turn is False
    assert config_from_args([*base, "--multi-turn", "--turn-interference", "0"]).turn_interference == 0.0
    assert config_from_args(base).turn_interference == 1.0


def test_turn_interference_reaches_the_route() -> None:
    """With ``--turn-interference 0`` a long new message goes to the holding D alone (D's prefill no longer
    counts twice); with the default it goes through P, as the test above shows."""

    async def go() -> None:
        async with cluster(multi_turn=True, turn_interference=0.0) as c:
            c.d[0].delay = 0.2  # P answers first: its token count teaches the index
            assert (await c.post("/v1/completions", {**COMPLETION, "prompt": TURN1}))[0] == 200
            long = {**COMPLETION, "prompt": TURN1 + "decoded" + " z" * 3000}
            assert (await c.post("/v1/completions", long))[0] == 200
            assert len(c.p[0].seen) == 1  # P was not asked for the long turn
            _, pending = await c.get_json("/kvpush/pending")
            assert pending["multi_turn"]["routes"]["d_alone"] == 1

    run(go())
