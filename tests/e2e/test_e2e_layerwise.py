"""End to end with layer-wise push on: real vLLM servers, against a single instance.

P runs with ``"layerwise": true`` and chunked prefill (512 tokens a step): the
connector's ``save_kv_layer`` hook hands each layer of a request in its final
prefill chunk to the push thread, which writes it while the later layers
still compute. Twice: with the default schedule (layers held back until two
are left, then one burst) and streaming (every layer its own WRITE as soon as
it is written: the most interleaving of pushes with the forward). The bar is the same as the
whole-request e2e test (greedy outputs equal token for token, D computes no
prompt token), plus evidence that pushes really went in several parts, and
that a client abort during the prefill leaves no block held anywhere.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from e2e_cluster import model_dir
from test_e2e_vllm import (
    LENGTHS,
    MAX_TOKENS,
    Cluster,
    _metric,
    _prompts,
    check_concurrent_and_streaming,
    wait_all_released,
)

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e


SCHEDULES = {
    "default": {},
    # Streaming, every layer its own part.
    "streaming": {"layerwise_min_part_bytes": 0, "layerwise_lead_layers": 1000},
}


@pytest.fixture(scope="module", params=list(SCHEDULES))
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, e2e_single: str
) -> Iterator[Cluster]:
    """Its own P (layer-wise), D and router; the session's plain server (``conftest.py``) as the reference."""
    model = model_dir()
    logs = tmp_path_factory.mktemp(f"e2e-layerwise-{request.param}-logs")
    p_port, d_port, router_port, kv_port = (launcher.free_port() for _ in range(4))
    cpus_p, cpus_d = ("0", "1") if (os.cpu_count() or 1) > 1 else ("0", "0")
    keys = srv.temp_keys()
    servers = [
        srv.vllm_server(
            "prefill",
            model,
            p_port,
            log_dir=logs,
            cpus=cpus_p,
            # Every prompt layer-wise, however short (the default threshold is 4096 tokens).
            kv_transfer_config=srv.kvpush_transfer_config(
                "kv_producer",
                kv_port,
                auth_keys_dir=keys,
                layerwise=True,
                layerwise_min_tokens=0,
                **SCHEDULES[request.param],
            ),
            check_ports=(kv_port,),
            fast_start=True,
            # Chunked prefill on P: prompts over 512 tokens take several steps, and only the final
            # chunk's step pushes (with the blocks gathered over all chunks).
            extra_args=["--max-num-batched-tokens", "512"],
        ),
        srv.vllm_server(
            "decode",
            model,
            d_port,
            log_dir=logs,
            cpus=cpus_d,
            kv_transfer_config=srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys),
            fast_start=True,
        ),
    ]
    router = srv.router_server(
        [
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            "--prefill-kv",
            f"127.0.0.1:{kv_port}",
            "--decode",
            f"http://127.0.0.1:{d_port}",
        ],
        router_port,
        log_dir=logs,
        keys=keys,
    )
    try:
        for s in servers:
            s.start()
        launcher.wait_all_healthy(servers, timeout=900, progress=print)
        router.start()
        launcher.wait_all_healthy([router], timeout=60)
        yield Cluster(model, e2e_single, servers[0].url, servers[1].url, router.url, ("127.0.0.1", kv_port))
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([*servers, router])


def _parts(base: str, side: str) -> float:
    return _metric(base, "kvpush_transfer_parts_total", side=side)


def _transfers(base: str, side: str) -> float:
    return _metric(base, "kvpush_transfers_total", side=side, outcome="ok")


def _wait_metric(read: Callable[[], float], want: Callable[[float], bool], timeout: float = 10.0) -> float:
    """Metrics reach /metrics with vLLM's next stats report: poll until ``want(value)``."""
    deadline = time.monotonic() + timeout
    while True:
        v = read()
        if want(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.25)


def test_layerwise_outputs_equal_single_instance_and_push_in_parts(
    cluster: Cluster, request: pytest.FixtureRequest
) -> None:
    prompts = _prompts(seed=11)
    expected = [cluster.complete(cluster.single, p) for p in prompts]
    pushed0 = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    computed0 = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    parts0, done0 = _parts(cluster.p, "prefill"), _transfers(cluster.p, "prefill")
    lw0 = _metric(cluster.p, "kvpush_layerwise_prefills_total", side="prefill")
    reports0 = _metric(cluster.p, "kvpush_layer_reports_total", side="prefill")
    d_parts0 = _parts(cluster.d, "decode")
    got = [cluster.complete(cluster.router, p) for p in prompts]
    for n, e, g in zip(LENGTHS, expected, got, strict=True):
        assert g == e, f"prompt of {n} tokens: layer-wise output differs from single instance"
    pushed = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pushed0
    computed = _metric(cluster.d, "vllm:prompt_tokens_by_source_total", source="local_compute") - computed0
    assert pushed == sum(LENGTHS) and computed == 0
    done = _wait_metric(lambda: _transfers(cluster.p, "prefill"), lambda v: v - done0 >= len(LENGTHS)) - done0
    parts = _parts(cluster.p, "prefill") - parts0
    d_parts = _wait_metric(lambda: _parts(cluster.d, "decode"), lambda v: v - d_parts0 >= parts) - d_parts0
    assert done == len(LENGTHS)
    # Every prefill went layer-wise, and vLLM's save_kv_layer hook reported each of the model's 4
    # layers (one request per step here), not just the end-of-forward fallback.
    assert _metric(cluster.p, "kvpush_layerwise_prefills_total", side="prefill") - lw0 == len(LENGTHS)
    assert _metric(cluster.p, "kvpush_layer_reports_total", side="prefill") - reports0 >= 4 * len(LENGTHS)
    # Streaming: one WRITE per group of layers ready when the push thread ran (on this machine P's
    # forward and its push thread share one core, so layers often coalesce). Default: the first three
    # layers at most in one WRITE (held until two are left; the tiny model's layers are far under
    # layerwise_min_part_bytes, so they wait until one is left), the last alone. D counted every one.
    most = 2 if request.node.callspec.params["cluster"] == "default" else 4
    assert len(LENGTHS) <= parts <= most * len(LENGTHS), (parts, done)
    assert d_parts == parts


def test_layerwise_concurrent_and_streaming_equal_single_instance(cluster: Cluster) -> None:
    check_concurrent_and_streaming(cluster, seed=12, streamed=9)


def test_client_abort_during_prefill_releases_everything(cluster: Cluster) -> None:
    """Clients give up while P is still prefilling (layers may be in flight): no block stays held."""
    body = {"model": cluster.model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    for i in range(3):
        data = json.dumps({**body, "prompt": prompt_words(3000, seed=40 + i)}).encode()
        req = urllib.request.Request(cluster.router + "/v1/completions", data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=0.2 + 0.3 * i) as r:
                r.read()
        except (TimeoutError, urllib.error.URLError):
            pass  # the client disconnected mid-prefill, as intended
    wait_all_released(cluster, timeout=60)
    # And the pair still serves correctly afterwards.
    p2 = prompt_words(700, seed=49)
    assert cluster.complete(cluster.router, p2) == cluster.complete(cluster.single, p2)
