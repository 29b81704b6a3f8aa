"""``kvpush bench layerwise``: the pure parts, on synthetic data (no servers).

Checked: the visit plan interleaves modes as claimed, prompts are shared
across modes, /metrics parsing and deltas, the summary's overheads and the
layer/request fraction, the JSON's shape and size, the table, the figure,
CLI parsing and dispatch, the refusal of a layer config this kvpush does
not know, and the stack life cycle shared with ``bench serve``/``idle``
(exit codes, cleanup, pausing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpush import cli
from kvpush_tools.bench import layerwise as lw
from kvpush_tools.bench import stacks

# --------------------------------------------------------------------------- #
# Plan
# --------------------------------------------------------------------------- #


def test_visit_plan_interleaves_modes_per_point_and_rotates() -> None:
    plan = lw.visit_plan(list(lw.MODES), 2, [256, 1024, 2048])
    assert len(plan) == 2 * 3 * 3
    assert plan[:3] == [(0, 256, "single"), (0, 256, "request"), (0, 256, "layer")]
    assert plan[3:6] == [(0, 1024, "request"), (0, 1024, "layer"), (0, 1024, "single")]
    for rep in range(2):
        for n in (256, 1024, 2048):
            assert sorted(m for r, k, m in plan if (r, k) == (rep, n)) == sorted(lw.MODES)
    # Each mode goes first equally often over the 6 points.
    firsts = [plan[i][2] for i in range(0, len(plan), 3)]
    assert {m: firsts.count(m) for m in lw.MODES} == {m: 2 for m in lw.MODES}


def test_prompt_seed_shared_by_modes_distinct_per_point() -> None:
    seeds = {lw.prompt_seed(0, rep, n) for rep in range(5) for n in lw.DEFAULT_LENGTHS}
    assert len(seeds) == 5 * len(lw.DEFAULT_LENGTHS)


def test_kv_bytes_per_token() -> None:
    shape = {"num_layers": 32, "num_kv_heads": 2, "head_dim": 128, "dtype": "float32"}
    assert lw.kv_bytes_per_token(shape) == 32 * 2 * 2 * 128 * 4
    assert lw.kv_bytes_per_token({**shape, "dtype": "bfloat16"}) == 32 * 2 * 2 * 128 * 2


# --------------------------------------------------------------------------- #
# /metrics
# --------------------------------------------------------------------------- #

METRICS_1 = """\
# HELP kvpush_transfer_latency_seconds Successful transfers.
# TYPE kvpush_transfer_latency_seconds histogram
kvpush_transfer_latency_seconds_bucket{engine="0",le="0.01",model_name="tiny-qwen3",side="prefill"} 1.0
kvpush_transfer_latency_seconds_count{engine="0",model_name="tiny-qwen3",side="prefill"} 2.0
kvpush_transfer_latency_seconds_sum{engine="0",model_name="tiny-qwen3",side="prefill"} 0.05
kvpush_transfer_stage_seconds_count{engine="0",model_name="tiny-qwen3",side="prefill",stage="completion"} 2.0
kvpush_transfer_stage_seconds_sum{engine="0",model_name="tiny-qwen3",side="prefill",stage="completion"} 0.04
kvpush_transfer_size_bytes_count{engine="0",model_name="tiny-qwen3",side="prefill"} 2.0
kvpush_transfer_size_bytes_sum{engine="0",model_name="tiny-qwen3",side="prefill"} 2097152.0
kvpush_transfers_total{engine="0",model_name="tiny-qwen3",outcome="ok",side="prefill"} 2.0
kvpush_transfer_parts_total{engine="0",model_name="tiny-qwen3",side="prefill"} 2.0
kvpush_layerwise_prefills_total{engine="0",model_name="tiny-qwen3",side="prefill"} 0.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny-qwen3"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny-qwen3"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-qwen3"} 9.0
"""
METRICS_2 = """\
kvpush_transfer_latency_seconds_count{engine="0",model_name="tiny-qwen3",side="prefill"} 3.0
kvpush_transfer_latency_seconds_sum{engine="0",model_name="tiny-qwen3",side="prefill"} 0.08
kvpush_transfer_stage_seconds_count{engine="0",model_name="tiny-qwen3",side="prefill",stage="completion"} 3.0
kvpush_transfer_stage_seconds_sum{engine="0",model_name="tiny-qwen3",side="prefill",stage="completion"} 0.065
kvpush_transfer_size_bytes_count{engine="0",model_name="tiny-qwen3",side="prefill"} 3.0
kvpush_transfer_size_bytes_sum{engine="0",model_name="tiny-qwen3",side="prefill"} 70254592.0
kvpush_transfers_total{engine="0",model_name="tiny-qwen3",outcome="ok",side="prefill"} 3.0
kvpush_transfer_parts_total{engine="0",model_name="tiny-qwen3",side="prefill"} 34.0
kvpush_layerwise_prefills_total{engine="0",model_name="tiny-qwen3",side="prefill"} 1.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny-qwen3"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny-qwen3"} 1.75
"""


def test_parse_histograms_keeps_sum_and_count_drops_vllm_labels() -> None:
    h = lw.parse_histograms(METRICS_1)
    assert h["kvpush_transfer_latency_seconds|side=prefill"] == [0.05, 2.0]
    assert h["kvpush_transfer_stage_seconds|side=prefill,stage=completion"] == [0.04, 2.0]
    assert h["vllm:request_prefill_time_seconds|"] == [1.0, 2.0]
    assert not any(k.startswith("kvpush_transfers_total") for k in h)  # a counter not asked for
    assert h["kvpush_transfer_parts_total|side=prefill"] == [2.0, 2.0]  # a counter that is
    assert not any(k.startswith("vllm:time_to_first_token") for k in h)  # not asked for


def test_delta_and_transfer_fields_of_one_request() -> None:
    d = lw.histogram_delta(lw.parse_histograms(METRICS_1), lw.parse_histograms(METRICS_2))
    assert d["kvpush_transfer_latency_seconds|side=prefill"] == [pytest.approx(0.03), 1]
    f = lw.transfer_fields(d, {})
    assert f["p_transfer_ms"] == pytest.approx(30.0)
    assert f["size_mib"] == pytest.approx(65.0)
    assert f["p_prefill_ms"] == pytest.approx(750.0)
    assert f["stages_ms"] == {"p_completion": pytest.approx(25.0)}
    assert f["p_parts"] == 32 and f["p_layerwise"] == 1
    assert "d_transfer_ms" not in f
    assert lw.histogram_delta(lw.parse_histograms(METRICS_1), lw.parse_histograms(METRICS_1)) == {}


# --------------------------------------------------------------------------- #
# Summary, JSON, table, figure
# --------------------------------------------------------------------------- #

TTFT = {"single": 1000.0, "request": 1100.0, "layer": 1020.0}


def synthetic_records(reps: int = 3, lengths: tuple[int, ...] = (256, 1024)) -> list[dict[str, Any]]:
    """TTFT = base * length/256 + rep noise; kvpush modes with push numbers."""
    out = []
    for rep, n, mode in lw.visit_plan(list(lw.MODES), reps, lengths):
        scale = n / 256
        r: dict[str, Any] = {"mode": mode, "rep": rep, "length": n, "ok": True}
        r["ttft_ms"] = TTFT[mode] * scale + 10 * rep
        r["p_prefill_ms"] = 900.0 * scale + 10 * rep  # prefill carries the noise
        if mode != "single":
            r["p_transfer_ms"] = (90.0 if mode == "request" else 40.0) * scale
            r["size_mib"] = 16.0 * scale
            r["stages_ms"] = {"p_completion": 30.0 * scale, "d_transfer": 950.0 * scale}
        out.append(r)
    return out


def test_summary_overheads_and_layer_fraction() -> None:
    s = lw.summarize(synthetic_records(), list(lw.MODES), [256, 1024])["points"]
    p = s["256"]
    assert p["single"]["median_ttft_ms"] == 1010.0  # reps add 0, 10, 20
    assert p["request"]["overhead_ms"] == pytest.approx(100.0)
    assert p["layer"]["overhead_ms"] == pytest.approx(20.0)
    assert p["layer"]["overhead_paired_ms"] == pytest.approx(20.0)
    assert p["layer_fraction"] == pytest.approx(0.2)
    # Net of P's prefill time: single 100, request 200, layer 120 after the prefill.
    assert p["single"]["median_after_prefill_ms"] == pytest.approx(100.0)
    assert p["request"]["overhead_net_ms"] == pytest.approx(100.0)
    assert p["layer_fraction_net"] == pytest.approx(0.2)
    assert s["1024"]["layer_fraction"] == pytest.approx(0.2)
    assert s["1024"]["request"]["median_p_transfer_ms"] == pytest.approx(360.0)
    assert s["1024"]["request"]["median_stages_ms"]["p_completion"] == pytest.approx(120.0)
    assert "overhead_ms" not in p["single"]
    assert p["single"]["n"] == 3 and p["single"]["failed"] == 0
    assert (p["single"]["p25_ttft_ms"], p["single"]["p75_ttft_ms"]) == (1005.0, 1015.0)
    assert (p["single"]["min_ttft_ms"], p["single"]["max_ttft_ms"]) == (1000.0, 1020.0)


def test_summary_counts_failures_and_survives_missing_modes() -> None:
    recs = synthetic_records(reps=2, lengths=(256,))
    for r in recs:
        if r["mode"] == "request" and r["rep"] == 0:
            r.update(ok=False, ttft_ms=None, error="HTTP 503")
    s = lw.summarize(recs, ["single", "request"], [256])["points"]["256"]
    assert s["request"]["failed"] == 1 and s["request"]["n"] == 2
    assert s["request"]["median_ttft_ms"] == pytest.approx(1110.0)
    assert "layer_fraction" not in s
    # No single at all: no overheads, no crash.
    s2 = lw.summarize([r for r in recs if r["mode"] != "single"], ["request"], [256])["points"]["256"]
    assert "overhead_ms" not in s2["request"]


def test_layer_fraction_undefined_without_request_overhead() -> None:
    recs = [r for r in synthetic_records(1, (256,))]
    for r in recs:
        if r["mode"] == "request":
            r["ttft_ms"] = 990.0  # faster than single: no overhead to take a fraction of
    assert lw.summarize(recs, list(lw.MODES), [256])["points"]["256"]["layer_fraction"] is None


def synthetic_doc(reps: int = 5) -> dict[str, Any]:
    lengths = list(lw.DEFAULT_LENGTHS)
    recs = synthetic_records(reps, tuple(lengths))
    return {
        "modes": list(lw.MODES),
        "lengths": lengths,
        "reps": reps,
        "model": {"shape": lw.MODEL_SHAPE, "kv_bytes_per_token": lw.kv_bytes_per_token(lw.MODEL_SHAPE)},
        "requests": recs,
        "summary": lw.summarize(recs, list(lw.MODES), lengths),
    }


def test_json_shape_and_size(tmp_path: Path) -> None:
    doc = synthetic_doc(reps=8)
    text = json.dumps(doc, indent=1)
    assert len(text) < 100 * 1024
    back = json.loads(text)
    assert set(back["summary"]["points"]) == {str(n) for n in lw.DEFAULT_LENGTHS}
    for row in back["summary"]["points"].values():
        assert set(lw.MODES) <= set(row) and "layer_fraction" in row
    # --report recomputes the summary from the requests and redraws.
    (tmp_path / "layerwise.json").write_text(text)
    assert lw.report(tmp_path, plot_it=False) == 0
    assert json.loads((tmp_path / "layerwise.json").read_text())["summary"] == back["summary"]


def test_table_lists_every_length_and_ratio() -> None:
    t = lw.table(synthetic_doc())
    lines = t.splitlines()
    assert "single TTFT" in lines[0] and "layer/req" in lines[0] and "net l/r" in lines[0]
    assert sum(1 for line in lines if line.strip().split(" ")[0] in {str(n) for n in lw.DEFAULT_LENGTHS}) == 4
    assert "0.20" in t
    assert "FAILED" not in t


def test_table_without_layer_mode() -> None:
    doc = synthetic_doc()
    doc["modes"] = ["single", "request"]
    doc["summary"] = lw.summarize(doc["requests"], doc["modes"], doc["lengths"])
    t = lw.table(doc)
    assert "layer/req" not in t.splitlines()[0] and "request ovh" in t


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = lw.plot(synthetic_doc(), tmp_path / "layerwise.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


def test_parse_args_defaults_size_the_servers() -> None:
    a = lw.parse_args([])
    assert a.modes == list(lw.MODES) and a.lengths == list(lw.DEFAULT_LENGTHS)
    assert a.max_tokens == 4 and a.reps == lw.DEFAULT_REPS
    assert a.layer_extra == {
        "layerwise": True,
        "layerwise_min_tokens": 0,
        "layerwise_min_part_bytes": 0,
        "layerwise_lead_layers": 1000,
    }
    assert a.max_model_len >= max(lw.DEFAULT_LENGTHS) + 4 and a.max_model_len % 512 == 0
    # Two longest requests fit in each server's KV cache.
    assert a.kv_cache_mib * 2**20 >= 2 * a.max_model_len * lw.kv_bytes_per_token(lw.MODEL_SHAPE)
    opts = stacks.stack_options(a, max_model_len=a.max_model_len)
    assert opts.p_cpus == "0" and opts.d_cpus == "1" and opts.kvpush_extra is None


def test_parse_args_choices_and_errors() -> None:
    a = lw.parse_args(["--modes", "single,request", "--lengths", "128,512", "--reps", "2", "--kv-cache-mib", "600"])
    assert a.modes == ["single", "request"] and a.lengths == [128, 512] and a.reps == 2 and a.kv_cache_mib == 600
    assert a.max_model_len == 1024
    for bad in (
        ["--modes", "single,bogus"],
        ["--modes", "single,single"],
        ["--reps", "0"],
        ["--lengths", "0"],
        ["--layer-config", "[1]"],
        ["--lengths", "4096", "--max-model-len", "4096"],
    ):
        with pytest.raises(SystemExit) as e:
            lw.parse_args(bad)
        assert e.value.code == 2


def test_cli_dispatches_bench_layerwise(capsys: pytest.CaptureFixture[str]) -> None:
    assert "layerwise" in cli.BENCH
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "layerwise", "--help"])
    assert e.value.code == 0
    assert "--layer-config" in capsys.readouterr().out


def test_layer_config_is_checked_against_this_kvpush() -> None:
    assert lw.check_layer_config({"nixl_backends": ["UCX"]}) is None
    assert "no_such_key" in (lw.check_layer_config({"no_such_key": True}) or "")


def test_build_gives_each_mode_its_own_stack(tmp_path: Path) -> None:
    opts = stacks.StackOptions(kv_cache_bytes=600 << 20, max_model_len=4608, kvpush_extra={"idle_poll_max_s": 0.05})
    st = lw.build(list(lw.MODES), tmp_path / "model", tmp_path / "logs", opts, {"layerwise": True})
    single, req, lay = st["single"], st["request"], st["layer"]
    assert single.decode is None and single.router is None and single.url == single.prefill.url  # type: ignore[union-attr]
    assert single.prefill is not None and "--kv-transfer-config" not in single.prefill.cmd
    assert single.prefill.cpu_affinity == frozenset({0})
    for s in (req, lay):
        assert s.router is not None and s.decode is not None and s.decode.cpu_affinity == frozenset({1})
        assert "4608" in s.prefill.cmd  # type: ignore[union-attr]
    extra = req.info["prefill_kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {
        "side_channel_port": extra["side_channel_port"],
        "nixl_backends": ["UCX"],
        "idle_poll_max_s": 0.05,
        "auth_keys_dir": extra["auth_keys_dir"],  # the stack's own key set: auth is on by default
    }
    assert Path(extra["auth_keys_dir"]).is_dir()
    for side in ("prefill_kv_transfer_config", "decode_kv_transfer_config"):
        assert lay.info[side]["kv_connector_extra_config"]["layerwise"] is True
        assert "layerwise" not in req.info[side]["kv_connector_extra_config"]
    # Distinct names, logs and ports.
    assert {s.mode for s in st.values()} == set(lw.MODES)
    assert len({s.info["log_dir"] for s in st.values()}) == 3
    assert req.prefill.url != lay.prefill.url  # type: ignore[union-attr]


# --------------------------------------------------------------------------- #
# The shared stack life cycle (stacks.py), without servers
# --------------------------------------------------------------------------- #


def test_run_with_stacks_exit_codes_and_always_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from kvpush_tools.demo.servers import ServerError

    stopped: list[list[str]] = []
    monkeypatch.setattr(stacks, "stop_stacks", lambda sts: stopped.append([s.mode for s in sts]))
    sts = {"a": stacks.Stack("a", "http://x"), "b": stacks.Stack("b", "http://y")}
    said: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    def boom(exc: BaseException) -> Any:
        def body() -> None:
            raise exc

        return body

    assert stacks.run_with_stacks(sts, lambda: None, said.append) == 0
    assert stacks.run_with_stacks(sts, lambda: 1, said.append) == 1
    assert stacks.run_with_stacks(sts, boom(ServerError("P died")), said.append) == 2
    assert stacks.run_with_stacks(sts, boom(KeyboardInterrupt()), said.append) == 130
    assert stopped == [["a", "b"]] * 4
    assert any("P died" in m for m in said) and any("interrupted" in m for m in said)
    assert signal.getsignal(signal.SIGTERM) == before


def test_activate_pauses_the_others_and_pause_skips_unstarted_stacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    a = stacks.build_stack("kvpush", "m", tmp_path, name="a")
    b = stacks.build_stack(stacks.SINGLE, "m", tmp_path)
    b.pause()  # not started: nothing to stop, and not marked paused (a later start must pause it for real)
    assert not b.paused
    calls: list[str] = []
    monkeypatch.setattr(stacks.Stack, "pause", lambda self: calls.append("pause " + self.mode))
    monkeypatch.setattr(stacks.Stack, "resume", lambda self: calls.append("resume " + self.mode))
    monkeypatch.setattr(stacks.Stack, "wait_healthy", lambda self, timeout=60.0: calls.append("health " + self.mode))
    stacks.activate({"a": a, "b": b}, b)
    assert calls == ["pause a", "resume single", "health single"]
