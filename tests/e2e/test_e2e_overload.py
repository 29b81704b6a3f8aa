"""End to end: a P that cannot keep up, and kvpush degrading instead of failing.

P is slowed by its configuration only (a 32-token step budget, two
sequences at a time), so a burst of long prompts queues behind it. D's
``transfer_timeout_s`` is far shorter than that queue: a registration
survives only because P acknowledges it as queued or running. D lets four
registrations wait on P (the rest register late) and the router refuses
what the least-loaded P cannot take (HTTP 503 ``overloaded``, retryable).

Checked: every request completes or is refused with that 503 (no internal
error), D got every served prompt's KV by transfer, nothing parked on P
for a lease or expired on D, both KV pools return to zero, and a light
request afterwards is served.

This module starts its own P, D and router (their configuration is the
test); it does not need the session's shared servers.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_cluster import model_dir
from test_e2e_vllm import _metric

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 1500
BURST = 14
QUEUE_BOUND = 8  # the router's --max-prefill-queue
WAITING_BOUND = 4  # D's max_waiting_registrations


@dataclass
class Stack:
    model: str
    p: launcher.ServerProcess
    d: launcher.ServerProcess
    router: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("overload")
    model = model_dir()
    p_port, d_port, kv_port, r_port = (launcher.free_port() for _ in range(4))
    keys = srv.temp_keys()  # P and D of this stack authenticate with one key set
    p = srv.vllm_server(
        "prefill-slow",
        model,
        p_port,
        log_dir=logs,
        cpus="0",
        kv_transfer_config=srv.kvpush_transfer_config("kv_producer", kv_port, auth_keys_dir=keys),
        check_ports=(kv_port,),
        extra_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "2"],
        fast_start=True,
    )
    d_cfg = {"transfer_timeout_s": 1.0, "peer_dead_s": 5.0, "max_waiting_registrations": WAITING_BOUND}
    d = srv.vllm_server(
        "decode",
        model,
        d_port,
        log_dir=logs,
        cpus="1",
        kv_transfer_config=srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys, **d_cfg),
        fast_start=True,
    )
    args = ["--prefill", p.url, "--prefill-kv", f"127.0.0.1:{kv_port}", "--decode", d.url]
    router = srv.router_server([*args, "--max-prefill-queue", str(QUEUE_BOUND)], r_port, log_dir=logs, keys=keys)
    try:
        for s in (p, d):
            s.start()
        launcher.wait_all_healthy([p, d], timeout=900)
        router.start()
        launcher.wait_all_healthy([router], timeout=60)
        yield Stack(model, p, d, router.url)
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([router, p, d])


def _complete(url: str, model: str, prompt: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_overload_completes_or_refuses_fast_and_leaves_nothing_held(stack: Stack) -> None:
    s = stack
    prompts = [prompt_words(PROMPT_TOKENS, seed=900 + i) for i in range(BURST)]
    source = "vllm:prompt_tokens_by_source_total"
    pushed0 = _metric(s.d.url, source, source="external_kv_transfer")
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda pr: _complete(s.router, s.model, pr), prompts))
    statuses = [code for code, _ in answers]
    assert set(statuses) <= {200, 503}, answers
    for code, body in answers:
        if code == 503:
            assert body["error"]["type"] == "overloaded" and body["error"]["retryable"], body
        else:
            assert body["choices"][0]["finish_reason"] == "length", body
    served = statuses.count(200)
    print(f"overload burst of {BURST}: {served} served, {statuses.count(503)} refused with 503")
    assert served >= QUEUE_BOUND and statuses.count(503) >= 1, statuses
    # Every served prompt's KV came by transfer (nothing failed over to D's own compute)
    assert _metric(s.d.url, source, source="external_kv_transfer") - pushed0 == served * PROMPT_TOKENS
    # Once the burst is over, a light request is served
    assert _complete(s.router, s.model, prompt_words(40, seed=999))[0] == 200
    deadline = time.monotonic() + 30
    while (usage := [_metric(u.url, "vllm:kv_cache_usage_perc") for u in (s.p, s.d)]) != [0.0, 0.0]:
        assert time.monotonic() < deadline, f"KV blocks still held: {usage}"
        time.sleep(0.25)
    p_log = Path(s.p.log_path).read_text(errors="replace")
    d_log = Path(s.d.log_path).read_text(errors="replace")
    assert "lease expired" not in p_log and "released unpushed" not in p_log
    assert "no KV from P within" not in d_log and "Traceback" not in d_log + p_log
