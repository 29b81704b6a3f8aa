"""``kvpush bench post``: vLLM's entry ids name the blocks vLLM's lists hold, a tiny run over real NIXL in two
processes writes a verified report with its fits and plot, and ``--device cuda`` without CUDA says why and
measures nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvpush.core.indexed import BUILD_US, expand, list_rows, strips_of
from kvpush.transport.nixl_agent import index_cost_us
from kvpush_tools.bench.post import main
from kvpush_tools.bench.post_run import cuda_missing
from kvpush_tools.bench.post_shape import Shape, block_ids, make_layout, vllm_ids, vllm_rows


@pytest.mark.parametrize("kv", ["split", "blocks-first"])
def test_vllm_entries_are_the_blocks_of_its_regions(kv: str) -> None:
    """vLLM's list (one entry per block of each of its regions: a blocks-first layer is one K|V region) is
    kvpush's list one row per entry, and its ids name block b of region r at r * pool + b."""
    shape = Shape(regions=8, pool=12, block_bytes=64, kv=kv)
    layout = make_layout(shape, 1 << 20, 0, "DRAM")
    rows = vllm_rows(layout, shape.vllm_width)
    np.testing.assert_array_equal(rows, expand(list_rows(layout, strips_of(layout))))
    blocks = np.array([7, 2, 11])
    ids = vllm_ids(blocks, shape.regions // shape.vllm_width, shape.pool)
    assert ids.dtype == np.int32 and ids.size == 3 * shape.regions // shape.vllm_width
    region = 1
    assert rows[ids[region * 3 + 1], 0] == layout.regions[region * shape.vllm_width].base + 2 * layout.block_stride


def test_block_patterns() -> None:
    rng = np.random.default_rng(0)
    contiguous = block_ids("contiguous", 10, 40, rng)
    assert (np.diff(contiguous) == 1).all()
    fragmented = block_ids("fragmented", 10, 40, rng)
    assert len(set(fragmented.tolist())) == 10 and fragmented.max() < 40


def test_tiny_run_writes_a_verified_report_with_its_slopes(tmp_path: Path) -> None:
    argv = ["--counts", "64,128", "--regions", "8", "--iters", "2", "--warmup", "0", "--kv", "split,blocks-first"]
    argv += ["--ways", "per-request,by-index,vllm,kvpush"]
    assert main([*argv, "--quiet", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "post_cpu_split.json").exists() and (tmp_path / "post_cpu_split.png").exists()
    report = json.loads((tmp_path / "post_cpu_blocks-first.json").read_text())
    rows = report["backends"]["UCX"]["rows"]
    assert len(rows) == 2 * 2 * 4 and all(r["verified"] for r in rows)
    assert {r["way"] for r in rows} == {"per-request", "by-index", "vllm", "kvpush"}
    # Blocks first: contiguous, one descriptor a layer built for the request; fragmented, by index where NIXL
    # holds lists as strides (an index then costs less than a descriptor built), else from the strips.
    indexes = index_cost_us(report["host"]["nixl"]) < BUILD_US
    assert {r["pattern"]: r["kvpush_chooses"] for r in rows if r["descriptors"] == 128} == {
        "contiguous": "strips",
        "fragmented": "by_index" if indexes else "strips",
    }
    fits = report["backends"]["UCX"]["fits"]
    assert len(fits) == 8 and all(len(f["post_us_per_descriptor_rounds"]) == 2 for f in fits)
    assert (tmp_path / "post_cpu_blocks-first.png").exists()
    assert report["tree"] and report["host"]["nixl"]


@pytest.mark.skipif(not cuda_missing(), reason="CUDA is here")
def test_cuda_without_cuda_says_so_and_measures_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cuda", "--kv", "split,blocks-first", "--out", str(tmp_path)]) == 2
    assert json.loads((tmp_path / "post_cuda_blocks-first.json").read_text())["error"]
    why = json.loads((tmp_path / "post_cuda_split.json").read_text())["error"]
    assert why.startswith("--device cuda: ") and "nothing measured" in why
    assert why in capsys.readouterr().err
