"""End to end: kvpush P/D behind routers written for vLLM, unchanged.

* vllm-router (the vLLM project's Rust router, from PyPI) in its vLLM P/D
  mode: P first with ``max_tokens: 1``, then D with the
  ``kv_transfer_params`` P returned. Greedy outputs equal a plain server's,
  D's counters show every prompt token came by transfer, a client's cancel
  leaves nothing parked on P.
* The swap test: D gets prompt Q, sharing only its last tokens with prompt A,
  and the parameters P returned for A; D continues A, so it used P's KV.
* The proxy the benchmarks use for vLLM's push connector (``kvpush router
  --mode vllm-push``, vLLM's conventions only), in front of a P launched as
  vLLM's push P with only the connector's name changed.
* Prompt lists (one request, several prompts) through the routers, longest
  first and shortest first: each prompt its own transfer.

The servers are the session's shared ones (``e2e_cluster.py``); the routers
start once per module.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import P_ENGINE_ID, E2EServers
from test_e2e_vllm import _metric, _post, _stream_text

from kvpush.observability.timeline import parse_lines
from kvpush_tools.bench.stack_build import router_args
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
LENGTHS = [5, 33, 257, 1024, 2000]
STREAMED = 300
PUSHED = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
COMPUTED = ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


class Servers:
    def __init__(self, pair: E2EServers, single: str, vllm_router: str, push_proxy: str) -> None:
        self.model, self.single, self.p, self.d = pair.model, single, pair.p, pair.d
        self.kvpush_router, self.vllm_router, self.push_proxy = pair.router_url, vllm_router, push_proxy

    def complete(self, base: str, prompt: str | list[str], **kw: Any) -> list[str]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
        choices = _post(base + "/v1/completions", body)["choices"]
        return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]

    def counts(self) -> tuple[float, float]:
        """D's prompt tokens so far: (came by transfer, computed on D)."""
        return _metric(self.d, PUSHED[0], **PUSHED[1]), _metric(self.d, COMPUTED[0], **COMPUTED[1])


def vllm_router_process(p: str, d: str, log_dir: Path) -> launcher.ServerProcess:
    return srv.vllm_router_server(p, d, launcher.free_port(), log_dir=log_dir)


@pytest.fixture(scope="module")
def servers(e2e_pair: E2EServers, e2e_single: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    logs = tmp_path_factory.mktemp("routers")
    vr = vllm_router_process(e2e_pair.p, e2e_pair.d, logs)
    # The benchmark's proxy for vLLM's push connector, with the arguments it gives vLLM's push stack.
    args = router_args("vllm-push", e2e_pair.p, e2e_pair.d, e2e_pair.kv_port, P_ENGINE_ID)
    proxy = srv.router_server(args, launcher.free_port(), log_dir=logs, keys=e2e_pair.keys)
    try:
        vr.start()
        proxy.start()
        launcher.wait_all_healthy([vr, proxy], timeout=120)
        yield Servers(e2e_pair, e2e_single, vr.url, proxy.url)
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([vr, proxy])


def wait_nothing_held(s: Servers, timeout: float) -> None:
    """Until neither P nor D holds a KV block (fails after ``timeout``, well inside P's 60 s lease)."""
    deadline = time.monotonic() + timeout
    while (usage := [_metric(u, "vllm:kv_cache_usage_perc") for u in (s.p, s.d)]) != [0.0, 0.0]:
        assert time.monotonic() < deadline, f"KV blocks still held {timeout:g}s later (P, D usage): {usage}"
        time.sleep(0.25)


def check_outputs_and_transfer(s: Servers, router: str, seed: int) -> None:
    prompts = [prompt_words(n, seed=seed * 1000 + i) for i, n in enumerate([*LENGTHS, STREAMED])]
    expected = [s.complete(s.single, p)[0] for p in prompts]
    pushed0, computed0 = s.counts()
    got = [s.complete(router, p)[0] for p in prompts[:-1]]
    body = {"model": s.model, "prompt": prompts[-1], "max_tokens": MAX_TOKENS, "temperature": 0}
    got.append(_stream_text(router + "/v1/completions", body))
    pushed, computed = (b - a for a, b in zip((pushed0, computed0), s.counts(), strict=True))
    for n, e, g in zip([*LENGTHS, STREAMED], expected, got, strict=True):
        assert g == e, f"prompt of {n} tokens: output through the router differs from a single instance"
    assert (pushed, computed) == (sum(LENGTHS) + STREAMED, 0), "D computed prompt tokens itself"


def test_vllm_router_sequential_outputs_equal_single_instance(servers: Servers) -> None:
    check_outputs_and_transfer(servers, servers.vllm_router, seed=31)
    wait_nothing_held(servers, timeout=20)


def test_vllm_push_proxy_drives_kvpush_unchanged(servers: Servers) -> None:
    check_outputs_and_transfer(servers, servers.push_proxy, seed=32)
    wait_nothing_held(servers, timeout=20)


def test_swap_d_continues_the_prompt_whose_kv_p_returned(servers: Servers) -> None:
    """P's answer alone tells D where A's KV is: D, given Q, continues A (vLLM recomputes only the last token)."""
    s = servers
    a = prompt_words(400, seed=41)
    tail = a.split()[-4:]
    q = " ".join([*prompt_words(396, seed=42).split(), *tail])
    want_a, want_q = s.complete(s.single, a)[0], s.complete(s.single, q)[0]
    assert want_a != want_q, "pick other prompts: A and Q continue alike"
    # vllm-router's P request, and its X-Request-Id convention.
    rid = f"___prefill_addr_{s.p[7:]}___decode_addr_{s.d[7:]}_swap41"
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_host": None}
    answer = _post_with_id(s.p, {"model": s.model, "prompt": a, "max_tokens": 1, "kv_transfer_params": p_params}, rid)
    params = answer["kv_transfer_params"]
    assert params["remote_engine_id"] == P_ENGINE_ID and params["do_remote_prefill"] is True
    pushed0, computed0 = s.counts()
    body = {"model": s.model, "prompt": q, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params}
    got = _post_with_id(s.d, body, rid)["choices"][0]["text"]
    pushed, computed = (b - a for a, b in zip((pushed0, computed0), s.counts(), strict=True))
    assert got == want_a, "D did not continue the prompt P pushed"
    assert (pushed, computed) == (400, 0)
    wait_nothing_held(s, timeout=20)


def _post_with_id(base: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.parametrize(
    "lengths", [[600, 120], [120, 600], [599, 480, 350, 240, 170, 109], [109, 170, 240, 350, 480, 599]]
)
@pytest.mark.parametrize("router", ["kvpush", "vllm-router"])
def test_prompt_list_each_prompt_its_own_transfer(servers: Servers, router: str, lengths: list[int]) -> None:
    """One request, several prompts: every output equals a single instance, every prompt's KV came by transfer."""
    s = servers
    base = s.kvpush_router if router == "kvpush" else s.vllm_router
    seed = 50 + len(lengths) * 10 + (lengths[0] < lengths[-1]) + (router == "kvpush") * 5
    prompts = [prompt_words(n, seed=seed * 100 + i) for i, n in enumerate(lengths)]
    expected = s.complete(s.single, prompts)
    pushed0, computed0 = s.counts()
    got = s.complete(base, prompts)
    pushed, computed = (b - a for a, b in zip((pushed0, computed0), s.counts(), strict=True))
    for n, e, g in zip(lengths, expected, got, strict=True):
        assert g == e, f"prompt of {n} tokens in a list of {len(lengths)}: output differs from a single instance"
    assert (pushed, computed) == (sum(lengths), 0)
    wait_nothing_held(s, timeout=20)


@pytest.mark.parametrize("after_s", [0.05, 0.3, None])
def test_client_cancel_through_vllm_router_leaves_nothing_parked(servers: Servers, after_s: float | None) -> None:
    """The client hangs up (while P prefills, while D waits or decodes): P holds nothing until its lease."""
    s = servers
    body = {"model": s.model, "prompt": prompt_words(1800, seed=60 + int((after_s or 1) * 100)), "max_tokens": 400}
    body.update(temperature=0, stream=True, ignore_eos=True)
    host, port = s.vllm_router[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        data = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        conn.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        if after_s is None:
            got = b""
            while b"data:" not in got:  # D is streaming: the KV came
                chunk = conn.recv(65536)
                assert chunk, f"the stream ended before its first event: {got[-300:]!r}"
                got += chunk
        else:
            time.sleep(after_s)
    wait_nothing_held(s, timeout=20)
    # The pair still serves afterwards.
    prompt = prompt_words(90, seed=69)
    assert s.complete(s.vllm_router, prompt) == s.complete(s.single, prompt)


def test_no_log_shows_a_capability(e2e_pair: E2EServers, servers: Servers) -> None:
    """The transfers this module ran (kvpush router, its vllm-push mode, vllm-router): none of their
    capabilities appears in P's, D's (both at DEBUG) or the router's log; the ids do."""
    for seed, router in enumerate((servers.vllm_router, servers.kvpush_router, servers.push_proxy)):
        servers.complete(router, prompt_words(40, seed=330 + seed))  # one of each flow, also when run alone
    logs = [s.log_path.read_text(errors="replace") for s in [*e2e_pair.pair, e2e_pair.router] if s is not None]
    records, _ = parse_lines(logs[0].splitlines())
    tids = {r["transfer_id"] for r in records if r["side"] == "prefill"}
    assert len(tids) >= 3, "P's timeline lines are missing"
    shared = {t.split("/")[0] for t in tids}
    for tid in shared:
        cap = srv.capability(e2e_pair.keys, tid)
        assert not any(cap in text for text in logs), f"the capability of {tid} is in a log"
