"""kvpush.observability.metrics: stage arithmetic, failure causes, merging, Prometheus names and export.

The pure part is driven with hand-built Results whose numbers are known; the
last tests push real transfers through an in-process P/D pair over NIXL and
check the metrics against what was moved, and feed vLLM's own Prometheus
metric classes (a private registry) through the connector's hooks.
"""

from __future__ import annotations

import pickle
import re
import time
from types import SimpleNamespace

import msgspec
import pytest
from helpers_local_pair import TOKEN_BYTES, local_pair
from helpers_prometheus import parse_samples, sample_sum

from kvpush.core.outcome import Cause, PlanKind, PushStats, PushTimes, ReceiveStats, ReceiveTimes, Result
from kvpush.observability.metrics import (
    CAUSES,
    D_STAGES,
    P_STAGES,
    Recorder,
    TransferStats,
    layout_gauges,
    stage_durations,
    take_engine,
    transfer_latency,
)
from kvpush.observability.prometheus import METRICS, PromFeed, TextExposition


def p_result(tid: str = "t", *, prefill_done: float = 100.0, registered: float = 100.05, ok: bool = True) -> Result:
    """A P result whose stages are known: push starts 1 ms after the later half, 6 ms of stages, 20 ms WRITE."""
    start = max(prefill_done, registered) + 0.001
    times = PushTimes(
        prefill_done=prefill_done,
        registered=registered,
        push_start=start,
        ready=start + 0.001,
        planned=start + 0.003,
        packed=start + 0.004,
        posted=start + 0.006,
        completed=start + 0.026,
        released=start + 0.027,
    )
    stats = PushStats(
        wait_ready_s=0.001,
        plan_s=0.002,
        pack_s=0.001,
        post_s=0.002,
        complete_s=0.020,
        bytes=4096,
        pieces=8,
        descriptors=2,
        plan=PlanKind.DIRECT,
    )
    reason, cause = ("", None) if ok else ("lease expired: no registration arrived", Cause.EXPIRED)
    return Result(tid, f"p-{tid}", ok, reason, cause, stats=stats, times=times)


def d_result(tid: str = "t", ok: bool = True, reason: str = "", cause: Cause | None = None) -> Result:
    times = ReceiveTimes(registered=50.0, sent=50.004, completed=50.104, result=50.105)
    stats = ReceiveStats(bytes=4096, descriptors=2, plan=PlanKind.DIRECT, latency_s=0.105)
    return Result(tid, f"d-{tid}", ok, reason, cause, stats=stats if ok else ReceiveStats(latency_s=0.105), times=times)


# -- stage arithmetic ---------------------------------------------------------------


def test_prefill_stages_when_registration_comes_late() -> None:
    st = stage_durations("prefill", p_result(prefill_done=100.0, registered=100.05))
    assert set(st) == set(P_STAGES)
    assert st["registration_wait"] == pytest.approx(0.05)  # the prefill waited for D
    assert st["rendezvous_wait"] == pytest.approx(0.001)
    assert st["completion"] == pytest.approx(0.020)
    assert transfer_latency("prefill", p_result()) == pytest.approx(0.026)


def test_prefill_stages_when_prefill_comes_late() -> None:
    st = stage_durations("prefill", p_result(prefill_done=100.2, registered=100.0))
    assert st["registration_wait"] == 0.0
    assert st["rendezvous_wait"] == pytest.approx(0.201)  # D's registration waited for P's prefill


def test_decode_stages() -> None:
    st = stage_durations("decode", d_result())
    assert set(st) <= set(D_STAGES)
    assert st["handshake"] == pytest.approx(0.004)
    assert st["transfer"] == pytest.approx(0.100)
    assert transfer_latency("decode", d_result()) == pytest.approx(0.105)


def test_causes_are_the_typed_set() -> None:
    """The failure label set is ``Cause``'s, and a failed Result is counted under its own cause."""
    assert set(CAUSES) == {c.value for c in Cause}
    for cause in Cause:
        s = TransferStats()
        s.add_result("decode", d_result("x", ok=False, reason="any words at all", cause=cause))
        assert s.data["counts"]["decode"] == {"transfers_failed": 1.0, f"cause:{cause.value}": 1.0}


# -- merging --------------------------------------------------------------------------


def _stats(side: str, rank: int, results: list[Result], pending: float) -> TransferStats:
    s = TransferStats()
    for r in results:
        s.add_result(side, r)
    s.add_counts(side, {"loop_iterations": 10.0})
    s.set_gauges(f"{side}:{rank}", {"pending_registrations": pending})
    return s


def test_merging_workers_sums_and_keeps_gauges_per_rank() -> None:
    a = _stats("prefill", 0, [p_result("a")], 2)
    b = _stats("prefill", 1, [p_result("b"), p_result("c", ok=False)], 3)
    a.aggregate(b)
    cnt = a.data["counts"]["prefill"]
    assert cnt["transfers_ok"] == 2 and cnt["transfers_failed"] == 1 and cnt["cause:expired"] == 1
    assert cnt["bytes"] == 8192 and cnt["plan:direct"] == 2 and cnt["loop_iterations"] == 20
    assert len(a.data["obs"]["prefill"]["latency"]) == 2
    assert a.data["gauges"] == {
        "prefill:0": {"pending_registrations": 2.0},
        "prefill:1": {"pending_registrations": 3.0},
    }
    # A later step of rank 0: its gauge replaces the old one, rank 1's stays.
    a.aggregate(_stats("prefill", 0, [], 0))
    assert a.data["gauges"]["prefill:0"] == {"pending_registrations": 0.0}
    assert a.data["gauges"]["prefill:1"] == {"pending_registrations": 3.0}


def test_merging_is_associative_and_survives_serialisation() -> None:
    parts = [_stats("decode", i, [d_result(str(i))], i) for i in range(3)]

    def fold(order: list[int]) -> TransferStats:
        acc = TransferStats(msgspec.msgpack.decode(msgspec.msgpack.encode(parts[order[0]].data)))
        for i in order[1:]:
            acc.aggregate(pickle.loads(pickle.dumps(parts[i])))
        return acc

    left, right = fold([0, 1, 2]), TransferStats(parts[0].data).aggregate(fold([1, 2]))
    assert left.data["counts"] == right.data["counts"]
    assert sorted(left.data["obs"]["decode"]["latency"]) == sorted(right.data["obs"]["decode"]["latency"])
    assert left.data["gauges"] == right.data["gauges"]


def test_is_empty_ignores_gauges_and_idle_loops() -> None:
    idle = _stats("prefill", 0, [], 1)
    assert idle.is_empty()
    assert not _stats("prefill", 0, [p_result()], 0).is_empty()
    aborted = TransferStats()
    aborted.add_counts("decode", {"aborts": 1})
    assert not aborted.is_empty()


def test_reduce_summarises_both_sides() -> None:
    s = _stats("prefill", 0, [p_result("a"), p_result("b", ok=False)], 0).aggregate(
        _stats("decode", 0, [d_result("a")], 0)
    )
    r = s.reduce()
    assert r["P transfers ok"] == 1 and r["P failed"] == 1 and r["P cause:expired"] == 1
    assert r["D transfers ok"] == 1 and r["D median latency (ms)"] == pytest.approx(105.0)


def test_recorder_turns_counters_into_increments() -> None:
    rec = Recorder("decode")
    rec.observe(d_result("x", ok=False, reason="no KV from P within 60s", cause=Cause.EXPIRED))
    assert rec.results_pending == 1
    # D counts an expiry as an expiration only (its abort to P is not counted again).
    first = rec.take(
        {"aborts_total": 0, "expired_total": 1, "registrations_total": 4}, 100, 3, {}, "decode:0", now=10.0
    )
    cnt = first.data["counts"]["decode"]
    # The expiry also counted as an abort on D: reported once, as an expiration.
    assert cnt["expirations"] == 1 and "aborts" not in cnt
    assert cnt["registrations"] == 4 and cnt["loop_iterations"] == 100 and cnt["cause:expired"] == 1
    assert rec.results_pending == 0
    second = rec.take(
        {"aborts_total": 2, "expired_total": 1, "registrations_total": 4}, 150, 3, {}, "decode:0", now=12.0
    )
    cnt = second.data["counts"]["decode"]
    assert cnt == {"aborts": 2.0, "loop_iterations": 50.0}
    assert second.data["gauges"]["decode:0"]["loop_rate"] == pytest.approx(25.0)


def test_d_quarantines_reach_the_metrics() -> None:
    """What D withholds from vLLM for writers that may still write: the overdue count and the blocks held."""
    rec = Recorder("decode")
    counts = {"quarantines_total": 1, "quarantines_overdue_total": 1}
    stats = rec.take(counts, 10, 0, {"quarantined_blocks": 7.0}, "decode:0", now=1.0)
    assert stats.data["counts"]["decode"]["quarantines_overdue"] == 1
    assert stats.data["gauges"]["decode:0"]["quarantined_blocks"] == 7.0
    page = TextExposition()
    page.apply(PromFeed().updates(stats.data))
    text = page.render()
    assert sample_sum(text, "kvpush_quarantines_overdue_total", side="decode") == 1
    assert sample_sum(text, "kvpush_quarantines_total", side="decode") == 1
    assert sample_sum(text, "kvpush_quarantined_blocks", side="decode") == 7


# -- Prometheus ---------------------------------------------------------------------


def test_metric_names_follow_prometheus_conventions() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert re.fullmatch(r"kvpush_[a-z0-9_]+", m.name), m.name
        assert m.help and m.labels[0] == "side"
        if m.kind == "counter":
            assert m.name.endswith("_total"), m.name
        else:
            assert not m.name.endswith("_total"), m.name
        if m.kind == "histogram":
            assert list(m.buckets) == sorted(m.buckets) and m.buckets
        if "latency" in m.name or "stage" in m.name:
            assert m.name.endswith("_seconds")
        if "size" in m.name:
            assert m.name.endswith("_bytes")
    required = {
        "kvpush_transfer_latency_seconds",
        "kvpush_transfer_stage_seconds",
        "kvpush_transfer_size_bytes",
        "kvpush_transfer_descriptors",
        "kvpush_transfer_plans_total",
        "kvpush_pending_registrations",
        "kvpush_parked_prefills",
        "kvpush_expirations_total",
        "kvpush_aborts_total",
        "kvpush_transfer_failures_total",
        "kvpush_engine_loop_iterations_per_second",
    }
    assert required <= set(names)


def test_metrics_are_exported_under_vllms_names_and_the_old_ones() -> None:
    """vLLM's scheme (``vllm:kvpush_*``) so vLLM's dashboards find them; the bare names stay one release."""
    page = TextExposition()
    page.apply(PromFeed().updates(_stats("prefill", 0, [p_result()], 2).data))
    text = page.render()
    for m in METRICS:
        assert m.names == (f"vllm:{m.name}", m.name), m
        assert f"# TYPE vllm:{m.name} {m.kind}" in text and f"# TYPE {m.name} {m.kind}" in text, m.name
    for name in ("vllm:kvpush_transfers_total", "kvpush_transfers_total"):
        assert sample_sum(text, name, side="prefill", outcome="ok") == 1, name
        assert sample_sum(text, name.replace("transfers_total", "pending_registrations"), side="prefill") == 2


def test_feed_sums_gauges_over_ranks_even_from_partial_payloads() -> None:
    feed, page = PromFeed(), TextExposition()
    both = _stats("prefill", 0, [p_result()], 2).aggregate(_stats("prefill", 1, [], 3))
    page.apply(feed.updates(both.data))
    assert sample_sum(page.render(), "kvpush_pending_registrations", side="prefill") == 5
    page.apply(feed.updates(_stats("prefill", 1, [], 1).data))  # only rank 1 reported this time
    text = page.render()
    assert sample_sum(text, "kvpush_pending_registrations", side="prefill") == 3
    assert sample_sum(text, "kvpush_transfers_total", side="prefill", outcome="ok") == 1
    assert sample_sum(text, "kvpush_transfer_stage_seconds_count", side="prefill", stage="completion") == 1


def test_text_exposition_histograms_are_cumulative() -> None:
    page = TextExposition()
    for v in (0.0004, 0.003, 0.003, 7.0, 1000.0):
        page.observe("kvpush_transfer_latency_seconds", v, side="decode")
    samples = parse_samples(page.render())
    buckets = [(lab["le"], v) for n, lab, v in samples if n == "kvpush_transfer_latency_seconds_bucket"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1] == ("+Inf", 5.0)
    assert dict(buckets)["0.005"] == 3.0
    assert sample_sum(page.render(), "kvpush_transfer_latency_seconds_count") == 5
    with pytest.raises(ValueError, match="unknown labels"):
        page.inc("kvpush_transfers_total", colour="red")


def test_vllm_prometheus_hooks_export_kvpush_metrics() -> None:
    """The connector's classmethods build what vLLM's API server uses; feed them like vLLM does."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvpush.integrations.vllm.connector import KVPushConnector

    reg = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(
            cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(self, *a, registry=reg, **kw)}
        )

    prom = KVPushConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    # Two workers' step stats, merged as vLLM's output aggregator does, then shipped as a dict.
    w0 = KVPushConnector.build_kv_connector_stats(_stats("prefill", 0, [p_result("a")], 1).data)
    w1 = KVPushConnector.build_kv_connector_stats(_stats("prefill", 1, [p_result("b")], 2).data)
    merged = w0.aggregate(w1)
    # vLLM ships ``to_dict()`` where its stats class has it, the ``data`` field before.
    payload = merged.to_dict() if hasattr(merged, "to_dict") else merged.data
    assert not w0.is_empty() and w0.reduce()["P transfers ok"] == 2
    logged = KVPushConnector.build_kv_connector_stats(msgspec.msgpack.decode(msgspec.msgpack.encode(payload)))
    assert logged.reduce() == w0.reduce()
    prom.observe(payload, engine_idx=0)
    text = generate_latest(reg).decode()
    for m in METRICS:
        assert f"# TYPE {m.name} {m.kind}" in text, m.name
        assert f"# TYPE vllm:{m.name} {m.kind}" in text, m.name
    assert sample_sum(text, "kvpush_transfers_total", side="prefill", outcome="ok", engine="0") == 2
    assert sample_sum(text, "vllm:kvpush_transfers_total", side="prefill", outcome="ok", engine="0") == 2
    assert sample_sum(text, "kvpush_transfer_bytes_total", side="prefill", model_name="tiny") == 8192
    assert sample_sum(text, "kvpush_pending_registrations", side="prefill") == 3
    assert sample_sum(text, "kvpush_transfer_stage_seconds_count", side="prefill", stage="registration_wait") == 2


# -- real transfers ---------------------------------------------------------------------


def test_engine_metrics_match_what_was_pushed() -> None:
    lengths = [5, 40, 100]
    with local_pair() as pair:
        for i, n in enumerate(lengths):
            blocks = -(-n // 16)
            pair.push(f"t{i}", n, list(range(10 * i, 10 * i + blocks)), list(range(20 + 10 * i, 20 + 10 * i + blocks)))
        d_res = pair.wait(pair.receiver, 3)
        p_res = pair.wait(pair.sender, 3)
        assert all(r.ok for r in d_res + p_res)
        time.sleep(0.15)  # one engine timer period: gauges refreshed
        extra = layout_gauges(pair.layout)
        p, d = take_engine(pair.sender, 0, extra), take_engine(pair.receiver, 0)
        moved = sum(lengths) * TOKEN_BYTES  # host NHD layout: exactly the tokens, no block padding
        for side, s in (("prefill", p), ("decode", d)):
            cnt, obs = s.data["counts"][side], s.data["obs"][side]
            assert cnt["bytes"] == moved
            assert sorted(obs["bytes"]) == [n * TOKEN_BYTES for n in lengths]
            assert cnt["transfers_ok"] == 3 and cnt["registrations"] == 3
            assert sum(v for k, v in cnt.items() if k.startswith("plan:")) == 3
            assert len(obs["latency"]) == 3 and all(x >= 0 for x in obs["latency"])
            assert cnt["loop_iterations"] > 0
        for stage in P_STAGES:
            assert len(p.data["obs"]["prefill"][f"stage:{stage}"]) == 3, stage
        assert p.data["gauges"]["prefill:0"]["kv_bytes_per_token"] == TOKEN_BYTES
        assert p.data["gauges"]["prefill:0"]["parked_prefills"] == 0
        assert d.data["gauges"]["decode:0"]["pending_registrations"] == 0
        time.sleep(0.3)  # idle: the loop keeps polling at about 1 / idle_poll_max_s
        idle = take_engine(pair.receiver, 0)
        assert idle.is_empty()
        assert 5 < idle.data["gauges"]["decode:0"]["loop_rate"] < 2000


def test_engine_metrics_count_expiry_and_abort() -> None:
    """D registers for a prefill that never comes: D expires it, P is told to abort."""
    with local_pair(transfer_timeout_s=0.3) as pair:
        pair.push("lost", 20, [0, 1], [2, 3], prefill=False)
        (res,) = pair.wait(pair.receiver, 1)
        assert not res.ok
        deadline = time.monotonic() + 5
        while pair.sender.counters.get("aborts_total", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        d, p = take_engine(pair.receiver, 0), take_engine(pair.sender, 0)
    dc, pc = d.data["counts"]["decode"], p.data["counts"]["prefill"]
    assert dc["transfers_failed"] == 1 and dc["cause:expired"] == 1 and dc["expirations"] == 1
    assert "aborts" not in dc  # the expiry is not counted twice
    assert pc["aborts"] == 1
    assert not d.is_empty()
