"""Pushes between two processes through real NIXL agents, checked byte for byte.

One P and one D worker process serve every case (``kvpush_pair``); each case
starts fresh engines (a ``Sender`` in P, a ``Receiver`` in D) over fresh test
caches, drives requests, and compares D's whole cache, read back through the
backend, with what the suite's own logical model says D must hold: the
requested tokens of the shared heads replaced, every other byte unchanged.
P's cache must also be unchanged by the push. Cases run in file order; the
last two check that nothing leaked and that the workers exit 0.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvpush.conformance.model import Geom, Req, apply_push, assert_same, make_requests, payload
from kvpush.conformance.target import Target
from kvpush.conformance.worker import Node, Pair
from kvpush.core.outcome import Result

STAGING = 4 << 20
RESULT_TIMEOUT_S = 30.0
_ids = itertools.count()


@pytest.fixture(scope="module")
def nodes(kvpush_pair: Pair) -> tuple[Node, Node]:
    return kvpush_pair.ready()


@pytest.fixture(scope="module")
def direct_ok(kvpush_target: Target) -> bool:
    """Whether direct WRITEs into the KV regions are possible (the backend's ``capabilities.direct``)."""
    backend = kvpush_target.make()
    try:
        return backend.capabilities.direct
    finally:
        backend.close()


def cfg(plan: str, **extra: Any) -> dict[str, Any]:
    """Engine config forcing ``plan``; D reserves staging for every request when the plan is staged."""
    return {"plan": plan, "staging_bytes": STAGING, "staged_min_descriptors": 1, "peer_copy": False, **extra}


def need_plan(plan: str, direct_ok: bool) -> None:
    if plan == "direct" and not direct_ok:
        pytest.skip("backend's capabilities.direct is False (its KV is not registered): only staged plans apply")


@contextmanager
def engines(
    p: Node,
    d: Node,
    pg: Geom,
    dg: Geom,
    p_cfg: dict[str, Any],
    d_cfg: dict[str, Any],
    seeds: tuple[int, int],
    refs: tuple[bool, bool] = (False, False),
    name: str = "",
) -> Iterator[tuple[str, tuple[str, int, int]]]:
    """A P engine and a D engine over fresh caches; closed afterwards, checking nothing is left of them."""
    k = f"{name or 'c'}{next(_ids)}"
    addr = p.call("sender", k + "p", pg, p_cfg, "P" + k, seeds[0], refs[0])
    try:
        d.call("receiver", k + "d", dg, d_cfg, "D" + k, seeds[1], refs[1])
        try:
            yield k, (addr[0], addr[1], 1)
        finally:
            check_closed(d, k + "d")
    finally:
        check_closed(p, k + "p")


def check_closed(node: Node, key: str) -> None:
    report = node.call("close", key)
    assert report == {"registered_after_close": 0, "thread_alive": False}, f"{node.name} {key}: {report}"
    crashes = node.call("leaks")["crashes"]
    assert not crashes, f"exceptions escaped into {node.name}'s engine loop:\n" + "\n".join(crashes)


def by_rid(results: list[Result]) -> dict[str, Result]:
    return {r.request_id: r for r in results}


def push(
    p: Node, d: Node, k: str, peer: tuple[str, int, int], reqs: list[Req]
) -> tuple[dict[str, Result], dict[str, Result]]:
    """Run ``reqs``: even ones registered by D first, odd ones finished on P first; all must succeed."""
    d_first, p_first = reqs[0::2], reqs[1::2]
    for r in d_first:
        d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
    for r in p_first:
        p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
    for r in d_first:
        p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
    for r in p_first:
        d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
    d_res = by_rid(d.call("results", k + "d", len(reqs), RESULT_TIMEOUT_S, timeout=RESULT_TIMEOUT_S + 10))
    p_res = by_rid(p.call("results", k + "p", len(reqs), RESULT_TIMEOUT_S, timeout=RESULT_TIMEOUT_S + 10))
    assert sorted(d_res) == sorted(r.d_rid for r in reqs), f"D answered {sorted(d_res)}"
    assert sorted(p_res) == sorted(r.p_rid for r in reqs), f"P answered {sorted(p_res)}"
    failed = [x for x in [*d_res.values(), *p_res.values()] if not x.ok]
    assert not failed, failed
    return d_res, p_res


def check_bytes(
    p: Node, d: Node, k: str, pg: Geom, dg: Geom, seeds: tuple[int, int], reqs: list[Req], p_data: int | None = None
) -> None:
    """D holds exactly the pushed tokens over its own bytes; P's cache is what P wrote."""
    src = payload(pg, seeds[0] if p_data is None else p_data)
    assert_same(p.call("snapshot", k + "p"), src, pg, "P's cache")
    expected = payload(dg, seeds[1])
    for r in reqs:
        apply_push(expected, dg, src, pg, r)
    assert_same(d.call("snapshot", k + "d"), expected, dg)


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_random_block_sets(nodes: tuple[Node, Node], direct_ok: bool, plan: str) -> None:
    """Contract (push, byte-exact): requests over random P and D block sets, of random lengths, some
    shorter than a block, some after a prefix D already holds, one with no new tokens, registered and
    finished in both orders, arrive byte-exact through a direct or a staged plan."""
    need_plan(plan, direct_ok)
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96)
    seeds = (100, 200)
    reqs = make_requests(np.random.default_rng(1), 12, pg, dg, f"rb{plan}")
    with engines(p, d, pg, dg, cfg(plan), cfg(plan), seeds, name=plan) as (k, peer):
        push(p, d, k, peer, reqs)
        check_bytes(p, d, k, pg, dg, seeds, reqs)
        st = p.call("stats", k + "p")
        nonempty = sum(r.n > r.start for r in reqs)
        assert st.get(f"plan_{plan}_total", 0) == nonempty, st  # the plan really was the one asked for


def test_pushes_larger_than_the_staging_region_go_through_it_in_rounds(nodes: tuple[Node, Node]) -> None:
    """Contract (push in rounds, byte-exact): pushes far larger than D's staging region go through a ring of it
    (``kvpush.core.rounds``), part by part, each slot written again only after D unpacked the part before it
    there: parts of whole regions, parts cutting a region in chunks, and a push that fits one slot, all
    byte-exact through this backend's packs and unpacks, registered and finished in both orders."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64, layers=8), Geom(num_blocks=96, layers=8)  # 16 regions of 64 bytes a token
    seeds = (150, 250)
    rng = np.random.default_rng(15)
    reqs = [
        Req(f"rr-t{i}", f"rr-p{i}", f"rr-d{i}", pb, db, n, 0)
        for i, (n, pb, db) in enumerate(
            (n, [int(b) for b in rng.choice(64, -(-n // 16), replace=False)], dblocks)
            for n, dblocks in (
                (60, [90, 3, 47, 12]),
                (300, [int(b) for b in rng.permutation(range(20, 40))]),
                (10, [70]),
            )
        )
    ]
    ring = {"staging_bytes": 16 << 10, "min_part_bytes": 4 << 10, "ring_slots": 4, "staged_min_descriptors": 1}
    ring["peer_copy"] = False
    with engines(p, d, pg, dg, {**ring, "plan": "staged"}, ring, seeds, name="rounds") as (k, peer):
        for r in reqs:  # one at a time: each takes the whole region
            push(p, d, k, peer, [r])
        check_bytes(p, d, k, pg, dg, seeds, reqs)
        st = p.call("stats", k + "p")
        assert (st.get("plan_rounds_total", 0), st.get("plan_staged_total", 0)) == (2, 1), st


BLOCK_PAIRS = [
    (16, 32, "NHD", "NHD", "direct"),
    (32, 16, "NHD", "HND", "staged"),
    (16, 64, "HND", "NHD", "direct"),
    (64, 16, "HND", "HND", "staged"),
    (8, 24, "HND", "NHD", "staged"),
]


@pytest.mark.parametrize(("pbs", "dbs", "porder", "dorder", "plan"), BLOCK_PAIRS)
def test_block_size_pairs(
    nodes: tuple[Node, Node], direct_ok: bool, pbs: int, dbs: int, porder: str, dorder: str, plan: str
) -> None:
    """Contract (push, byte-exact): P and D with different block sizes and in-block orders (NHD/HND)
    exchange KV byte-exact: a token lands in D's block and slot for its position, whatever the sizes."""
    need_plan(plan, direct_ok)
    p, d = nodes
    pg = Geom(num_blocks=96, block_size=pbs, order=porder)
    dg = Geom(num_blocks=96, block_size=dbs, order=dorder)
    seeds = (pbs, 1000 + dbs)
    reqs = make_requests(np.random.default_rng(pbs * 100 + dbs), 6, pg, dg, f"bs{pbs}-{dbs}", max_tokens=160)
    with engines(p, d, pg, dg, cfg(plan), cfg(plan), seeds, name="bs") as (k, peer):
        push(p, d, k, peer, reqs)
        check_bytes(p, d, k, pg, dg, seeds, reqs)


@pytest.mark.parametrize("shape", ["coalesced", "uncoalesced"])
def test_coalesced_and_uncoalesced_descriptors(nodes: tuple[Node, Node], direct_ok: bool, shape: str) -> None:
    """Contract (push, byte-exact): direct WRITEs whose descriptors span many blocks (consecutive block
    ids, merged by the planner: fewer descriptors than pieces) and WRITEs of one descriptor per token and
    head (NHD into HND: nothing merges) both land exactly; the backend's registered memory is addressable
    at any offset and length NIXL is given."""
    need_plan("direct", direct_ok)
    p, d = nodes
    if shape == "coalesced":
        pg, dg = Geom(num_blocks=64), Geom(num_blocks=64)
    else:
        pg, dg = Geom(num_blocks=64), Geom(num_blocks=64, order="HND")
    seeds = (300, 400)
    reqs = make_requests(np.random.default_rng(4), 6, pg, dg, shape, max_tokens=100, contiguous=shape == "coalesced")
    with engines(p, d, pg, dg, cfg("direct"), cfg("direct"), seeds, name=shape[:3]) as (k, peer):
        _, p_res = push(p, d, k, peer, reqs)
        check_bytes(p, d, k, pg, dg, seeds, reqs)
    for r in reqs:
        st = p_res[r.p_rid].stats
        if r.n == r.start:
            continue
        spans_blocks = (r.start // pg.block_size) != ((r.n - 1) // pg.block_size)
        if shape == "coalesced" and spans_blocks:  # consecutive blocks on both sides merge into one run
            assert st.descriptors < st.pieces, (r, st)
        if shape == "uncoalesced":
            assert st.descriptors == st.pieces, (r, st)


def test_auto_plan_honours_capabilities(nodes: tuple[Node, Node], direct_ok: bool) -> None:
    """Contract (push, byte-exact): with the default ``plan: auto`` and no fragmentation to make staging
    pay, pushes succeed byte-exact, and go staged exactly when the backend declares it cannot let NIXL
    access its KV in place: the operator never has to set ``plan: staged`` for it."""
    p, d = nodes
    pg, dg = Geom(num_blocks=48), Geom(num_blocks=48)
    seeds = (700, 800)
    reqs = make_requests(np.random.default_rng(7), 5, pg, dg, "auto", contiguous=True)
    auto = {"plan": "auto", "staging_bytes": STAGING, "peer_copy": False}
    with engines(p, d, pg, dg, auto, auto, seeds, name="auto") as (k, peer):
        push(p, d, k, peer, reqs)
        check_bytes(p, d, k, pg, dg, seeds, reqs)
        st = p.call("stats", k + "p")
    nonempty = sum(r.n > r.start for r in reqs)
    assert st.get("plan_staged_total" if not direct_ok else "plan_direct_total", 0) == nonempty, st


@pytest.mark.parametrize("direction", ["backend-to-host", "host-to-backend"])
def test_interoperates_with_the_host_reference(nodes: tuple[Node, Node], direct_ok: bool, direction: str) -> None:
    """Contract (describe, across backends): pushes between this backend and the host reference backend are
    byte-exact both ways, so the layout means the same bytes to every peer; a mistake made identically on
    P and D (e.g. K and V regions swapped) cancels out between two instances of one backend, not here."""
    p, d = nodes
    plan = "direct" if direct_ok else "staged"
    pg, dg = Geom(num_blocks=48), Geom(num_blocks=48, block_size=32, order="HND")
    seeds = (500, 600)
    refs = (False, True) if direction == "backend-to-host" else (True, False)
    reqs = make_requests(np.random.default_rng(5), 6, pg, dg, direction)
    with engines(p, d, pg, dg, cfg(plan), cfg(plan), seeds, refs=refs, name="ref") as (k, peer):
        push(p, d, k, peer, reqs)
        check_bytes(p, d, k, pg, dg, seeds, reqs)


def push_after_registration(
    p: Node, d: Node, k: str, peer: tuple[str, int, int], req: Req, p_op: str, *p_args: Any
) -> tuple[Result, Result, Any]:
    """D registers, P sees it, then P runs ``p_op`` (how the prefill is handed over); both results must be ok.

    Returns D's and P's results and what ``p_op`` returned.
    """
    d.call("register", k + "d", req.tid, req.d_rid, peer, req.d_blocks, req.n, req.start)
    assert p.call("wait_stat", k + "p", "registrations_total", 1, 10.0), "D's registration never reached P"
    value = p.call(p_op, k + "p", req.tid, req.p_rid, req.p_blocks, req.n, *p_args)
    [dr] = d.call("results", k + "d", 1, RESULT_TIMEOUT_S, timeout=RESULT_TIMEOUT_S + 10)
    [pr] = p.call("results", k + "p", 1, RESULT_TIMEOUT_S, timeout=RESULT_TIMEOUT_S + 10)
    assert dr.ok and pr.ok, (dr, pr)
    return dr, pr, value


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_data_written_just_before_handoff_arrives(nodes: tuple[Node, Node], direct_ok: bool, plan: str) -> None:
    """Contract (ordering): KV written into P's cache immediately before the prefill is handed over, with
    the marker from record_ready() taken right after the write, is what D receives: the push waits for the
    write (wait_ready) and never ships the bytes that were there before."""
    need_plan(plan, direct_ok)
    p, d = nodes
    pg = dg = Geom(num_blocks=32, layers=4)
    seeds, fresh = (700, 800), 701
    req = Req("ord", "ord-p", "ord-d", list(range(31, 1, -1)), list(range(30)), 30 * 16)
    with engines(p, d, pg, dg, cfg(plan), cfg(plan), seeds, name="ord") as (k, peer):
        push_after_registration(p, d, k, peer, req, "prefill", fresh)
        check_bytes(p, d, k, pg, dg, seeds, [req], p_data=fresh)


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_data_written_just_before_a_parked_handoff_arrives(
    nodes: tuple[Node, Node], direct_ok: bool, plan: str
) -> None:
    """Contract (ordering), a sequential router's order: KV written right before the prefill is handed over
    and parked (marker from record_ready() right after the write), D registering only afterwards, is what D
    receives. A staged push may be packed at hand-over, before any registration: that pack waits for the
    write too (queued behind the marker on a backend that chains, else only after it is reached)."""
    need_plan(plan, direct_ok)
    p, d = nodes
    pg = dg = Geom(num_blocks=32, layers=4)
    seeds, fresh = (700, 800), 702
    req = Req("ordp", "ordp-p", "ordp-d", list(range(31, 1, -1)), list(range(30)), 30 * 16)
    with engines(p, d, pg, dg, cfg(plan), cfg(plan), seeds, name="ordp") as (k, peer):
        p.call("prefill", k + "p", req.tid, req.p_rid, req.p_blocks, req.n, fresh)
        d.call("register", k + "d", req.tid, req.d_rid, peer, req.d_blocks, req.n, req.start)
        [dr] = d.call("results", k + "d", 1, RESULT_TIMEOUT_S, timeout=RESULT_TIMEOUT_S + 10)
        [pr] = p.call("results", k + "p", 1, RESULT_TIMEOUT_S, timeout=RESULT_TIMEOUT_S + 10)
        assert dr.ok and pr.ok, (dr, pr)
        check_bytes(p, d, k, pg, dg, seeds, [req], p_data=fresh)


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_layer_by_layer_push_waits_for_each_layer(nodes: tuple[Node, Node], direct_ok: bool, plan: str) -> None:
    """Contract (ordering, layer-wise): P announces a prefill, then each layer is written (queued like a model
    kernel) and reported ready under the marker recorded right after it; the push thread polls markers
    (poll_ready) and posts each layer when its marker is reached. D receives exactly the bytes written,
    in one part per group of ready layers, never a layer's earlier content."""
    need_plan(plan, direct_ok)
    p, d = nodes
    pg = dg = Geom(num_blocks=32, layers=4)
    seeds, fresh = (710, 810), 711
    req = Req("lw", "lw-p", "lw-d", list(range(31, 1, -1)), list(range(30)), 30 * 16)
    with engines(
        p, d, pg, dg, cfg(plan, layerwise_min_part_bytes=0, layerwise_lead_layers=1000), cfg(plan), seeds, name="lw"
    ) as (k, peer):
        dr, pr, layers = push_after_registration(p, d, k, peer, req, "layered_prefill", fresh)
        assert 1 <= dr.stats.parts == pr.stats.parts <= layers, (dr.stats, pr.stats)
        check_bytes(p, d, k, pg, dg, seeds, [req], p_data=fresh)


def test_reregistration_after_deregistration(nodes: tuple[Node, Node], direct_ok: bool) -> None:
    """Contract (registrations): after both engines close (their memory deregistered, caches freed), new
    engines with the same names over new caches in the same processes (addresses may be reused) register
    again and push byte-exact; nothing of the old registration leaks into the new transfers."""
    p, d = nodes
    plan = "direct" if direct_ok else "staged"
    g = Geom(num_blocks=32)
    reqs = make_requests(np.random.default_rng(6), 4, g, g, "rereg")
    for seeds in ((900, 901), (902, 903)):
        with engines(p, d, g, g, cfg(plan), cfg(plan), seeds, name="rereg") as (k, peer):
            push(p, d, k, peer, reqs)
            check_bytes(p, d, k, g, g, seeds, reqs)


def test_teardown_leaves_nothing(nodes: tuple[Node, Node]) -> None:
    """Contract (teardown): after every engine closed, neither process has an open engine, a kvpush
    thread still running, or an exception that escaped an engine loop."""
    time.sleep(0.1)
    for node in nodes:
        leaks = node.call("leaks")
        assert leaks == {"open_engines": [], "threads": [], "crashes": []}, f"{node.name}: {leaks}"


def test_workers_exit_cleanly(kvpush_pair: Pair) -> None:
    """Contract (teardown): both processes close their NIXL agents and backends and exit by themselves
    with status 0 (no hang on a leftover thread, no crash in interpreter teardown)."""
    codes = kvpush_pair.stop()
    reports = (kvpush_pair.p.exit_report, kvpush_pair.d.exit_report)
    assert codes == (0, 0), f"worker exit codes {codes}; exit reports {reports}"
    for rep in reports:
        assert rep == {"open_engines": [], "threads": [], "crashes": []}, reports
