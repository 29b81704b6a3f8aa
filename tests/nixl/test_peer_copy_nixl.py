"""Peer copies end to end: real NIXL agents in separate processes on one host, P's backend writing D's blocks.

With ``peer_copy`` on both sides, D offers its KV in its hello, P maps it
(the host backend: cross-memory attach) and every push is ``PlanKind.PEER``:
P copies the pieces itself and NIXL carries only each part's notification.
D's cache must equal the reference model byte for byte, in both orders and
with different block sizes; a D that does not offer gets NIXL WRITEs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from procs import Geom, Node, make_cache
from test_async_copy_nixl import deferred
from test_push_nixl import _cfg, _key, assert_idle, assert_same, by_rid, engines

from kvpush.conformance.model import apply_push, make_requests


def _push_all(p: Node, d: Node, k: str, reqs: list, addr: tuple) -> tuple[dict, dict]:
    """Half the requests registered first, half prefilled first; every result back."""
    peer = (addr[0], addr[1], 1)
    d_first, p_first = reqs[0::2], reqs[1::2]
    for r in d_first:
        d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
    for r in p_first:
        p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
    time.sleep(0.2)
    for r in d_first:
        p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
    for r in p_first:
        d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
    d_res = by_rid(d.call("results", k + "d", len(reqs), 30.0))
    p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
    return d_res, p_res


@pytest.mark.parametrize(("pbs", "dbs", "dorder"), [(16, 16, "NHD"), (16, 32, "HND")])
def test_peer_copies_land_byte_exact_in_both_orders(nodes: tuple[Node, Node], pbs: int, dbs: int, dorder: str) -> None:
    p, d = nodes
    pg, dg = Geom(num_blocks=128, block_size=pbs), Geom(num_blocks=256, block_size=dbs, order=dorder)
    k = _key("peer")
    reqs = make_requests(np.random.default_rng(pbs + dbs), 16, pg, dg, k, max_tokens=300)
    cfg = _cfg(peer_copy=True, staged_min_descriptors=1)
    with (
        engines(p, "sender", [(k + "p", pg, cfg, "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, cfg, "D" + k)]),
    ):
        d_res, p_res = _push_all(p, d, k, reqs, addr)
        assert len(d_res) == len(reqs) and all(x.ok for x in d_res.values()), d_res
        assert len(p_res) == len(reqs) and all(x.ok for x in p_res.values()), p_res
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(got, exp, dg)
        st = p.call("stats", k + "p")
        nonempty = sum(r.n > r.start for r in reqs)
        assert st.get("plan_peer_total", 0) == nonempty, st
        assert st.get("plan_direct_total", 0) == 0 and st.get("plan_staged_total", 0) == 0, st
        assert st.get("descriptors_total", 0) == 0, st  # no byte went through a NIXL WRITE
        # D wants staging for every push here (staged_min_descriptors=1), but P's hello reply said it maps
        # D: no slot is held for bytes that land in D's blocks.
        assert d.call("stats", k + "d").get("staging_grants_total", 0) == 0
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_a_d_that_does_not_offer_gets_nixl_writes(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64)
    k = _key("nopeer")
    reqs = make_requests(np.random.default_rng(3), 6, pg, dg, k, max_tokens=200)
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(peer_copy=True), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(staged_min_descriptors=1), "D" + k)]),
    ):
        d_res, _ = _push_all(p, d, k, reqs, addr)
        assert all(x.ok for x in d_res.values()), d_res
        # Not mapped: D keeps granting the staging it wants (the counter the peer test reads as 0 counts).
        assert d.call("stats", k + "d").get("staging_grants_total", 0) > 0
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(got, exp, dg)
        st = p.call("stats", k + "p")
        assert st.get("plan_peer_total", 0) == 0 and st.get("descriptors_total", 0) > 0, st


@pytest.mark.parametrize("announced", [False, True])
def test_d_is_told_of_a_peer_copy_only_once_it_landed(nodes: tuple[Node, Node], announced: bool) -> None:
    """A backend whose peer copies land later (and that queues them behind the KV's marker): P notifies D
    only once the copy's marker is reached, so D never reports blocks that still hold the sentinel."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32, order="HND")
    k = _key("peerlate")
    # No empty request: announced, its bare completion ends the transfer before the prefill is reported
    # finished, which P then parks until its lease (an existing edge, not the peer copy's).
    reqs = [r for r in make_requests(np.random.default_rng(11), 6, pg, dg, k, max_tokens=200) if r.n > r.start]
    cfg = _cfg(peer_copy=True)
    with (
        deferred(p, d),
        engines(p, "sender", [(k + "p", pg, cfg, "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, cfg, "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:
            if announced:
                p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
        time.sleep(0.2)
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        d_res = by_rid(d.call("results", k + "d", len(reqs), 20.0))
        assert len(d_res) == len(reqs) and all(x.ok for x in d_res.values()), d_res
        assert len(p.call("results", k + "p", len(reqs), 10.0)) == len(reqs)
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(got, exp, dg)
        assert p.call("stats", k + "p").get("plan_peer_total", 0) == sum(r.n > r.start for r in reqs)
        assert_idle(p, k + "p")
