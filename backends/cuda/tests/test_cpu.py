"""CUDA backend parts that run without a GPU: import hygiene, the error without
CUDA, stride-based description of every vLLM variant, and the gather/scatter
code paths on host memory (torch indexing, and the Triton kernel itself under
Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from cuda_helpers import blocks_equal, check_addresses, fill_random, spec_for

from kvpush.backends.tensors import allocation_registrations, describe_strided
from kvpush.core.errors import BackendError
from kvpush.core.layout import MemKind, TokenOrder
from kvpush.core.pieces import coalesce, map_pieces
from kvpush_cuda.copy import PieceCopier, split_pieces, unit_width
from kvpush_cuda.variants import REFUSED, VARIANTS, is_mla, make_kv, regions_per_layer, shared_allocation

torch = pytest.importorskip("torch")


def _py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_import_and_entry_point_do_not_import_torch() -> None:
    """vLLM loads plugins before forking workers: importing the backend must not touch torch (or CUDA)."""
    r = _py(
        """
        import sys
        import kvpush_cuda
        from kvpush.backends.registry import available_backends
        cls = available_backends()["cuda"].load()
        assert cls is kvpush_cuda.CudaBackend, cls
        print("torch" in sys.modules)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_clear_error_without_cuda() -> None:
    """No visible GPU: constructing the backend (also through the registry) says why, as a BackendError."""
    r = _py(
        """
        from kvpush.backends import load_backend
        from kvpush.core.errors import BackendError
        try:
            load_backend("cuda")
        except BackendError as e:
            print("ERR", e)
        else:
            print("NO ERROR")
        """,
        CUDA_VISIBLE_DEVICES="",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR kvpush CUDA backend: no CUDA device is usable"), r.stdout
    assert "backend 'host'" in r.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_describe_every_variant_matches_real_addresses(variant: str) -> None:
    heads = 1 if is_mla(variant) else 4
    kv = make_kv(torch, variant, 3, 7, 16, heads, 8, torch.bfloat16, "cpu")
    layout, spans = describe_strided(kv, spec_for(variant, 16, heads, 8), MemKind.VRAM, "cpu")
    assert layout.mem is MemKind.VRAM
    assert layout.num_blocks == 7
    assert len(layout.regions) == 3 * regions_per_layer(variant)
    if heads > 1:  # with one head both orders place the same bytes
        head_major = variant in ("old_flash_hnd", "v024_hnd", "LBHNC", "BLHNC")
        assert layout.order is (TokenOrder.HND if head_major else TokenOrder.NHD)
    check_addresses(layout, kv, variant)
    regs, rest = allocation_registrations(layout, spans)
    assert not rest
    assert len(regs) == (1 if shared_allocation(variant) else 3)
    for r in layout.regions:
        assert any(g.addr <= r.base and r.base + r.size <= g.addr + g.size for g in regs)


@pytest.mark.parametrize("variant", REFUSED)
def test_layouts_whose_blocks_are_not_dense_are_refused(variant: str) -> None:
    """vLLM's LHBNC and BHLNC keep a block's heads a layer or more apart: no dense block to move."""
    kv = make_kv(torch, variant, 3, 7, 16, 4, 8, torch.bfloat16, "cpu")
    with pytest.raises(BackendError, match="not dense"):
        describe_strided(kv, spec_for(variant, 16, 4, 8), MemKind.VRAM, "cpu")


def test_describe_tp_rank_heads() -> None:
    kv = make_kv(torch, "LBNHC", 2, 4, 16, 2, 8, torch.float16, "cpu")
    spec = spec_for("LBNHC", 16, 8, 8)
    spec = type(spec)(**{**spec.__dict__, "tp_rank": 3, "tp_size": 4})
    layout, _ = describe_strided(kv, spec, MemKind.VRAM, "cpu")
    assert (layout.head_start, layout.local_heads, layout.num_heads) == (6, 2, 8)
    # More ranks than heads: vLLM replicates each head on tp/heads consecutive ranks.
    kv1 = make_kv(torch, "LBNHC", 2, 4, 16, 1, 8, torch.float16, "cpu")
    rep = type(spec)(**{**spec.__dict__, "num_heads": 2, "tp_rank": 5, "tp_size": 8})
    layout, _ = describe_strided(kv1, rep, MemKind.VRAM, "cpu")
    assert (layout.head_start, layout.local_heads) == (1, 1)
    with pytest.raises(BackendError, match="cannot be sharded"):
        describe_strided(
            kv1, type(spec)(**{**spec.__dict__, "num_heads": 3, "tp_rank": 0, "tp_size": 2}), MemKind.VRAM, "cpu"
        )


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (lambda: {"a": torch.empty((2, 4, 16, 2, 8))}, "is on cpu"),
        (lambda: {"a": torch.empty((4, 16, 2, 8))}, "has 4 dims"),
        (lambda: {"a": torch.empty((3, 4, 16, 2, 8))}, "K=3, expected 2"),
        (lambda: {"a": torch.empty((2, 4, 16, 3, 8))}, "H=3, expected 2"),
        (lambda: {"a": torch.empty((2, 4, 16, 4, 8))[:, :, :, :2]}, "not dense"),
        (lambda: {"a": torch.empty((2, 4, 16, 2, 8)), "b": torch.empty((2, 5, 16, 2, 8))}, "differs"),
    ],
)
def test_describe_rejects_what_it_cannot_move(make, msg: str) -> None:
    device = "cuda" if msg == "is on cpu" else "cpu"
    with pytest.raises(BackendError, match=msg):
        describe_strided(make(), spec_for("old_flash_nhd", 16, 2, 8), MemKind.VRAM, device)


def test_a_cache_without_head_axis_holds_one_head() -> None:
    """vLLM 0.24's MLA ``[blocks, tokens, latent]`` has no head axis: one head a rank; a spec saying this rank
    holds more heads cannot be addressed in it and is refused, instead of reading one head as several."""
    kv = make_kv(torch, "v024_mla", 2, 4, 16, 1, 8, torch.bfloat16, "cpu")
    layout, _ = describe_strided(kv, spec_for("v024_mla", 16, 1, 8), MemKind.VRAM, "cpu")
    assert (layout.local_heads, layout.head_bytes, layout.block_stride) == (1, 16, 16 * 16)
    two = type(spec_for("v024_mla", 16, 1, 8))(16, 2, 8, "bfloat16", axes="BNC")
    with pytest.raises(BackendError, match="no head axis"):
        describe_strided(kv, two, MemKind.VRAM, "cpu")


def test_split_and_unit_width() -> None:
    offs, poss, lens = np.array([0, 100_000]), np.array([0, 10]), np.array([10, 150_000])
    o, p, ln = split_pieces(offs, poss, lens, 65536)
    assert ln.tolist() == [10, 65536, 65536, 18928]
    assert o.tolist() == [0, 100_000, 165_536, 231_072]
    assert p.tolist() == [0, 10, 65_546, 131_082]
    assert unit_width([4096], [256, 512]) == (8, True)
    assert unit_width([4096], [258]) == (2, False)
    assert unit_width([4096, 24], [8]) == (8, False)


def _transfer(kernel: str, src_variant: str, dst_variant: str, seed: int, in_parts: bool = False) -> bool:
    """P's blocks -> staging (gather) -> D's shuffled blocks (scatter), on host memory.

    ``in_parts``: as the engine runs an asynchronous push (``wait=False``), part by part, from the
    launches ``prepare_*`` made for the parts it was told of (P) and from its template for a cut it
    was not told of (D), checking that every part was launched that way.
    """
    rng = np.random.default_rng(seed)
    heads = 1 if is_mla(src_variant) else 2
    layers = 6 // regions_per_layer(src_variant)  # six regions either way: the parts below cut them
    p_kv = make_kv(torch, src_variant, layers, 12, 16, heads, 8, torch.bfloat16, "cpu")
    d_kv = make_kv(torch, dst_variant, layers, 20, 16, heads, 8, torch.bfloat16, "cpu")
    fill_random(p_kv, seed)
    fill_random(d_kv, seed + 1)
    lp, _ = describe_strided(p_kv, spec_for(src_variant, 16, heads, 8), MemKind.VRAM, "cpu")
    ld, _ = describe_strided(d_kv, spec_for(dst_variant, 16, heads, 8), MemKind.VRAM, "cpu")
    src_ids = rng.permutation(12)[:5]
    dst_ids = rng.permutation(20)[:5]
    pieces = coalesce(map_pieces(lp, ld, src_ids, dst_ids, 5 * 16))
    staging = torch.full((int(pieces[:, 2].sum()) * len(lp.regions),), 0xA5, dtype=torch.uint8)
    copier = PieceCopier(torch, "cpu", kernel)  # type: ignore[arg-type]
    p_bases, d_bases = [r.base for r in lp.regions], [r.base for r in ld.regions]
    pk, up = pieces[:, [0, 2]], pieces[:, [1, 2]]
    if not in_parts:
        copier.prepare_gather(p_bases, pk)
        copier.prepare_scatter(d_bases, up)
        uploads = copier.stats["uploads"]
        copier.gather(p_bases, pk, staging.data_ptr())
        copier.scatter(d_bases, up, staging.data_ptr())
        assert copier.stats["uploads"] == uploads, "prepared tables were uploaded again on the critical path"
    else:
        per_region, n, base = int(pieces[:, 2].sum()), len(p_bases), staging.data_ptr()
        told = [(0, 2, base), (2, n, base + 2 * per_region)]
        other = [(0, 1, base), (1, 5, base + per_region), (5, n, base + 5 * per_region)]
        copier.prepare_gather(p_bases, pk, parts=told)
        copier.prepare_scatter(d_bases, up)
        for a, b, addr in told:
            copier.gather(p_bases[a:b], pk, addr, wait=False)
        for a, b, addr in other:
            copier.scatter(d_bases[a:b], up, addr, wait=False)
        assert copier.stats["prepared_calls"] == len(told) + len(other), copier.stats
    assert copier.kernel == kernel
    return blocks_equal(d_kv, dst_variant, dst_ids, p_kv, src_variant, src_ids)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("old_flash_nhd", "old_flash_hnd"),
        ("v024_nhd", "v024_cross_layer"),
        ("v024_hnd", "old_flash_nhd"),
        ("v024_mla", "mla"),
        ("old_mla", "v024_mla"),
        ("LBNHC", "LBHNC"),
        ("BLNHC", "LBNHC"),
        ("BLHNC", "LBHNC"),
        ("mla", "mla"),
    ],
)
def test_torch_gather_scatter_moves_exact_bytes(src: str, dst: str) -> None:
    assert regions_per_layer(src) == regions_per_layer(dst)
    assert _transfer("torch", src, dst, seed=3)


def test_triton_kernel_under_interpreter() -> None:
    """The Triton kernel's own code, run by Triton's CPU interpreter on host memory."""
    pytest.importorskip("triton")
    r = _py(
        """
        import sys
        sys.path.insert(0, "backends/cuda/tests")
        from test_cpu import _transfer
        print(_transfer("triton", "old_flash_nhd", "old_flash_hnd", 5), _transfer("triton", "BLNHC", "LBHNC", 6))
        print(_transfer("triton", "LBNHC", "LBHNC", 7, in_parts=True))
        """,
        TRITON_INTERPRET="1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-3:] == ["True", "True", "True"], r.stdout


def test_benchmark_runs_on_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU benchmark's own code (strategies, the engine's finished and ahead modes, the layer-wise
    microbenchmark with its GPU samples, here from a stand-in for nvidia-smi) on host memory: two
    processes, real NIXL agents, every transfer verified on D. Keeps the benchmark from rotting between
    GPU sessions; says nothing about speed."""
    pytest.importorskip("nixl")
    from kvpush_tools.cuda.bench import main
    from kvpush_tools.cuda.options import LW_MODES

    smi = tmp_path / "smi.py"
    smi.write_text("import time\nwhile True:\n    print('1410, 500.5, Active', flush=True)\n    time.sleep(0.005)\n")
    monkeypatch.setenv("KVPUSH_GPU_SAMPLES_CMD", f"{sys.executable} {smi}")
    out = tmp_path / "bench.json"
    args = ["--backend", "host", "--quick", "--iters", "1", "--patterns", "shuffled", "--strategies", "staged"]
    args += ["--write-descs", "1", "--engine-parts", "2", "--lw-tokens", "64", "--lw-iters", "1", "--json", str(out)]
    assert main([*args, "--gpu-samples"]) == 0
    res = json.loads(out.read_text())
    assert {(e["mode"], e["parts"]) for e in res["engine"]} == {("finished", 2), ("ahead", 2)}
    finished = next(e for e in res["engine"] if e["mode"] == "finished")
    assert finished["x_ahead"] > 0 and finished["timeline_median"]["d_sent"] >= 0  # timed from D's register call
    assert {r["mode"] for r in res["layerwise"]} == set(LW_MODES)
    assert all(r["verified"] for r in [*res["engine"], *res["layerwise"]])
    sampled = [r for r in res["layerwise"] if "median_gpu_sm_mhz" in r]  # a forward under 5 ms may have none
    assert sampled and all(r["median_gpu_sm_mhz"] == 1410 and r["median_gpu_power_capped"] == 1 for r in sampled)


def test_gpu_sampler_lines_up_samples_with_a_run() -> None:
    """``--gpu-samples``' reader, fed by a stand-in for nvidia-smi: lines are parsed (the power-capped
    flag too, garbage skipped) and a window holds only the samples that arrived inside it."""
    from kvpush_tools.cuda.gpu_samples import GpuSampler, parse

    assert parse("1980, 612.35, Not Active") == (1980.0, 612.35, False)
    assert parse("1755, 700.01, Active") == (1755.0, 700.01, True)
    assert parse("[N/A], 1, Active") is None and parse("garbage") is None
    script = textwrap.dedent(
        """
        import sys, time
        print("not a sample", flush=True)
        for i in range(200):
            print(f"{1500 + (i % 2) * 100}, 650.0, {'Active' if i % 4 == 0 else 'Not Active'}", flush=True)
            time.sleep(0.005)
        """
    )
    sampler = GpuSampler([sys.executable, "-c", script])
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        time.sleep(0.3)
        win = sampler.window(t0, time.monotonic())
        assert 10 < win["gpu_samples"] < 100, win
        assert 1500 <= win["gpu_sm_mhz"] <= 1600 and win["gpu_power_w"] == 650.0, win
        assert 0.1 < win["gpu_power_capped"] < 0.4, win
        assert sampler.window(t0 - 100, t0 - 99) == {"gpu_samples": 0}
    finally:
        sampler.close()
