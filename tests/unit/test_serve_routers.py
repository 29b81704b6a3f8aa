"""``kvpush bench serve`` with the router as a dimension: the pure parts, no servers.

The cells (mode x router) and which combinations are refused or skipped,
their interleaving (every cell once per point per iteration, rotated), the
run files' names carrying the router, and the summary's per-router
kvpush/vllm-pull ratio with its per-iteration spread, from fake run records.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from kvpush_tools.bench import loadgen, plot_serve, serve_files, serve_summary
from kvpush_tools.bench.loadgen import RequestOutput
from kvpush_tools.bench.serve import choose_cells
from kvpush_tools.bench.serve_summary import Cell
from kvpush_tools.bench.serve_sweep import sweep_plan
from kvpush_tools.bench.stack_build import behind_vllm_router
from kvpush_tools.bench.stacks import Stack, _unique
from kvpush_tools.demo import launcher

BOTH = ["kvpush", "vllm-router"]


def test_cells_are_every_mode_behind_every_router_that_drives_it() -> None:
    cells, skipped = serve_summary.plan_cells(["kvpush", "vllm-pull", "vllm-push"], BOTH)
    assert cells == [
        Cell("kvpush", "kvpush"),
        Cell("vllm-pull", "kvpush"),
        Cell("vllm-push", "kvpush"),
        Cell("kvpush", "vllm-router"),
        Cell("vllm-pull", "vllm-router"),
    ]
    assert [c for c, _ in skipped] == [Cell("vllm-push", "vllm-router")]
    # One router: the cells are the modes, in the order given (the old sweep).
    one, none = serve_summary.plan_cells(["vllm-pull", "kvpush"], ["kvpush"])
    assert [c.mode for c in one] == ["vllm-pull", "kvpush"] and none == []
    assert Cell("kvpush", "kvpush").label == "kvpush"
    assert Cell("kvpush", "vllm-router").label == "kvpush via vllm-router"


def test_vllm_push_behind_vllm_router_is_refused_when_named_skipped_when_defaulted() -> None:
    cells, why = choose_cells(["kvpush", "vllm-push"], BOTH, named_modes=True)
    assert cells == [] and why is not None
    assert "vllm-push behind vllm-router" in why
    for mode in ("vllm-push", "kvpush-selective"):
        assert serve_summary.unsupported(mode, "vllm-router") is not None
    for mode in loadgen.MODES:
        assert serve_summary.unsupported(mode, "kvpush") is None
    cells, why = choose_cells(["kvpush", "vllm-pull", "vllm-push"], BOTH, named_modes=False)
    assert why is None and Cell("vllm-push", "vllm-router") not in cells and len(cells) == 5
    assert choose_cells(["kvpush"], ["sglang"], named_modes=True)[1] is not None


def _fake_server(name: str) -> launcher.ServerProcess:
    return launcher.ServerProcess(name=name, cmd=["true"], url=f"http://127.0.0.1:1/{name}", log_path=Path("/dev/null"))


def test_vllm_router_cell_shares_p_and_d_and_refuses_vllm_push(tmp_path: Path) -> None:
    p, d, r = _fake_server("p"), _fake_server("d"), _fake_server("router")
    base = Stack("kvpush", r.url, p, d, r, d.url)
    other = behind_vllm_router(base, tmp_path)
    assert other.prefill is p and other.decode is d and other.router is not r
    assert other.router_name == "vllm-router" and other.mode == "kvpush"
    assert other.router is not None and "--vllm-pd-disaggregation" in other.router.cmd
    # Started and stopped once each although two stacks hold them.
    assert _unique([*base.servers, *other.servers, base.router, other.router]) == [p, d, r, other.router]
    with pytest.raises(ValueError, match="vllm-push"):
        behind_vllm_router(Stack("vllm-push", r.url, p, d, r, d.url), tmp_path)


@pytest.mark.parametrize("iterations", [1, 3, 4])
def test_every_cell_runs_once_per_point_per_iteration_in_rotated_order(iterations: int) -> None:
    cells, _ = serve_summary.plan_cells(["kvpush", "vllm-pull"], BOTH)
    plan = sweep_plan([256, 1024], [1.0, 2.0, 4.0], cells, iterations)  # 6 points: not a multiple of 4 cells
    assert [(it, inp, q) for it, inp, q, _ in plan] == [
        (it, inp, q) for it in range(iterations) for inp in (256, 1024) for q in (1.0, 2.0, 4.0)
    ]
    for _, _, _, order in plan:
        assert sorted(order) == sorted(cells)  # each cell exactly once per group
    for prev, nxt in itertools.pairwise(plan):  # rotation by one, carried on across iterations
        assert nxt[3] == [*prev[3][1:], prev[3][0]]
    firsts = [order[0] for _, _, _, order in plan]
    # every len(cells) consecutive groups: each cell first once
    for i in range(0, len(firsts) - len(cells) + 1, len(cells)):
        assert sorted(firsts[i : i + len(cells)]) == sorted(cells)


def test_run_names_carry_the_router_and_old_names_mean_kvpush_router() -> None:
    name = serve_files.result_name("vllm-pull", 1.0, 1024, 64, 2, "vllm-router")
    assert name == "vllm-pull_via-vllm-router_qps1_in1024_out64_iter2.json"
    assert serve_files.parse_result_name(name) == ("vllm-pull", 1.0, 1024, 64, 2)
    assert serve_files.router_of_name(name) == "vllm-router"
    assert serve_files.router_of_name("kvpush_qps1_in1024_out64_iter0.json") == "kvpush"
    assert serve_files.parse_result_name("kvpush_via-haproxy_qps1_in1_out1_iter0.json") is None
    with pytest.raises(ValueError):
        serve_files.result_name("kvpush", 1.0, 1, 1, 0, "haproxy")


# kvpush's median TTFT per (router, iteration), and vllm-pull's: ratios 0.5, 0.25, 1.0 behind kvpush's
# router, 2.0, 1.0, 1.25 behind vllm-router.
TTFT_MS = {
    ("kvpush", "kvpush"): [100.0, 50.0, 200.0],
    ("vllm-pull", "kvpush"): [200.0, 200.0, 200.0],
    ("kvpush", "vllm-router"): [400.0, 100.0, 250.0],
    ("vllm-pull", "vllm-router"): [200.0, 100.0, 200.0],
}


def _fake_runs(tmp: Path) -> Path:
    for (mode, router), ttfts in TTFT_MS.items():
        for it, ttft_ms in enumerate(ttfts):
            # Three requests whose median TTFT is ttft_ms; TPOT 10 ms for kvpush, 20 ms for pull.
            tpot = 0.01 if mode == "kvpush" else 0.02
            outs = [
                RequestOutput(1024, True, t / 1000, [tpot] * 7, t / 1000 + 7 * tpot, 8, j)
                for j, t in enumerate((ttft_ms * 0.9, ttft_ms, ttft_ms * 1.1))
            ]
            r: dict[str, Any] = {
                "kvpush": {
                    "mode": mode,
                    "router": router,
                    "qps": 1.0,
                    "input_len": 1024,
                    "output_len": 8,
                    "iteration": it,
                    "loadavg_start": [1.0, 1.0, 1.0],
                }
            }
            r.update(loadgen.summarize(outs, 3.0))
            serve_files.write_result(tmp, r)
    return tmp


def test_summary_gives_per_router_ratio_with_its_spread_over_iterations(tmp_path: Path) -> None:
    results = serve_files.load_results(_fake_runs(tmp_path))
    assert len(results) == 12
    doc, table = plot_serve.summary(results)
    assert list(doc["routers"]) == ["kvpush", "vllm-router"]
    assert "points" not in doc  # two routers: no pooled top level mixing them
    want = {"kvpush": [0.5, 0.25, 1.0], "vllm-router": [2.0, 1.0, 1.25]}
    for router, per in want.items():
        (row,) = doc["routers"][router]["spread_median_ttft"]
        assert row["per_iteration"] == pytest.approx(per)
        assert (row["min"], row["max"]) == (pytest.approx(min(per)), pytest.approx(max(per)))
        assert row["iterations"] == [0, 1, 2]
        assert row["kvpush_iter_medians_ms"] == pytest.approx(TTFT_MS[("kvpush", router)])
        assert row["vllm-pull_iter_medians_ms"] == pytest.approx(TTFT_MS[("vllm-pull", router)])
        (tpot,) = doc["routers"][router]["spread_median_tpot"]
        assert tpot["per_iteration"] == pytest.approx([0.5, 0.5, 0.5])
        (pooled,) = doc["routers"][router]["ratios_median_ttft"]
        assert min(per) <= pooled["kvpush/vllm-pull"] <= max(per)
    assert "=== behind kvpush router ===" in table and "=== behind vllm-router ===" in table
    assert "[0.25..1.00]" in table and "[1.00..2.00]" in table


def test_one_router_keeps_the_old_top_level_summary(tmp_path: Path) -> None:
    results = [r for r in serve_files.load_results(_fake_runs(tmp_path)) if r["kvpush"]["router"] == "kvpush"]
    doc, table = plot_serve.summary(results)
    assert list(doc["routers"]) == ["kvpush"] and len(doc["points"]) == 2
    assert doc["ratios_median_ttft"] == doc["routers"]["kvpush"]["ratios_median_ttft"]
    assert "===" not in table


def test_spread_pairs_iterations_by_index_not_by_position() -> None:
    """A mode missing an iteration (a crashed run) must not shift the pairing."""
    agg = {
        (1024, 1.0, "kvpush"): {"median_ttft_ms": 1.0, "iterations": [0, 2], "iter_median_ttft_ms": [10.0, 30.0]},
        (1024, 1.0, "vllm-pull"): {
            "median_ttft_ms": 2.0,
            "iterations": [0, 1, 2],
            "iter_median_ttft_ms": [20.0, 99.0, 30.0],
        },
    }
    (row,) = serve_summary.ratio_spread(agg, "ttft")
    assert row["iterations"] == [0, 2] and row["per_iteration"] == pytest.approx([0.5, 1.0])
    assert row["kvpush/vllm-pull"] == pytest.approx(0.5)
