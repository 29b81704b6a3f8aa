"""End to end: a conversation through kvpush's router with ``--multi-turn`` in front of real vLLM P and D.

Four turns of one conversation, each turn's prompt the previous prompt, its
answer and a new message; turns 2 and 3 add a short message, turn 4 a long
one. Through the multi-turn router:

* greedy outputs equal a plain server's at every turn (fp32 tiny model);
* turns 2 and 3 go to D alone: D's prompt tokens by source show the prefix
  came from D's own prefix cache (``local_cache_hit``) and nothing by
  transfer, P is not asked;
* turn 4 goes through P as today: D's tokens came by transfer.

The same conversation through the session's router (no ``--multi-turn``)
sends every turn through P: the check of turns 2 and 3 fails there, which
the last test asserts, so the first cannot pass with a router that ignores
the index.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import E2EServers
from test_e2e_vllm import _metric, _post

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
FIRST, SHORT, LONG = 400, 10, 1200  # words, one token each
SOURCE = "vllm:prompt_tokens_by_source_total"


@dataclass(frozen=True)
class Turn:
    """One turn through a router: its output, the plain server's, and D's and P's prompt tokens by source."""

    prompt_words: int
    text: str
    single: str
    cache_hit: float  # D's prompt tokens from its own prefix cache
    transferred: float  # D's prompt tokens that came by transfer
    computed: float  # D's prompt tokens computed on D
    p_computed: float  # P's prompt tokens computed on P
    seconds: float  # the router's answer, whole (MAX_TOKENS tokens): shown, not checked


def _d_sources(base: str) -> tuple[float, float, float]:
    return tuple(  # type: ignore[return-value]
        _metric(base, SOURCE, source=s) for s in ("local_cache_hit", "external_kv_transfer", "local_compute")
    )


def converse(router: str, servers: E2EServers, single: str, seed: int) -> list[Turn]:
    """Four turns (short, short, long new messages after the first) through ``router``."""
    prompt = prompt_words(FIRST, seed=seed)
    turns = []
    for k, new in enumerate((0, SHORT, SHORT, LONG)):
        if new:
            prompt = f"{prompt} {turns[-1].text.strip()} {prompt_words(new, seed=seed + k)}"
        body = {"model": servers.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        before, p_before = _d_sources(servers.d), _metric(servers.p, SOURCE, source="local_compute")
        t0 = time.monotonic()
        text = _post(router + "/v1/completions", body)["choices"][0]["text"]
        seconds = time.monotonic() - t0
        after, p_after = _d_sources(servers.d), _metric(servers.p, SOURCE, source="local_compute")
        single_text = _post(single + "/v1/completions", body)["choices"][0]["text"]
        delta = [a - b for a, b in zip(after, before, strict=True)]
        turns.append(Turn(len(prompt.split()), text, single_text, *delta, p_after - p_before, seconds))
        print(f"{router} turn {k + 1}: {turns[-1]}")
    return turns


def check_later_turns_on_d(turns: list[Turn]) -> None:
    """Turns 2 and 3: D alone, the prefix from D's cache; turn 4 through P."""
    for turn in turns[1:3]:
        assert turn.transferred == 0 and turn.p_computed == 0, turn
        assert turn.cache_hit >= turn.prompt_words - SHORT - MAX_TOKENS - 2 * 32, turn  # all but the new blocks
        assert turn.computed + turn.cache_hit == turn.prompt_words, turn
    last = turns[3]
    assert last.transferred > 0 and last.p_computed > 0, last


@pytest.fixture(scope="module")
def multi_turn_router(e2e_pair: E2EServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs: Path = tmp_path_factory.mktemp("multi_turn")
    args = ["--prefill", e2e_pair.p, "--prefill-kv", f"127.0.0.1:{e2e_pair.kv_port}", "--decode", e2e_pair.d]
    router = srv.router_server([*args, "--multi-turn"], launcher.free_port(), log_dir=logs, keys=e2e_pair.keys)
    try:
        router.start()
        launcher.wait_all_healthy([router], timeout=60)
        yield router.url
    finally:
        launcher.stop_all([router])


def _pending(router: str) -> dict[str, Any]:
    with urllib.request.urlopen(router + "/kvpush/pending", timeout=30) as r:
        return json.loads(r.read())


def test_later_turns_reuse_ds_cache_and_match_a_single_instance(
    e2e_pair: E2EServers, e2e_single: str, multi_turn_router: str
) -> None:
    turns = converse(multi_turn_router, e2e_pair, e2e_single, seed=4501)
    assert [t.text for t in turns] == [t.single for t in turns]
    check_later_turns_on_d(turns)
    routes = _pending(multi_turn_router)["multi_turn"]["routes"]
    assert routes["d_alone"] == 2 and routes["today"] == 1 and routes["unheld"] == 1, routes


def test_a_router_without_the_index_sends_every_turn_through_p(e2e_pair: E2EServers, e2e_single: str) -> None:
    turns = converse(e2e_pair.router_url, e2e_pair, e2e_single, seed=4601)
    assert [t.text for t in turns] == [t.single for t in turns]
    with pytest.raises(AssertionError):
        check_later_turns_on_d(turns)
    assert all(t.transferred > 0 for t in turns[1:]), turns
