"""Staging in rounds end to end: real NIXL agents in separate processes, pushes far larger than D's staging region.

D's region is 1 MiB; the pushes are up to 128 MiB, with D's blocks shuffled so that D wants them staged.
Each goes through a ring of that region (``kvpush.core.rounds``): parts cycle through its slots, D credits
each part it unpacked, P writes a slot again only after its credit. Checked byte-exact against the
conformance model, with the plan, the parts, the credits and the slots given back counted.
"""

from __future__ import annotations

import numpy as np
from procs import Geom, Node, assert_same, make_cache
from test_push_nixl import _key, assert_idle, by_rid, engines

from kvpush.conformance.model import Req, apply_push

REGION = 1 << 20
PART = 256 << 10
RING = {"staging_bytes": REGION, "min_part_bytes": PART, "ring_slots": 4}
# 4 layers x K,V x 8 heads x 256 bytes: 16 KiB a token, 32 KiB a region's block of 16 tokens.
BIG = Geom(layers=4, num_blocks=1024, num_heads=8, head_dim=256)


def _requests(rng: np.random.Generator, k: str, tokens: list[int]) -> list[Req]:
    """Requests of these lengths, P's and D's blocks shuffled (D's disjoint)."""
    bs = BIG.block_size
    d_free = [int(b) for b in rng.permutation(BIG.num_blocks)]
    out = []
    for i, n in enumerate(tokens):
        nb = -(-n // bs)
        p_blocks = [int(b) for b in rng.choice(BIG.num_blocks, nb, replace=False)]
        d_blocks, d_free = d_free[:nb], d_free[nb:]
        out.append(Req(f"{k}-t{i}", f"{k}-p{i}", f"{k}-d{i}", p_blocks, d_blocks, n, 0))
    return out


def test_a_push_larger_than_ds_region_goes_through_it_in_rounds(nodes: tuple[Node, Node]) -> None:
    """A 128 MiB push (and a smaller one whose region share is not a whole number of slots) through a 1 MiB
    region: byte-exact, planned in rounds on P, unpacked part by part on D, credits counted, every slot back.
    P is told to stage (``plan``): with parts this small its cost model would rightly post these few
    thousand descriptors directly."""
    p, d = nodes
    k = _key("rounds")
    rng = np.random.default_rng(40)
    reqs = _requests(rng, k, [8192, 1234])  # 128 MiB, then 19.3 MiB (a region's share: 308.5 KiB)
    with (
        engines(p, "sender", [(k + "p", BIG, {**RING, "plan": "staged"}, "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", BIG, {**RING, "staged_min_descriptors": 1}, "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            [res] = d.call("results", k + "d", 1, 120.0)
            assert res.ok, res
        p_res = by_rid(p.call("results", k + "p", len(reqs), 30.0))
        assert all(x.ok for x in p_res.values()), p_res
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(BIG, None)
        for r in reqs:
            apply_push(exp, BIG, src, BIG, r)
        assert_same(got, exp, BIG)
        pst, dst = p.call("stats", k + "p"), d.call("stats", k + "d")
        assert pst.get("plan_rounds_total", 0) == len(reqs), (pst, dst)
        # Region share of each request / the part size (a share above a part is cut in chunks), times regions.
        shares = [r.n * BIG.token_bytes for r in reqs]
        parts = sum(-(-s // PART) * 2 * BIG.layers for s in shares)
        assert pst.get("parts_total", 0) == parts and dst.get("parts_total", 0) >= parts, (pst, dst, parts)
        assert dst.get("staging_too_small_total", 0) == 0, dst
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")
