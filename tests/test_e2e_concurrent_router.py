"""End to end: vllm-router dispatching P and D at once, kvpush unchanged, and the overlap kept.

vllm-router's one concurrent P/D mode (0.1.17: ``--kv-connector moriio``
with instances that announce a ``WRITE`` transfer mode to its service
discovery) sends P and D their requests together, names a transfer id in
both, and P's side channel only in the request id
(``___prefill_addr_<P's announced address>___...``). kvpush's P and D
announce themselves as vLLM's connectors do (``proxy_ip``,
``proxy_ping_port``, ``http_port``). Greedy outputs equal a plain server's,
D's counters show every prompt token came by transfer, D registered while
P was still computing (P's timeline), and nothing is held afterwards.

This module starts its own P and D (the announcement is part of their
configuration) and shares the session's plain server.
"""

from __future__ import annotations

import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_cluster import E2EServers
from test_e2e_vllm import _metric, _post, _stream_text

from kvpush.timeline import parse_lines
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.tiny_model import prompt_words

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
LENGTHS = [40, 700, 1500, 2000]


class Stack:
    def __init__(self, model: str, single: str, p: srv.ServerProcess, d: str, router: str) -> None:
        self.model, self.single, self.p_proc, self.d, self.router = model, single, p, d, router
        self.p = p.url

    def complete(self, base: str, prompt: str) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return _post(base + "/v1/completions", body)["choices"][0]["text"]


def announcing(role: str, kv_port: int, http_port: int, discovery: int, keys: str) -> dict[str, object]:
    # vllm-router's concurrent mode carries no capability (nobody holds the P fleet's key there): P accepts
    # registrations without one (docs/security.md, "Routers that cannot pass it").
    extra = {"proxy_ip": "127.0.0.1", "proxy_ping_port": discovery, "http_port": http_port, "capability": "optional"}
    return srv.kvpush_transfer_config(role, kv_port, auth_keys_dir=keys, **extra)


@pytest.fixture(scope="module")
def stack(e2e_pair: E2EServers, e2e_single: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("concurrent")
    p_port, d_port, kv_port, discovery, r_port, prom = (srv.free_port() for _ in range(6))
    debug = {"KVPUSH_LOG_LEVEL": "DEBUG"}  # P's transfer timeline
    keys = srv.temp_keys()
    p = srv.vllm_server(
        "prefill-announcing",
        e2e_pair.model,
        p_port,
        log_dir=logs,
        cpus=e2e_pair.cpus_p,
        kv_transfer_config=announcing("kv_producer", kv_port, p_port, discovery, keys),
        check_ports=(kv_port,),
        env=debug,
        fast_start=True,
    )
    d = srv.vllm_server(
        "decode-announcing",
        e2e_pair.model,
        d_port,
        log_dir=logs,
        cpus=e2e_pair.cpus_d,
        kv_transfer_config=announcing("kv_consumer", 0, d_port, discovery, keys),
        fast_start=True,
    )
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--kv-connector", "moriio"]
    cmd += ["--vllm-discovery-address", f"127.0.0.1:{discovery}", "--host", "127.0.0.1", "--port", str(r_port)]
    cmd += ["--prometheus-port", str(prom), "--policy", "round_robin"]
    router = srv.ServerProcess(
        name="vllm-router-discovery",
        cmd=cmd,
        url=f"http://127.0.0.1:{r_port}",
        log_path=Path(logs) / "vllm-router.log",
        ports=(r_port, prom, discovery),
    )
    try:
        router.start()
        p.start()
        d.start()
        srv.wait_all_healthy([p, d, router], timeout=900)
        s = Stack(e2e_pair.model, e2e_single, p, d.url, router.url)
        wait_registered(s)
        yield s
    except srv.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        srv.stop_all([router, p, d])


def wait_registered(s: Stack, timeout: float = 60.0) -> None:
    """Until the router has both instances from their announcements (it answers 503 before)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s.complete(s.router, "hello")
            return
        except urllib.error.HTTPError as exc:
            assert time.monotonic() < deadline, f"the router never saw P and D announce: {exc.read()[:300]!r}"
            time.sleep(1.0)


def test_concurrent_dispatch_outputs_equal_single_and_d_registers_while_p_computes(stack: Stack) -> None:
    s = stack
    prompts = [prompt_words(n, seed=700 + i) for i, n in enumerate(LENGTHS)]
    expected = [s.complete(s.single, p) for p in prompts]
    counts = ("vllm:prompt_tokens_by_source_total",)
    pushed0 = _metric(s.d, *counts, source="external_kv_transfer")
    computed0 = _metric(s.d, *counts, source="local_compute")
    got = [s.complete(s.router, p) for p in prompts[:-1]]
    body = {"model": s.model, "prompt": prompts[-1], "max_tokens": MAX_TOKENS, "temperature": 0}
    got.append(_stream_text(s.router + "/v1/completions", body))
    assert got == expected
    pushed = _metric(s.d, *counts, source="external_kv_transfer") - pushed0
    computed = _metric(s.d, *counts, source="local_compute") - computed0
    assert (pushed, computed) == (sum(LENGTHS), 0)
    # The overlap: D's registration reached P before P's prefill had finished, for some of these.
    records, _ = parse_lines(s.p_proc.log_path.read_text(errors="replace").splitlines())
    mine = [r["t"] for r in records if r["side"] == "prefill" and str(r["transfer_id"]).startswith("tx-")]
    assert len(mine) >= len(LENGTHS)
    ahead = [t for t in mine if "registered" in t and "prefill_done" in t and t["registered"] < t["prefill_done"]]
    assert ahead, "D never registered before P's prefill finished: the requests were not concurrent"
    deadline = time.monotonic() + 20
    while (usage := [_metric(u, "vllm:kv_cache_usage_perc") for u in (s.p, s.d)]) != [0.0, 0.0]:
        assert time.monotonic() < deadline, f"KV blocks still held: {usage}"
        time.sleep(0.25)
