"""Staging in another memory kind than the KV, through real NIXL agents (UCX, LIBFABRIC).

A device whose transport cannot register its memory stages through host memory (the CUDA backend's
``staging=host``): the staged WRITE must name the staging buffers' memory kind on both sides (D's
comes in its hello), not the layout's, or NIXL finds no registration and every push fails.
"""

from __future__ import annotations

import numpy as np
from procs import Geom, Node
from test_async_copy_nixl import _reqs
from test_layerwise_nixl import _pushed_intact
from test_push_nixl import _cfg, _key, engines

ELSEWHERE = "helpers_staged_elsewhere:StagedElsewhereBackend"


def test_staging_in_host_memory_for_device_kv(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32, order="HND")
    k = _key("elsewhere")
    reqs = _reqs(k, np.random.default_rng(11), 4)
    for n in (p, d):
        n.call("use_backend", ELSEWHERE)
    try:
        with (
            engines(p, "sender", [(k + "p", pg, _cfg(), "P" + k)]) as [addr],
            engines(d, "receiver", [(k + "d", dg, _cfg(), "D" + k)]),
        ):
            for i, r in enumerate(reqs):  # both orders: D registers first, P's prefill first
                if i % 2:
                    p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
                d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
                if not i % 2:
                    p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            _, p_res = _pushed_intact(p, d, k, pg, dg, reqs)
            assert {str(x.stats.plan) for x in p_res.values()} == {"staged"}, p_res
    finally:
        for n in (p, d):
            n.call("use_backend", None)
