"""End to end: kvpush's metrics on real vLLM servers' /metrics agree with what was transferred.

A small P/D pair behind the router (no single-instance server: outputs are
test_e2e_vllm's business). After a few requests of known prompt lengths, P's
and D's ``/metrics`` (vLLM's own Prometheus endpoint, fed through the
connector's stats hooks) must count exactly those transfers and exactly the
bytes the layout implies, computed here from the model's config (vLLM's CPU
cache moves whole blocks); the router's ``/metrics`` must count the requests;
and the servers' debug logs must join into one timeline per request.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush import timeline
from kvpush.demo import servers as srv
from kvpush.demo.tiny_model import make_tiny_model, prompt_words
from kvpush.metrics import P_STAGES, sample_sum

pytestmark = pytest.mark.e2e

BLOCK = srv.DEFAULT_BLOCK_SIZE
LENGTHS = [7, 64, 250, 777]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


class Pair:
    def __init__(self, model: str, p: str, d: str, router: str, logs: Path) -> None:
        self.model, self.p, self.d, self.router, self.logs = model, p, d, router, logs

    def metric(self, base: str, name: str, **labels: str) -> float:
        return sample_sum(_get(base + "/metrics"), name, **labels)

    def wait_metric(self, base: str, name: str, want: float, timeout: float = 60.0, **labels: str) -> float:
        """vLLM ships connector stats with its step outputs: poll until the value settles at ``want``."""
        deadline = time.monotonic() + timeout
        got = self.metric(base, name, **labels)
        while got != want and time.monotonic() < deadline:
            time.sleep(0.5)
            got = self.metric(base, name, **labels)
        return got


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = Path(os.environ.get("KVPUSH_MODEL_DIR", Path(__file__).resolve().parents[1] / "models"))
    model = str(make_tiny_model(root / "tiny-qwen3"))
    logs = tmp_path_factory.mktemp("e2e-metrics-logs")
    p_port, d_port, router_port, kv_port = (srv.free_port() for _ in range(4))
    cpus_p, cpus_d = ("0", "1") if (os.cpu_count() or 1) > 1 else ("0", "0")
    debug = {"KVPUSH_LOG_LEVEL": "DEBUG"}  # the per-transfer timeline lines
    servers = [
        srv.vllm_server(
            "prefill",
            model,
            p_port,
            log_dir=logs,
            cpus=cpus_p,
            kv_transfer_config=srv.kvpush_transfer_config("kv_producer", kv_port),
            check_ports=(kv_port,),
            env=debug,
            fast_start=True,
        ),
        srv.vllm_server(
            "decode",
            model,
            d_port,
            log_dir=logs,
            cpus=cpus_d,
            kv_transfer_config=srv.kvpush_transfer_config("kv_consumer", 0),
            env=debug,
            fast_start=True,
        ),
    ]
    router = srv.router_server(
        ["--prefill", servers[0].url, "--prefill-kv", f"127.0.0.1:{kv_port}", "--decode", servers[1].url],
        router_port,
        log_dir=logs,
    )
    try:
        for s in servers:
            s.start()
        srv.wait_all_healthy(servers, timeout=900, progress=print)
        router.start()
        srv.wait_all_healthy([router], timeout=60)
        yield Pair(model, servers[0].url, servers[1].url, router.url, logs)
    except srv.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        srv.stop_all([*servers, router])


def _bytes_per_block(model_dir: str) -> int:
    """Whole-block KV bytes of the model, from its config (not from kvpush's layout code)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.get("dtype") or cfg["torch_dtype"]]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return BLOCK * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * itemsize


def test_metrics_count_exactly_what_was_transferred(pair: Pair) -> None:
    sides: list[tuple[str, str]] = [(pair.p, "prefill"), (pair.d, "decode")]
    names = [
        "kvpush_transfers_total",
        "kvpush_transfer_bytes_total",
        "kvpush_transfer_latency_seconds_count",
        "kvpush_transfer_size_bytes_sum",
        "kvpush_transfer_plans_total",
        "kvpush_transfer_failures_total",
    ]
    before = {(b, n): pair.metric(b, n, side=s) for b, s in sides for n in names}
    ext0 = pair.metric(pair.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    routed0 = pair.metric(pair.router, "kvpush_router_request_seconds_count", stage="total")

    def one(i_n: tuple[int, int]) -> int:
        i, n = i_n
        body = {"model": pair.model, "prompt": prompt_words(n, seed=9000 + i), "max_tokens": 4, "temperature": 0}
        return int(_post(pair.router + "/v1/completions", body)["usage"]["prompt_tokens"])

    with cf.ThreadPoolExecutor(2) as ex:
        tokens = list(ex.map(one, enumerate(LENGTHS)))
    assert tokens == LENGTHS
    want_bytes = sum(-(-n // BLOCK) for n in tokens) * _bytes_per_block(pair.model)

    def delta(base: str, side: str, name: str, want: float, **labels: str) -> float:
        got = pair.wait_metric(base, name, before.get((base, name), 0.0) + want, side=side, **labels)
        return got - before.get((base, name), 0.0)

    for base, side in sides:
        assert delta(base, side, "kvpush_transfers_total", len(LENGTHS), outcome="ok") == len(LENGTHS), side
        assert delta(base, side, "kvpush_transfer_bytes_total", want_bytes) == want_bytes, side
        assert delta(base, side, "kvpush_transfer_size_bytes_sum", want_bytes) == want_bytes, side
        assert delta(base, side, "kvpush_transfer_latency_seconds_count", len(LENGTHS)) == len(LENGTHS), side
        assert delta(base, side, "kvpush_transfer_plans_total", len(LENGTHS)) == len(LENGTHS), side
        assert (
            pair.metric(base, "kvpush_transfer_failures_total", side=side)
            == before[(base, "kvpush_transfer_failures_total")]
        )
        assert pair.metric(base, "kvpush_engine_loop_iterations_total", side=side) > 0, side
    # The layout gauge says the same bytes per block as the model config.
    assert pair.metric(pair.p, "kvpush_kv_bytes_per_block", side="prefill") == _bytes_per_block(pair.model)
    for stage in P_STAGES:
        assert pair.metric(pair.p, "kvpush_transfer_stage_seconds_count", side="prefill", stage=stage) >= len(LENGTHS)
    # Nothing is left waiting once every request is answered.
    assert pair.wait_metric(pair.p, "kvpush_parked_prefills", 0, side="prefill") == 0
    assert pair.wait_metric(pair.d, "kvpush_pending_registrations", 0, side="decode") == 0
    # vLLM's own count agrees: every prompt token reached D through kvpush.
    ext = pair.metric(pair.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - ext0
    assert ext == sum(tokens)
    routed = pair.metric(pair.router, "kvpush_router_request_seconds_count", stage="total") - routed0
    assert routed == len(LENGTHS)
    assert pair.metric(pair.router, "kvpush_router_failures_total") == 0


def test_server_logs_join_into_timelines(pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both servers ran with KVPUSH_LOG_LEVEL=DEBUG: every transfer has a P and a D line that join."""
    body = {"model": pair.model, "prompt": prompt_words(300, seed=424242), "max_tokens": 2, "temperature": 0}
    _post(pair.router + "/v1/completions", body)
    p_log, d_log = pair.logs / "prefill.log", pair.logs / "decode.log"
    routed = int(pair.metric(pair.router, "kvpush_router_request_seconds_count", stage="total"))

    def read(path: Path) -> list[dict[str, Any]]:
        return timeline.parse_lines(path.read_text().splitlines())[0]

    deadline = time.monotonic() + 30
    while (len(read(p_log)) < routed or len(read(d_log)) < routed) and time.monotonic() < deadline:
        time.sleep(0.5)
    png = tmp_path / "waterfall.png"
    assert timeline.main([str(p_log), str(d_log), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    print(out)  # the table, for whoever runs this with -s
    assert f"{routed} transfers joined (0 failed); 0 only in P's log, 0 only in D's log" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    joined, _, _ = timeline.join(read(p_log) + read(d_log))
    for j in joined:
        assert j.ok and j.bytes % _bytes_per_block(pair.model) == 0
        assert timeline.TOTAL.seconds(j) is not None and timeline.TOTAL.seconds(j) > 0
