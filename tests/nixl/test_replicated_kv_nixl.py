"""KV held whole by every TP rank (MLA's latent cache: one head slot), through real NIXL agents.

P at TP 2 into D at TP 1: the latent is the same on both P ranks, so D takes
it from one (``kvpush.core.topology``: D rank ``d`` from P rank ``d % p_tp``) and
expects exactly that rank's completion. The other P rank writes nothing and
must not hold its finished prefill for a lease: D tells it at registration
that its copy is not needed, and it releases the prefill at once, as a
success, whether the prefill finished before or after that word came.
"""

from __future__ import annotations

import time

import numpy as np
from procs import Geom, Node, assert_same, make_cache
from test_push_nixl import _cfg, _key, by_rid, engines

from kvpush.conformance.model import apply_push, make_requests
from kvpush.core.outcome import Cause
from kvpush_tools.demo.launcher import free_port

LEASE_S = 60.0


def test_replicated_kv_is_written_by_one_p_rank_and_the_other_lets_go(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    base = free_port(span=2)  # P rank r binds base + r
    pgs = [Geom(num_blocks=64, num_heads=1, tp_rank=r, tp_size=2) for r in range(2)]
    dg = Geom(num_blocks=64, num_heads=1, block_size=32)
    k = _key("mla21")
    p_cfg = _cfg(side_channel_port=base, prefill_lease_s=LEASE_S)
    reqs = make_requests(np.random.default_rng(9), 6, pgs[0], dg, k, max_tokens=150)
    with (
        engines(p, "sender", [(f"{k}p{r}", pgs[r], p_cfg, "P" + k) for r in range(2)]),
        engines(d, "receiver", [(k + "d", dg, _cfg(), "D" + k)]),
    ):
        t0 = time.monotonic()
        for i, r in enumerate(reqs):
            if i % 2:  # half the prefills finish before D registers, half after
                for rank in range(2):
                    p.call("prefill", f"{k}p{rank}", r.tid, r.p_rid, r.p_blocks, r.n)
            d.call("register", k + "d", r.tid, r.d_rid, ("127.0.0.1", base, 2), r.d_blocks, r.n, r.start)
            if not i % 2:
                time.sleep(0.05)  # the registration (and P rank 1's "not needed") lands first
                for rank in range(2):
                    p.call("prefill", f"{k}p{rank}", r.tid, r.p_rid, r.p_blocks, r.n)
        d_res = by_rid(d.call("results", k + "d", len(reqs), 20.0))
        assert len(d_res) == len(reqs) and all(x.ok for x in d_res.values()), d_res
        writer = by_rid(p.call("results", f"{k}p0", len(reqs), 20.0))
        spare = by_rid(p.call("results", f"{k}p1", len(reqs), 20.0))
        assert time.monotonic() - t0 < LEASE_S / 2, "P rank 1 held its prefills for the lease"
        assert len(writer) == len(spare) == len(reqs)
        assert all(x.ok and x.cause is None for x in writer.values()), writer
        assert all(x.ok and x.cause is Cause.NOT_NEEDED for x in spare.values()), spare
        st0, st1 = p.call("stats", f"{k}p0"), p.call("stats", f"{k}p1")
        assert st0.get("plan_direct_total") == sum(r.n > r.start for r in reqs), st0
        assert not st1.get("plan_direct_total") and not st1.get("registrations_total"), st1
        for r in reqs:  # D counted one P rank's bytes, no more
            assert d_res[r.d_rid].stats.bytes == (r.n - r.start) * dg.head_dim * 2 * dg.layers, d_res[r.d_rid]
        exp = make_cache(dg, None)
        src = p.call("snapshot", f"{k}p0")
        for r in reqs:
            apply_push(exp, dg, src, pgs[0], r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
