"""``kvpush bench pairing``: a tiny run writes a report whose plans are staged, with the list built ahead."""

from __future__ import annotations

import json
from pathlib import Path

from kvpush_tools.bench.pairing import main

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_report_and_plot(tmp_path: Path) -> None:
    argv = ["--tree", str(ROOT), "--tokens", "100", "--layers", "2", "--rounds", "2", "--warmup", "0"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pairing.json").read_text())
    [row] = report["results"]
    assert Path(row["kvpush"]).parent == ROOT / "kvpush" and row["ahead"], row
    assert row["plan_kind"] == "staged" and row["pieces"] == 7 * 2 * 2, row  # 7 blocks x 2 layers x K/V
    assert len(row["plan_s"]) == 2 and all(k in row for k in ("plan_no_ahead_s_median", "pack_ahead_s_median"))
    assert (tmp_path / "pairing.png").stat().st_size > 0
