"""``kvpush bench transfer --sizes``, its plans in rounds and GIL modes: the pieces are what they claim, and a
tiny end-to-end run (two processes, real NIXL) writes a verified report, its summary, the per-part fits and
the figures. No timings are asserted: speed is the bench's to show, not the test's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush_tools.bench import busy_gil, part_cost, transfer_plans
from kvpush_tools.bench.transfer import main


@pytest.mark.parametrize(
    ("text", "n"), [("64M", 64 << 20), ("2G", 2 << 30), ("512KiB", 512 << 10), ("4096", 4096), ("0.5M", 512 << 10)]
)
def test_sizes_parse_and_label(text: str, n: int) -> None:
    assert transfer_plans.parse_size(text) == n
    assert transfer_plans.parse_size(transfer_plans.size_label(n)) == n


def test_bad_sizes_are_refused() -> None:
    for bad in ("", "64X", "-1M", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            transfer_plans.parse_size(bad)


def test_ring_parts_expand_rounds_into_one_plan_per_part_size() -> None:
    plans = transfer_plans.expand(["coalesced", "rounds", "staged"], [4 << 20, 64 << 20])
    assert plans == ["coalesced", "rounds:4M", "rounds:64M", "staged"]
    assert transfer_plans.expand(["rounds"], None) == ["rounds"]
    assert [transfer_plans.part_bytes_of(p) for p in plans] == [None, 4 << 20, 64 << 20, None]


def test_each_plan_gets_its_region() -> None:
    """Direct none; one slot: the push and a MiB; rounds: the ring region; ``rounds:<size>``: that many slots
    of the size, parts of it. Knobs a tree does not know are left out."""
    keys = frozenset({"min_part_bytes", "ring_slots", "part_cost_us"})
    flat = {
        plan: transfer_plans.flat_config(plan, 100 << 20, ("UCX",), {"ring_bytes": 32 << 20}, keys)
        for plan in ("coalesced", "staged", "rounds", "rounds:4M", "auto")
    }
    assert flat["coalesced"]["plan"] == "direct" and flat["coalesced"]["staging_bytes"] == 0
    assert flat["staged"]["staging_bytes"] == 101 << 20 and flat["staged"]["staged_min_descriptors"] == 1
    assert flat["rounds"]["plan"] == "staged" and flat["rounds"]["staging_bytes"] == 32 << 20
    assert flat["rounds:4M"]["staging_bytes"] == 16 << 20 and flat["rounds:4M"]["min_part_bytes"] == 4 << 20
    assert flat["auto"]["plan"] == "auto" and "staged_min_descriptors" not in flat["auto"]
    old = transfer_plans.flat_config("rounds:4M", 1 << 20, ("UCX",), {"ring_slots": 8}, frozenset())
    assert "min_part_bytes" not in old and "ring_slots" not in old


def test_one_slot_makes_d_grant_as_to_a_p_without_rounds() -> None:
    asked: list[tuple[Any, ...]] = []

    def grant(p_layout: Any, ask: Any, want: bool, rounds: bool = False) -> str:
        asked.append((p_layout, ask, want, rounds))
        return "slot"

    receiver = SimpleNamespace(unpacks=SimpleNamespace(grant=grant))
    assert transfer_plans.one_slot(receiver)
    assert receiver.unpacks.grant("L", "A", True, True) == "slot" and asked == [("L", "A", True, False)]
    old = SimpleNamespace(unpacks=SimpleNamespace(grant=lambda p_layout, ask, want: None))
    assert not transfer_plans.one_slot(old) and not transfer_plans.one_slot(SimpleNamespace())


def test_gil_modes() -> None:
    args = SimpleNamespace(gil_modes=[busy_gil.parse_mode("cpu/5")], busy_gil=True, switch_intervals=[5.0, 0.1])
    got = [m.label for m in busy_gil.modes(args) or []]
    assert got == ["cpu/5ms", "idle/5ms", "idle/0.1ms", "busy/5ms", "busy/0.1ms"]
    assert busy_gil.modes(SimpleNamespace(gil_modes=None, busy_gil=False, switch_intervals=None)) is None
    assert busy_gil.parse_mode("busy/0.5ms") == busy_gil.Mode("busy", 0.5)
    for bad in ("spin/5", "busy/x", "busy/0"):
        with pytest.raises(argparse.ArgumentTypeError):
            busy_gil.parse_mode(bad)


def test_busy_loop_starts_and_stops_each_kind() -> None:
    loop = busy_gil.BusyLoop()
    for kind in ("busy", "cpu", "idle"):
        busy_gil.apply(loop, kind, 1.0)
    loop.stop()
    busy_gil.apply(loop, "idle", busy_gil.DEFAULT_INTERVAL_MS)


def _row(size: int, parts: int, totals: list[float], gil: str = "busy/5ms") -> dict[str, Any]:
    return {
        "nixl": "UCX",
        "pattern": "shuffled",
        "plan": f"rounds:{transfer_plans.size_label(size // parts)}",
        "plan_chosen": "rounds",
        "gil": gil,
        "size": size,
        "parts": parts,
        "iters": [{"total_s": t} for t in totals],
    }


def test_part_cost_fits_recover_a_known_cost() -> None:
    """Totals made of 0.1 s, 0.2 s per GiB and 2 ms per part: each size's slope and the joint fit give 2 ms."""
    rows = []
    for size in (512 << 20, 2 << 30):
        for part in (4 << 20, 16 << 20, 64 << 20):
            n = size // part
            t = 0.1 + 0.2 * size / 2**30 + 0.002 * n
            rows.append(_row(size, n, [t, t]))
    rows.append({**_row(1 << 30, 2, [9.0]), "plan_chosen": "staged"})  # one slot: not a part of the fits
    fits = part_cost.fits(rows)
    assert [f["size"] for f in fits] == [512 << 20, 2 << 30, 0]
    for f in fits:
        assert f["per_part_ms"] == pytest.approx(2.0, abs=1e-6)
    assert fits[-1]["ms_per_gib"] == pytest.approx(200.0, abs=1e-6)
    assert "ms per part" in part_cost.table(fits)


def test_tiny_sweep_writes_a_verified_report_with_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two sizes, one slot against rounds in parts of two sizes, idle and a busy thread at a short interval:
    every row verified, the one-slot plan stays in one slot above the ring (D granted as before rounds),
    rounds cut as the ring says, and a per-part cost per size and across sizes."""
    argv = ["--sizes", "256K,512K", "--layers", "2", "--patterns", "shuffled", "--plans", "staged,rounds"]
    argv += ["--ring-parts", "16K,32K", "--min-part-bytes", "16384", "--gil-modes", "idle/5,busy/0.5"]
    argv += ["--iters", "2", "--warmup", "0", "--quiet", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "transfer_sizes.json").read_text())
    rows = {(r["size"], r["plan"], r["gil"]): r for r in report["results"]}
    assert len(rows) == 2 * 3 * 2 and all(r["verified"] for r in rows.values())
    for size in (256 << 10, 512 << 10):
        for gil in ("idle/5ms", "busy/0.5ms"):
            assert rows[size, "staged", gil]["plan_chosen"] == "staged"
            for part in (16 << 10, 32 << 10):
                r = rows[size, f"rounds:{part >> 10}K", gil]
                assert r["plan_chosen"] == "rounds" and r["parts"] == size // part and r["bytes"] == size
                assert r["total_s_min"] <= r["total_s_q1"] <= r["total_s_median"] <= r["total_s_q3"]
                assert not any("_part0_" in k for k in r), "per-part stage times are left out"
    fits = report["part_cost"]
    modes, sizes = ("idle/5ms", "busy/0.5ms"), (256 << 10, 512 << 10, 0)
    assert {(f["gil"], f["size"]) for f in fits} == {(g, s) for g in modes for s in sizes}
    summary = json.loads((tmp_path / "transfer_sizes_summary.json").read_text())
    assert len(summary["results"]) == len(rows) and "iters" not in summary["results"][0]
    assert summary["sizes"] == [256 << 10, 512 << 10] and len(summary["segments"]) == 2
    assert (tmp_path / "transfer_sizes_parts.png").stat().st_size > 10_000
    assert not (tmp_path / "transfer_sizes.png").exists()  # a line per plan and GIL mode: drawn with one mode only
    assert "ms per part" in capsys.readouterr().out


def test_tiny_sizes_compare_rounds_with_direct_and_one_slot(tmp_path: Path) -> None:
    """Without GIL modes: direct, one slot and rounds through a region smaller than either push (D grants the
    ring that fits it: two slots of 64 KiB), verified, with the sizes figure."""
    argv = ["--sizes", "256K,512K", "--layers", "2", "--patterns", "shuffled,contiguous"]
    argv += ["--plans", "coalesced,staged,rounds", "--ring-bytes", "128K", "--iters", "1", "--warmup", "0"]
    argv += ["--quiet", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "transfer_sizes.json").read_text())
    rows = {(r["size"], r["pattern"], r["plan"]): r for r in report["results"]}
    assert len(rows) == 2 * 2 * 3 and all(r["verified"] and "gil" not in r for r in rows.values())
    for size in (256 << 10, 512 << 10):
        for pattern in ("shuffled", "contiguous"):
            assert rows[size, pattern, "coalesced"]["plan_chosen"] == "direct"
            assert rows[size, pattern, "staged"]["plan_chosen"] == "staged"
            r = rows[size, pattern, "rounds"]
            assert r["plan_chosen"] == "rounds" and r["parts"] == size // (64 << 10)
    assert report["ring_bytes"] == 128 << 10 and report["part_cost"] == [] and report["tree"]
    assert (tmp_path / "transfer_sizes.png").stat().st_size > 10_000
