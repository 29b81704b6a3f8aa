"""End to end: kvpush's metrics on real vLLM servers' /metrics agree with what was transferred.

The P/D pair behind the router that the session shares with test_e2e_vllm
(``conftest.py``, ``e2e_cluster.py``; no single-instance server is needed
here: outputs are test_e2e_vllm's business). After a few requests of known
prompt lengths, P's and D's ``/metrics`` (vLLM's own Prometheus endpoint,
fed through the connector's stats hooks) must count exactly those transfers
and exactly the bytes the layout implies, computed here from the model's
config (vLLM's CPU cache moves whole blocks); the router's ``/metrics`` must
count the requests; and the servers' debug logs must join into one timeline
per request.

Other tests may have used the servers first (and left, e.g., a failed
transfer of a fault case), so every count is a delta over this test's own
requests, and the timeline check joins the transfers this test made, picked
out by the transfer id the router returns as ``X-Request-Id``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import E2EServers
from helpers_prometheus import sample_sum

from kvpush.cli import timeline as timeline_cli
from kvpush.observability import timeline
from kvpush.observability.metrics import P_STAGES
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

BLOCK = srv.DEFAULT_BLOCK_SIZE
LENGTHS = [7, 64, 250, 777]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return _post_tid(url, body)[0]


def _post_tid(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The response and its ``X-Request-Id`` (through the router: the transfer id)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), r.headers.get("X-Request-Id", "")


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
def pair(e2e_pair: E2EServers) -> Pair:
    """The session's shared P/D pair and router, quiet and with every earlier transfer counted.

    vLLM ships connector stats with a step's outputs, so a transfer of an
    earlier test that ended without a later step (an abort, a failed fault
    case) may still be unreported. One request of our own makes both engines
    step; once both sides count it, any older stats are in, and the
    baselines the tests read are final.
    """
    pair = Pair(e2e_pair.model, e2e_pair.p, e2e_pair.d, e2e_pair.router_url, e2e_pair.logs)
    sides = [(pair.p, "prefill"), (pair.d, "decode")]
    ok0 = {side: pair.metric(base, "kvpush_transfers_total", side=side, outcome="ok") for base, side in sides}
    body = {"model": pair.model, "prompt": prompt_words(40, seed=31337), "max_tokens": 2, "temperature": 0}
    _post(pair.router + "/v1/completions", body)
    for base, side in sides:
        got = pair.wait_metric(base, "kvpush_transfers_total", ok0[side] + 1, side=side, outcome="ok")
        assert got == ok0[side] + 1, f"{side} did not count the warm-up transfer"
    return pair


def _bytes_per_block(model_dir: str) -> int:
    """Whole-block KV bytes of the model, from its config (not from kvpush's layout code)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[cfg.get("dtype") or cfg["torch_dtype"]]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return BLOCK * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * itemsize


def test_metrics_count_exactly_what_was_transferred(pair: Pair) -> None:
    sides: list[tuple[str, str]] = [(pair.p, "prefill"), (pair.d, "decode")]
    # (name, labels beyond side): each baseline is read with the labels its delta is read with
    # (transfers_total by outcome: failed transfers of earlier tests on these servers must not count).
    counted: list[tuple[str, dict[str, str]]] = [
        ("kvpush_transfers_total", {"outcome": "ok"}),
        ("kvpush_transfer_bytes_total", {}),
        ("kvpush_transfer_latency_seconds_count", {}),
        ("kvpush_transfer_size_bytes_sum", {}),
        ("kvpush_transfer_plans_total", {}),
        ("kvpush_transfer_failures_total", {}),
    ]

    def key(base: str, name: str, labels: dict[str, str]) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        return base, name, tuple(sorted(labels.items()))

    before = {key(b, n, lb): pair.metric(b, n, side=s, **lb) for b, s in sides for n, lb in counted}
    ext0 = pair.metric(pair.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    routed0 = pair.metric(pair.router, "kvpush_router_request_seconds_count", stage="total")
    router_failures0 = pair.metric(pair.router, "kvpush_router_failures_total")

    def one(i_n: tuple[int, int]) -> int:
        i, n = i_n
        body = {"model": pair.model, "prompt": prompt_words(n, seed=9000 + i), "max_tokens": 4, "temperature": 0}
        return int(_post(pair.router + "/v1/completions", body)["usage"]["prompt_tokens"])

    with cf.ThreadPoolExecutor(2) as ex:
        tokens = list(ex.map(one, enumerate(LENGTHS)))
    assert tokens == LENGTHS
    want_bytes = sum(-(-n // BLOCK) for n in tokens) * _bytes_per_block(pair.model)

    def delta(base: str, side: str, name: str, want: float, **labels: str) -> float:
        b0 = before[key(base, name, labels)]
        return pair.wait_metric(base, name, b0 + want, side=side, **labels) - b0

    for base, side in sides:
        assert delta(base, side, "kvpush_transfers_total", len(LENGTHS), outcome="ok") == len(LENGTHS), side
        assert delta(base, side, "kvpush_transfer_bytes_total", want_bytes) == want_bytes, side
        assert delta(base, side, "kvpush_transfer_size_bytes_sum", want_bytes) == want_bytes, side
        assert delta(base, side, "kvpush_transfer_latency_seconds_count", len(LENGTHS)) == len(LENGTHS), side
        assert delta(base, side, "kvpush_transfer_plans_total", len(LENGTHS)) == len(LENGTHS), side
        assert (
            pair.metric(base, "kvpush_transfer_failures_total", side=side)
            == before[key(base, "kvpush_transfer_failures_total", {})]
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
    assert pair.metric(pair.router, "kvpush_router_failures_total") == router_failures0


def test_server_logs_join_into_timelines(pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both servers run with KVPUSH_LOG_LEVEL=DEBUG: each of our transfers has one P and one D line, and they join.

    The logs also hold whatever other tests did with the shared servers, so
    the lines of this test's transfers (by transfer id) are copied out and
    ``kvpush timeline`` runs on those.
    """

    def one(i_n: tuple[int, int]) -> str:
        i, n = i_n
        body = {"model": pair.model, "prompt": prompt_words(n, seed=424242 + i), "max_tokens": 2, "temperature": 0}
        return _post_tid(pair.router + "/v1/completions", body)[1]

    with cf.ThreadPoolExecutor(2) as ex:
        tids = set(ex.map(one, enumerate([300, 90, 33])))
    assert len(tids) == 3 and "" not in tids, tids

    def ours(path: Path) -> list[str]:
        lines = path.read_text().splitlines()
        return [line for line in lines if any(r["transfer_id"] in tids for r in timeline.parse_lines([line])[0])]

    p_log, d_log = pair.logs / "prefill.log", pair.logs / "decode.log"
    deadline = time.monotonic() + 30
    while (len(ours(p_log)) < len(tids) or len(ours(d_log)) < len(tids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    p_ours, d_ours = tmp_path / "prefill.log", tmp_path / "decode.log"
    p_ours.write_text("\n".join(ours(p_log)) + "\n")
    d_ours.write_text("\n".join(ours(d_log)) + "\n")
    png = tmp_path / "waterfall.png"
    assert timeline_cli.main([str(p_ours), str(d_ours), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    print(out)  # the table, for whoever runs this with -s
    assert f"{len(tids)} transfers joined (0 failed); 0 only in P's log, 0 only in D's log" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    records = timeline.parse_lines(p_ours.read_text().splitlines() + d_ours.read_text().splitlines())[0]
    joined, _, _ = timeline.join(records)
    assert sorted(j.transfer_id for j in joined) == sorted(tids)
    for j in joined:
        assert j.p_ranks == 1, f"{j.transfer_id}: {j.p_ranks} P lines"
        assert j.ok and j.bytes % _bytes_per_block(pair.model) == 0
        assert timeline.TOTAL.seconds(j) is not None and timeline.TOTAL.seconds(j) > 0
