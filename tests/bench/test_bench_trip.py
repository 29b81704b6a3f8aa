"""``kvpush bench trip``: tiny runs of both modes write reports whose stages are in order and whose frames are v8's."""

from __future__ import annotations

import json
from pathlib import Path

from kvpush_tools.bench.trip import CASES, PATH_STEPS, STAGES, main, register_frame

ROOT = Path(__file__).resolve().parents[2]


def test_trip_reaches_a_sleeping_receiver_in_every_case(tmp_path: Path) -> None:
    assert main(["--pings", "3", "--blocks", "64", "--gap-ms", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "trip.json").read_text())["results"]
    assert {r["case"] for r in rows} == set(CASES) and len(rows) == len(CASES) * 2 * 2
    for r in rows:
        assert r["pings"] == 3, r
        woke, read, decoded = (r[f"{s}_ms_median"] for s in STAGES[1:])
        assert 0 < woke <= read <= decoded, r  # one clock for both processes: the stages come in order
    regs = [r for r in rows if r["message"].startswith("Register")]
    assert all(r["frame_bytes"] == len(register_frame(64)) for r in regs)


def test_path_work_per_tree(tmp_path: Path) -> None:
    argv = ["--tree", str(ROOT), "--pings", "2", "--blocks", "64", "--layers", "2", "--gap-ms", "0"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "path_work.json").read_text())["results"]
    assert Path(row["kvpush"]).parent == ROOT / "kvpush" and row["protocol"] >= 8, row
    assert 64 * 4 < row["frame_bytes"] < 64 * 4 + 300, row
    assert all(row[f"{k}_ms_median"] > 0 for k in PATH_STEPS), row
