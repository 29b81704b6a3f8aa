"""``kvpush bench seals``: a tiny run checks every sealed notification it timed and writes its report."""

from __future__ import annotations

import json
from pathlib import Path

from kvpush_tools.bench.seals import main


def test_tiny_run_writes_a_report(tmp_path: Path) -> None:
    assert main(["--rounds", "3", "--per-round", "20", "--cold", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "seals.json").read_text())
    for mode in ("warm", "cold"):
        cases = {k: v for k, v in report[mode].items() if isinstance(v, dict)}
        assert set(cases) == {"p_unsealed", "p_sealed", "d_unsealed", "d_sealed"}, report
        assert all(0 < c["p10_us"] <= c["median_us"] <= c["p90_us"] for c in cases.values()), report
        assert {"p_cost_us", "d_cost_us"} <= set(report[mode]), report
    assert main(["--rounds", "0", "--out", str(tmp_path)]) == 2
