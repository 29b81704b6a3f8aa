"""A GDN hybrid's push through real NIXL agents in two processes: every state byte lands where vLLM's GDN reads it.

P and D each hold the cache vLLM 0.32 allocates for a Qwen3-Next-shaped
model (three GDN layers, one attention layer, one shared pool;
``helpers_gdn``), described by the connector's own code. P's pool is random,
D's the sentinel. After one push, D's pool must equal the reference built
through vLLM's own views (the GDN layer's ``bind_kv_cache`` conv/ssm views,
the attention layer's ``[B, H, N, C]`` view): each GDN layer's conv and ssm
state of P's state block in D's state block, the attention blocks of the
``n - 1`` tokens P computed, and nothing else changed. A D whose state
differs (another ssm dtype) is refused at its hello, with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")
pytest.importorskip(
    "vllm.v1.kv_cache_layout",
    reason="the GDN caches here are built by vLLM 0.29+'s allocate_kv_cache (KV-cache views); 0.24's per-state "
    "lists are checked in test_vllm_layout_versions, and a hybrid D needs failed_recving (vLLM 0.32+)",
)

import helpers_gdn as gdn  # noqa: E402
from procs import SENTINEL, Node  # noqa: E402

P_BLOCKS = [[5], [9], [2], [3, 7, 12]]  # GDN layers 0-2: one running-state block each; attention: the tokens'
D_BLOCKS = [[11], [1], [6], [4, 8, 20]]


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Node, Node]]:
    p, d = Node("gdn-p"), Node("gdn-d")
    try:
        yield p, d
    finally:
        for n in (p, d):
            n.stop()


def reference(p_pool: np.ndarray, n: int) -> np.ndarray:
    """D's pool after the push, written through vLLM's views only."""
    config = gdn.kv_cache_config()
    want = np.full_like(p_pool, SENTINEL)
    src, dst = gdn.views_over(torch.from_numpy(p_pool.copy()), config), gdn.views_over(torch.from_numpy(want), config)
    for g, name in enumerate(gdn.LAYERS[:3]):
        (p_block,), (d_block,) = P_BLOCKS[g], D_BLOCKS[g]
        for s, d in zip(src[name], dst[name], strict=True):  # (conv, ssm)
            d[d_block] = s[p_block]
    attn = gdn.LAYERS[3]
    for i in range(-(-n // gdn.BS)):  # vLLM's CPU attention packs a block its own way: whole blocks move
        dst[attn][D_BLOCKS[3][i]] = src[attn][P_BLOCKS[3][i]]
    return want


@pytest.mark.parametrize(("n", "peer"), [(1, False), (31, False), (33, False), (64, False), (33, True), (64, True)])
def test_state_and_attention_land_where_vllm_reads_them(nodes: tuple[Node, Node], n: int, peer: bool) -> None:
    """``peer``: with peer copies on both sides (P's backend writes D's pool itself, every group's pieces in
    one copy per run of regions that share them, ``core/plan.group_runs``)."""
    p, d = nodes
    tid, cfg = f"gdn-{n}-{peer}", {"peer_copy": True} if peer else {}
    addr = p.call("gdn_engine", f"p{n}", "sender", cfg, "gdn-p", 100 + n)
    d.call("gdn_engine", f"d{n}", "receiver", cfg, "gdn-d", None)
    try:
        p_pool = p.call("gdn_pool", f"p{n}")
        p.call("gdn_prefill", f"p{n}", tid, "rp", P_BLOCKS, n)
        d.call("gdn_register", f"d{n}", tid, "rd", (*addr, 1), D_BLOCKS, n)
        (res,) = d.call("results", f"d{n}", 1, 30.0)
        assert res.ok, res.reason
        (sent,) = p.call("results", f"p{n}", 1, 30.0)
        assert sent.ok, sent.reason
        got, want = d.call("gdn_pool", f"d{n}"), reference(p_pool, n)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{bad.size} bytes differ, first at page {bad[0] // gdn.PAGE} byte {bad[0] % gdn.PAGE}"
        st = p.call("stats", f"p{n}")
        assert (st.get("plan_peer_total", 0), st.get("descriptors_total", 0) == 0) == (int(peer), peer), st
    finally:
        p.call("close", f"p{n}")
        d.call("close", f"d{n}")


def test_a_d_whose_state_differs_is_refused_with_the_reason(nodes: tuple[Node, Node]) -> None:
    """D's ssm state in bf16 (P's fp32): a different state per request; D's hello is refused, its request
    fails with the reason, and D's pool is untouched."""
    p, d = nodes
    addr = p.call("gdn_engine", "px", "sender", {"prefill_lease_s": 2.0}, "gdn-p", 7)
    d.call("gdn_engine", "dx", "receiver", {}, "gdn-d", None, "bfloat16")
    try:
        p.call("gdn_prefill", "px", "gdn-x", "rp", P_BLOCKS, 40)
        d.call("gdn_register", "dx", "gdn-x", "rd", (*addr, 1), D_BLOCKS, 40)
        (res,) = d.call("results", "dx", 1, 30.0)
        assert not res.ok and "bytes per request" in res.reason, res.reason
        assert (d.call("gdn_pool", "dx") == SENTINEL).all()
        (released,) = p.call("results", "px", 1, 30.0)  # P lets the prefill go at its lease
        assert not released.ok
    finally:
        p.call("close", "px")
        d.call("close", "dx")
