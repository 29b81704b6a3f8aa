"""``kvpush bench transfer``: its block patterns and per-block descriptors are what they claim,
and a tiny end-to-end run (two processes, real NIXL) writes a verified report, table and plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush_tools.bench.transfer import main
from kvpush_tools.bench.transfer_shape import PATTERNS, Shape, block_ids, per_block_descriptors


@pytest.mark.parametrize("pattern", PATTERNS)
def test_block_patterns(pattern: str) -> None:
    ids = block_ids(pattern, 40, 96, np.random.default_rng(0))
    assert len(ids) == len(set(ids)) == 40 and all(0 <= b < 96 for b in ids)
    steps = np.diff(ids)
    if pattern == "contiguous":
        assert (steps == 1).all()
    elif pattern == "runs16":
        assert all(ids[i] % 16 == 0 for i in range(0, 40, 16))  # runs start on run boundaries
        assert all((steps[i : i + 15] == 1).all() for i in range(0, 39, 16))
    else:
        assert (steps != 1).sum() > 20


def _layout(base: int, num_blocks: int) -> KVLayout:
    shape = Shape(tokens=40, layers=2, block_size=16)
    stride = shape.block_size * shape.token_bytes
    return KVLayout(
        block_size=16,
        num_blocks=num_blocks,
        block_stride=stride,
        head_bytes=shape.token_bytes,
        num_heads=1,
        head_start=0,
        local_heads=1,
        order=TokenOrder.NHD,
        mem=MemKind.DRAM,
        dtype="bfloat16",
        regions=tuple(Region(base + i * num_blocks * stride, num_blocks * stride) for i in range(4)),
    )


def test_per_block_descriptors_cover_each_block_once() -> None:
    src, dst = _layout(1 << 20, 8), _layout(1 << 30, 16)
    local, remote = per_block_descriptors(src, dst, [5, 1, 7], [9, 2, 14], 40)
    assert local.shape == remote.shape == (12, 3)  # 3 blocks x 4 regions, never merged
    stride = src.block_stride
    assert local[0].tolist() == [src.regions[0].base + 5 * stride, stride, 0]
    assert remote[4].tolist() == [dst.regions[1].base + 2 * stride, stride, 0]
    assert local[2, 1] == remote[11, 1] == 8 * src.token_bytes  # the last block holds 40 - 32 tokens


def test_tiny_run_writes_a_verified_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokens", "40", "--layers", "2", "--iters", "1", "--warmup", "0", "--quiet", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "transfer_40tok.json").read_text())
    assert (tmp_path / "transfer_40tok.png").stat().st_size > 10_000
    res = {(r["pattern"], r["plan"]): r for r in report["results"]}
    assert len(res) == 15 and all(r["verified"] for r in res.values())
    assert report["shape"]["bytes"] == 40 * 256 * 2 * 2
    assert all(r["bytes"] == report["shape"]["bytes"] for r in res.values())
    assert res["shuffled", "per-block"]["descriptors_after"] == 3 * 4
    assert res["contiguous", "coalesced"]["descriptors_after"] <= 4
    assert res["shuffled", "staged"]["descriptors_after"] == 1
    assert res["shuffled", "rounds"]["plan_chosen"] == "staged"  # no larger than the ring: one slot of it
    assert "GB/s" in capsys.readouterr().out


def test_orders_compare_d_registering_after_p_finished_with_ahead(tmp_path: Path) -> None:
    """``--orders finished,ahead``: each engine case runs in both orders (verified), and the finished one
    carries its ratio to the ahead one and the time D took to send its registration."""
    argv = ["--tokens", "40", "--layers", "2", "--iters", "1", "--warmup", "0", "--quiet", "--no-plot"]
    argv += ["--patterns", "shuffled", "--plans", "staged", "--orders", "finished,ahead", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "transfer_40tok.json").read_text())
    res = {r["order"]: r for r in report["results"]}
    assert set(res) == {"finished", "ahead"} and all(r["verified"] for r in res.values())
    assert res["finished"]["x_ahead"] == res["finished"]["total_s_median"] / res["ahead"]["total_s_median"]
    assert 0 < res["finished"]["register_s_median"] < res["finished"]["total_s_median"]
    assert res["ahead"]["register_s_median"] == 0.0


def test_trees_side_by_side_with_parts_and_stage_times(tmp_path: Path) -> None:
    """``--tree`` runs each tree's engine in its own processes (a lane each), ``--push-parts`` with
    ``--min-part-bytes`` cuts a small staged push into parts, and each row carries stage times after
    the order's start and the engine threads' CPU time."""
    tree = str(Path(__file__).resolve().parents[2])
    argv = ["--tokens", "64", "--layers", "2", "--iters", "1", "--warmup", "0", "--quiet", "--no-plot"]
    argv += ["--patterns", "shuffled", "--plans", "staged", "--orders", "ahead", "--out", str(tmp_path)]
    argv += ["--tree", tree, "--push-parts", "2", "--min-part-bytes", "1", "--part-cost-us", "0"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "transfer_64tok.json").read_text())
    [row] = report["results"]
    assert row["verified"] and row["nixl"] == f"UCX@{Path(tree).name}" and report["push_parts"] == 2
    assert row["descriptors_after"] == 2  # two parts, one descriptor each
    assert 0 < row["at_p_ready_s_median"] <= row["at_p_posted_s_median"] < row["at_d_result_s_median"]
    assert row["at_d_first_part_s_median"] <= row["at_d_last_part_s_median"]
    # Per part, each side's stages in order, and D unpacks a part only after P packed it and D was notified.
    for run in row["iters"]:
        for i in range(2):
            t = {
                k.replace(f"part{i}_", "").removeprefix("at_").removesuffix("_s"): v
                for k, v in run.items()
                if f"_part{i}_" in k
            }
            assert t["p_pack"] <= t["p_packed"] <= t["p_posted"] <= t["p_written"], t
            assert t["d_notified"] <= t["d_unpack"] <= t["d_unpacked"] and t["p_packed"] <= t["d_unpack"], t
    assert row["p_cpu_s_median"] > 0 and row["d_cpu_s_median"] > 0
