"""Direct pushes posted by index into NIXL's prepared lists, or built from the strips: real agents in
separate processes, byte-exact.

P prepares its list when it starts and a D rank's when that rank's hello loads its
metadata (``kvpush.engine.by_index``); a direct part of whole blocks goes as one
WRITE by index where that is cheapest, and a part with partial blocks as one WRITE
built for the request from the strips where that posts fewer descriptors than
today's. Each case checks D's whole cache against the conformance model (every
byte pushed, no byte more: blocks and tokens D did not ask for keep the
sentinel), and P's ``parts_by_index_total`` and ``parts_by_strip_total`` say which
way each part went, so a case cannot pass on today's path alone. P weighs an index
at ``INDEX_US`` on every NIXL (``op_index_cost``): NIXL 1.3 holds prepared lists
entry by entry, where an index costs more than a descriptor built and P would
build every part for the request (``tests/unit/test_indexed.py``), leaving the
by-index path unexercised on that version.
"""

from __future__ import annotations

from typing import Any

import pytest
from procs import Geom, Node, assert_same, make_cache
from test_push_nixl import _key, assert_idle, by_rid, engines

from kvpush.conformance.model import Req, apply_push
from kvpush.core.indexed import INDEX_US


def _cfg() -> dict[str, Any]:
    return {"plan": "direct"}


def _check(p: Node, d: Node, pkey: str, dkey: str, pg: Geom, dg: Geom, reqs: list[Req]) -> None:
    """Every request ended well on both sides and D holds exactly what the model says."""
    d_res = by_rid(d.call("results", dkey, len(reqs), 20.0))
    p_res = by_rid(p.call("results", pkey, len(reqs), 10.0))
    assert all(x.ok for x in [*d_res.values(), *p_res.values()]), [*d_res.values(), *p_res.values()]
    exp = make_cache(dg, None)
    src = p.call("snapshot", pkey)
    for r in reqs:
        apply_push(exp, dg, src, pg, r)
    assert_same(d.call("snapshot", dkey), exp, dg)


@pytest.mark.parametrize("blocks_first", [False, True], ids=["split-kv", "blocks-first"])
def test_direct_pushes_by_index_and_by_strip_are_byte_exact(nodes: tuple[Node, Node], blocks_first: bool) -> None:
    """Whole blocks, fragmented: by index. A partial last block, or a first block D partly holds: built for
    the request, from the strips where they merge a layer's K and V (blocks first), else today's. Contiguous:
    today's where it posts one descriptor a region (split K/V), the strips where today's posts one a block
    and region (blocks first). Shorter than a block (nothing whole): today's."""
    p, d = nodes
    pg, dg = Geom(num_blocks=48, blocks_first=blocks_first), Geom(num_blocks=64, blocks_first=blocks_first)
    k = _key("byindex")
    reqs = [
        Req(f"{k}-whole", f"{k}-p0", f"{k}-d0", [5, 17, 2, 30], [40, 3, 22, 9], 64),
        Req(f"{k}-tail", f"{k}-p1", f"{k}-d1", [6, 18, 3, 31], [41, 4, 23, 10], 55),
        Req(f"{k}-prefix", f"{k}-p2", f"{k}-d2", [7, 19, 4, 32], [42, 5, 24, 11], 64, 20),
        Req(f"{k}-contiguous", f"{k}-p3", f"{k}-d3", list(range(36, 44)), list(range(50, 58)), 128),
        Req(f"{k}-short", f"{k}-p4", f"{k}-d4", [0], [60], 7),
    ]
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(), "D" + k)]),
    ):
        p.call("index_cost", k + "p", INDEX_US)
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        _check(p, d, k + "p", k + "d", pg, dg, reqs)
        st = p.call("stats", k + "p")
        assert st.get("plan_direct_total") == len(reqs), st
        assert st.get("parts_by_index_total", 0) == 1, st
        assert st.get("parts_by_strip_total", 0) == (3 if blocks_first else 0), st
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_a_d_rank_that_restarts_is_written_by_index_into_its_new_memory(nodes: tuple[Node, Node]) -> None:
    """A D rank restarts twice (same engine id and rank, so the same NIXL agent name, new memory): each life's
    hello has P prepare a list over that life's memory, and every push lands there, byte-exact: one of whole
    blocks by index, one with a partial last block from the strips. The memory of the lives before stays
    mapped, so a list left over one of them would have its bytes written there, not into the live cache."""
    p, d = nodes
    g = Geom(num_blocks=64, blocks_first=True)
    k = _key("byindex-restart")
    with engines(p, "sender", [(k + "p", g, _cfg(), "P" + k)]) as [addr]:
        p.call("index_cost", k + "p", INDEX_US)
        for life in range(3):
            dkey = f"{k}d{life}"
            d.call("receiver", dkey, g, _cfg(), "D" + k)
            try:
                reqs = [
                    Req(f"{k}-{life}-{i}", f"{k}-p{life}{i}", f"{k}-d{life}{i}", blocks, blocks[::-1], n)
                    for i, (blocks, n) in enumerate([(list(range(0, 32, 2)), 256), (list(range(1, 32, 2)), 249)])
                ]
                for r in reqs:
                    p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
                    d.call("register", dkey, r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
                _check(p, d, k + "p", dkey, g, g, reqs)
            finally:
                d.call("close", dkey, True)  # its memory stays mapped
            st = p.call("stats", k + "p")
            assert (st.get("parts_by_index_total", 0), st.get("parts_by_strip_total", 0)) == (life + 1, life + 1), st
        assert p.call("stats", k + "p")["peers"] == 1
        assert_idle(p, k + "p")
