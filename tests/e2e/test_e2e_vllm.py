"""End to end: real vLLM servers, P -> D through kvpush, against a single instance.

The servers start once per session and are shared with test_e2e_metrics
(``conftest.py``, ``e2e_cluster.py``: one to five minutes each on 2 cores),
so every check here is a delta or concerns its own requests. The
correctness bar is exact: greedy outputs through the router equal a plain,
non-disaggregated server's token for token, and vLLM's own counters show D
took the prompt from the transfer rather than computing it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import E2EServers
from e2e_family import Target, check_swap

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
# Block size 32: one prompt shorter than a block, several spanning many.
LENGTHS = [5, 31, 32, 33, 64, 100, 257, 500, 777, 1024, 1500, 2000]


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _metric(base: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in _get(base + "/metrics").splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _stream_text(url: str, body: dict[str, Any]) -> str:
    """Concatenate a streamed completion's text (SSE)."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    out = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


class Cluster:
    def __init__(
        self, model: str, single: str, p: str, d: str, router: str, router_kv: tuple[str, int], keys: str = ""
    ) -> None:
        self.model, self.single, self.p, self.d, self.router = model, single, p, d, router
        self.router_kv = router_kv  # P's side channel
        self.keys = keys  # P's key set: a request sent to D by hand carries the capability it gives

    def complete(self, base: str, prompt: str, **kw: Any) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
        return _post(base + "/v1/completions", body)["choices"][0]["text"]


@pytest.fixture(scope="module")
def cluster(e2e_pair: E2EServers, e2e_single: str) -> Cluster:
    """The session's shared servers (``conftest.py``), read at this module's start."""
    return Cluster(
        e2e_pair.model, e2e_single, e2e_pair.p, e2e_pair.d, e2e_pair.router_url, e2e_pair.p_kv, e2e_pair.keys
    )


def _prompts(seed: int) -> list[str]:
    return [prompt_words(n, seed=seed * 1000 + i) for i, n in enumerate(LENGTHS)]


def test_sequential_outputs_equal_single_instance_and_use_pushed_kv(cluster: Cluster) -> None:
    prompts = _prompts(seed=1)
    expected = [cluster.complete(cluster.single, p) for p in prompts]
    pushed_before = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    computed_before = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    got = [cluster.complete(cluster.router, p) for p in prompts]
    for n, e, g in zip(LENGTHS, expected, got, strict=True):
        assert g == e, f"prompt of {n} tokens: disaggregated output differs from single instance"
    pushed = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pushed_before
    computed = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_compute") - computed_before
    # Every prompt token reached D through the transfer; D computed none of them.
    assert pushed == sum(LENGTHS)
    assert computed == 0


def check_concurrent_and_streaming(cluster: Cluster, seed: int, streamed: int) -> None:
    """All prompts at once through the router, then prompt ``streamed`` streamed: as the single instance says."""
    prompts = _prompts(seed)
    expected = [cluster.complete(cluster.single, p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p: cluster.complete(cluster.router, p), prompts))
    assert got == expected
    body = {"model": cluster.model, "prompt": prompts[streamed], "max_tokens": MAX_TOKENS, "temperature": 0}
    assert _stream_text(cluster.router + "/v1/completions", body) == expected[streamed]


def wait_all_released(cluster: Cluster, timeout: float = 30.0) -> None:
    """Until P and D hold no KV block and the router has nothing pending (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = [_metric(u, "vllm:kv_cache_usage_perc") for u in (cluster.p, cluster.d)]
        router = json.loads(_get(cluster.router + "/kvpush/pending"))
        pending = (router["pending"], router["pending_prefill"])
        if usage == [0.0, 0.0] and pending == (0, 0):
            return
        assert time.monotonic() < deadline, f"blocks or transfers left: usage {usage}, router {pending}"
        time.sleep(0.5)


def test_concurrent_and_streaming_outputs_equal_single_instance(cluster: Cluster) -> None:
    check_concurrent_and_streaming(cluster, seed=2, streamed=6)


def test_chat_completion_equal_single_instance(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": prompt_words(300, seed=77)}]
    body = {"model": cluster.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    want = _post(cluster.single + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    got = _post(cluster.router + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert got == want
    assert _stream_text(cluster.router + "/v1/chat/completions", body) == want


def test_prefix_cached_on_d_is_not_pushed_again(cluster: Cluster) -> None:
    base = prompt_words(640, seed=5)
    first = cluster.complete(cluster.router, base)
    assert first == cluster.complete(cluster.single, base)
    longer = base + " " + prompt_words(100, seed=6)
    pushed0 = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    hit0 = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert cluster.complete(cluster.router, longer) == cluster.complete(cluster.single, longer)
    pushed = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pushed0
    hit = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") - hit0
    # D held the 640-token prefix (20 full blocks of 32): only the rest moved.
    assert hit == 640
    assert pushed == 100


def test_plain_requests_to_a_kvpush_server_pass_through(cluster: Cluster) -> None:
    prompt = prompt_words(200, seed=9)
    assert cluster.complete(cluster.d, prompt) == cluster.complete(cluster.single, prompt)


def test_dead_prefill_peer_falls_back_to_local_prefill(cluster: Cluster) -> None:
    """P gone: D notices within peer_dead_s, fails the transfer, and (policy recompute) prefills itself."""
    prompt = prompt_words(300, seed=21)
    dead_port = launcher.free_port()
    params = {
        "do_remote_prefill": True,
        "transfer_id": "dead-peer-1",
        "remote_host": "127.0.0.1",
        "remote_port": dead_port,
        "remote_tp_size": 1,
    }
    computed0 = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    t0 = time.monotonic()
    got = cluster.complete(cluster.d, prompt, kv_transfer_params=params)
    assert time.monotonic() - t0 < 60
    assert got == cluster.complete(cluster.single, prompt)
    assert _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_compute") - computed0 >= 299


def test_abort_on_d_while_waiting_for_kv_frees_its_blocks(cluster: Cluster) -> None:
    """Client gives up while D waits for a prefill that never comes: D fences, frees, P forgets."""
    prompt = prompt_words(500, seed=22)
    p_host, p_port = cluster.router_kv
    body = {
        "model": cluster.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": "abandoned-1",
            "remote_host": p_host,
            "remote_port": p_port,
            "remote_tp_size": 1,
            "capability": srv.capability(cluster.keys, "abandoned-1"),
        },
    }
    req = urllib.request.Request(
        cluster.d + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises((TimeoutError, urllib.error.URLError)), urllib.request.urlopen(req, timeout=3) as r:
        r.read()  # D holds the request waiting for KV: no token comes; the client disconnects
    deadline = time.monotonic() + 30
    while _metric(cluster.d, "vllm:kv_cache_usage_perc") != 0.0:
        assert time.monotonic() < deadline, "D kept the aborted request's blocks"
        time.sleep(0.5)
    # The pair still works afterwards.
    p2 = prompt_words(120, seed=23)
    assert cluster.complete(cluster.router, p2) == cluster.complete(cluster.single, p2)


def test_router_turns_a_dead_prefill_into_a_clear_error(cluster: Cluster, tmp_path: Path) -> None:
    dead = launcher.free_port()
    port = launcher.free_port()
    router = srv.router_server(
        [
            "--prefill",
            f"http://127.0.0.1:{dead}",
            "--prefill-kv",
            f"127.0.0.1:{launcher.free_port()}",
            "--decode",
            cluster.d,
            "--health-interval",
            "0",
        ],
        port,
        log_dir=tmp_path,
    )
    try:
        router.start()
        launcher.wait_all_healthy([router], timeout=60)
        body = {"model": cluster.model, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as info:
            _post(router.url + "/v1/completions", body, timeout=60)
        assert time.monotonic() - t0 < 30
        assert info.value.code in (502, 503)
        assert str(dead) in info.value.read().decode()
    finally:
        router.stop()


def test_d_continues_the_prompt_p_pushed(cluster: Cluster) -> None:
    """The swap test: D is sent prompt Q under the transfer id of P's prompt A and continues A, so it decoded
    over the KV P pushed (``e2e_family.check_swap``)."""
    c = cluster
    target = Target(c.model, c.p, c.d, c.router, c.single, c.router_kv, max_tokens=MAX_TOKENS, keys=c.keys)
    check_swap(target, 150, seed=90)


def test_everything_released_afterwards(cluster: Cluster) -> None:
    wait_all_released(cluster)
