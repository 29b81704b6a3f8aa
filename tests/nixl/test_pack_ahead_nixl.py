"""P's pack list built ahead, when the prefill is handed over, through real NIXL agents in two processes.

A staged payload follows P's in-block order (``kvpush/core/payload.py``), so P
builds its pack list from its own block ids as soon as a prefill is handed
over; a registration that arrives afterwards (what a sequential router always
does) takes that list instead of mapping the request again. The list fits only
a registration of exactly what was built (the whole prompt, all of P's heads):
a D with a prefix hit, fewer tokens, or only some of P's heads gets its list
at pairing. Every case checks D's whole cache against the conformance
reference, byte by byte, so a list used where it does not fit shows as wrong
bytes, and P's counters say which list the plan took.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from procs import Geom, Node, make_cache
from test_push_nixl import _cfg, _key, assert_idle, assert_same, by_rid, engines

from kvpush.conformance.model import Req, apply_push

SMALL = {"min_part_bytes": 0, "part_cost_us": 0}
"""Test caches are small: cut a staged push into exactly ``push_parts`` parts whatever its size."""


def _staged(**kw: object) -> dict[str, object]:
    return _cfg(plan="staged", **kw)


def _check(
    p: Node, d: Node, pkey: str, dkey: str, dg: Geom, pg: Geom, reqs: list[Req], src: np.ndarray | None = None
) -> dict[str, Any]:
    """Every transfer ok on both sides, D's cache as the reference says from ``src`` (P's cache now when
    not given), both sides idle; returns P's results by request id."""
    d_res = by_rid(d.call("results", dkey, len(reqs), 20.0))
    p_res = by_rid(p.call("results", pkey, len(reqs), 10.0))
    assert sorted(d_res) == sorted(r.d_rid for r in reqs), d_res
    assert all(x.ok for x in [*d_res.values(), *p_res.values()]), [*d_res.values(), *p_res.values()]
    src = p.call("snapshot", pkey) if src is None else src
    exp = make_cache(dg, None)
    for r in reqs:
        apply_push(exp, dg, src, pg, r)
    assert_same(d.call("snapshot", dkey), exp, dg)
    assert_idle(p, pkey)
    assert_idle(d, dkey)
    return p_res


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_registration_after_the_prefill_takes_the_list_built_at_hand_over(nodes: tuple[Node, Node], order: str) -> None:
    """The sequential router's order: P's prefills finish and are parked, their pack lists built then;
    D registers afterwards and every staged plan takes the list P already had."""
    p, d = nodes
    pg = Geom(num_blocks=128, order=order)
    dg = Geom(num_blocks=128, block_size=32, order="NHD" if order == "HND" else "HND")
    k = _key("ahead")
    rng = np.random.default_rng(17)
    reqs = [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", rng.permutation(128)[:8].tolist(), [4 * i + j for j in range(4)], n)
        for i, n in enumerate((128, 100, 37, 1))
    ]
    with (
        engines(p, "sender", [(k + "p", pg, _staged(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _staged(staged_min_descriptors=1), "D" + k)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        # Built when handed over, before any D rank said a word about these transfers.
        assert p.call("wait_stat", k + "p", "packs_ahead_total", len(reqs), 10.0)
        st = p.call("stats", k + "p")
        assert st["parked_prefills"] == len(reqs) and st.get("registrations_total", 0) == 0, st
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        _check(p, d, k + "p", k + "d", dg, pg, reqs)
        st = p.call("stats", k + "p")
        assert st.get("plan_staged_total") == len(reqs), st
        assert st.get("packs_ahead_used_total") == len(reqs), st


def test_registration_that_differs_from_the_list_gets_its_own(nodes: tuple[Node, Node]) -> None:
    """D asks for other tokens than the prefill's whole prompt (a prefix hit on D, fewer tokens): the list
    built ahead does not fit and the plan builds the right one; the whole-prompt request beside them uses it."""
    p, d = nodes
    pg, dg = Geom(num_blocks=128), Geom(num_blocks=128, block_size=32, order="HND")
    k = _key("differs")
    whole = Req(f"{k}-w", f"{k}-pw", f"{k}-dw", [9, 3, 40, 41, 7, 100, 2, 60], [0, 1, 2, 3], 120)
    prefix = Req(f"{k}-x", f"{k}-px", f"{k}-dx", [11, 12, 50, 51, 90, 91, 92, 20], [10, 4, 11, 5], 120, 48)
    shorter = Req(f"{k}-s", f"{k}-ps", f"{k}-ds", [30, 31, 32, 33, 34, 35, 36, 37], [20, 21, 22], 70)
    reqs = [whole, prefix, shorter]
    with (
        engines(p, "sender", [(k + "p", pg, _staged(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _staged(staged_min_descriptors=1), "D" + k)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, 120)  # P computed the whole prompt
        assert p.call("wait_stat", k + "p", "packs_ahead_total", len(reqs), 10.0)
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        _check(p, d, k + "p", k + "d", dg, pg, reqs)
        st = p.call("stats", k + "p")
        assert st.get("plan_staged_total") == len(reqs), st
        assert st.get("packs_ahead_used_total") == 1, st  # only the whole-prompt one fits


def test_d_rank_holding_some_of_ps_heads_gets_its_own_list(nodes: tuple[Node, Node]) -> None:
    """P tp=1 into D tp=2: each D rank wants half of P's heads, so neither takes the list P built for all
    of them; both get the right bytes, and a later re-issued prefill's list replaces the old one."""
    p, d = nodes
    pg = Geom(num_blocks=64, order="HND")
    dgs = [Geom(num_blocks=64, tp_rank=r, tp_size=2) for r in range(2)]
    k = _key("heads")
    r = Req(f"{k}-t", f"{k}-p", f"{k}-d", [5, 9, 1, 30, 31, 2, 40, 8], [7, 3, 12, 13, 0, 60, 61, 62], 117)
    with (
        engines(p, "sender", [(k + "p", pg, _staged(), "P" + k)]) as [addr],
        engines(d, "receiver", [(f"{k}d{i}", dgs[i], _staged(staged_min_descriptors=1), "D" + k) for i in range(2)]),
    ):
        p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        assert p.call("wait_stat", k + "p", "packs_ahead_total", 1, 10.0)
        for i in range(2):
            d.call("register", f"{k}d{i}", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        src = p.call("snapshot", k + "p")
        for i in range(2):
            [res] = d.call("results", f"{k}d{i}", 1, 20.0)
            assert res.ok, res
            exp = make_cache(dgs[i], None)
            apply_push(exp, dgs[i], src, pg, r)
            assert_same(d.call("snapshot", f"{k}d{i}"), exp, dgs[i])
        [pr] = p.call("results", k + "p", 1, 10.0)
        assert pr.ok, pr
        st = p.call("stats", k + "p")
        assert st.get("plan_staged_total") == 2 and st.get("packs_ahead_used_total", 0) == 0, st
        assert_idle(p, k + "p")


def test_reissued_prefill_pushes_from_its_own_blocks(nodes: tuple[Node, Node]) -> None:
    """P re-ran a prefill under a new request id into other blocks before D registered: the push that
    follows packs the re-run's blocks (the list built for the first run went with it)."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64, order="HND")
    k = _key("reissue")
    first = Req(f"{k}-t", f"{k}-r1", f"{k}-d", [1, 2, 3, 4], [10, 20, 30, 40], 60)
    again = Req(f"{k}-t", f"{k}-r2", f"{k}-d", [50, 51, 52, 53], [10, 20, 30, 40], 60)
    with (
        engines(p, "sender", [(k + "p", pg, _staged(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _staged(staged_min_descriptors=1), "D" + k)]),
    ):
        p.call("prefill", k + "p", first.tid, first.p_rid, first.p_blocks, first.n)
        p.call("prefill", k + "p", again.tid, again.p_rid, again.p_blocks, again.n)
        assert p.call("wait_stat", k + "p", "packs_ahead_total", 2, 10.0)
        d.call("register", k + "d", again.tid, again.d_rid, (addr[0], addr[1], 1), again.d_blocks, again.n, 0)
        [dr] = d.call("results", k + "d", 1, 10.0)
        assert dr.ok, dr
        pr = by_rid(p.call("results", k + "p", 2, 10.0))
        assert not pr[first.p_rid].ok and pr[again.p_rid].ok, pr
        src = p.call("snapshot", k + "p")
        exp = make_cache(dg, None)
        apply_push(exp, dg, src, pg, again)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        assert p.call("stats", k + "p").get("packs_ahead_used_total") == 1
        assert_idle(p, k + "p")


# -- the pack itself at hand-over (``kvpush.prefill.prepack``) ----------------------------------------------


def _parked_slots(p: Node, key: str) -> tuple[int, int]:
    st = p.call("stats", key)
    return st["parked_staging_slots"], st["staging_slots_in_use"]


@pytest.mark.parametrize("parts", [1, 4])
def test_finished_prefills_are_packed_at_hand_over_and_pushed_from_that_pack(
    nodes: tuple[Node, Node], parts: int
) -> None:
    """P packs each parked prefill into a staging slot before any D registered; the push posts that slot,
    in 1 or 4 parts, without packing again. P's blocks are overwritten after the hand-over and before D
    registers: D must still get the bytes as they were at hand-over, which only the early pack holds."""
    p, d = nodes
    pg, dg = Geom(num_blocks=128), Geom(num_blocks=128, block_size=32, order="HND")
    k = _key("handover")
    rng = np.random.default_rng(parts)
    reqs = [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", rng.permutation(128)[:8].tolist(), [4 * i + j for j in range(4)], n)
        for i, n in enumerate((128, 100, 37))
    ]
    # a small payload cut in `parts` parts on both sides
    with (
        engines(p, "sender", [(k + "p", pg, _staged(push_parts=parts, **SMALL), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _staged(staged_min_descriptors=1, push_parts=parts, **SMALL), "D" + k)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        assert p.call("wait_stat", k + "p", "packs_at_hand_over_total", len(reqs), 10.0)
        assert _parked_slots(p, k + "p") == (len(reqs), len(reqs))
        src = p.call("snapshot", k + "p")
        p.call("fill", k + "p", sorted({b for r in reqs for b in r.p_blocks}), 0x3C)  # after the pack
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        p_res = _check(p, d, k + "p", k + "d", dg, pg, reqs, src)
        st = p.call("stats", k + "p")
        assert st.get("packs_at_hand_over_used_total") == len(reqs), st
        assert st.get("parts_total") == parts * len(reqs), st
        assert all(x.times.packed < x.times.registered for x in p_res.values()), p_res


def test_a_packed_slot_comes_back_on_every_end(nodes: tuple[Node, Node]) -> None:
    """Parked and packed prefills end without using their slot: the lease runs out, P aborts, D cancels
    before registering, D asks for a direct push (its slot is not taken): every slot comes back."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64, order="HND")
    k = _key("ends")
    peer_cfg = {"prefill_lease_s": 1.5}
    reqs = [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", [8 * i + j for j in range(4)], [4 * i + j for j in range(4)], 50)
        for i in range(4)
    ]
    lease, abort, cancel, direct = reqs
    with (
        engines(p, "sender", [(k + "p", pg, _staged(**peer_cfg), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="direct"), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        assert p.call("wait_stat", k + "p", "packs_at_hand_over_total", len(reqs), 10.0)
        assert _parked_slots(p, k + "p") == (4, 4)
        p.call("abort", k + "p", abort.tid, "client went away")
        d.call("cancel", k + "d", cancel.tid, cancel.d_rid, peer, "request aborted on D before it got blocks")
        d.call("register", k + "d", direct.tid, direct.d_rid, peer, direct.d_blocks, direct.n, 0)
        res = by_rid(p.call("results", k + "p", 4, 10.0))
        assert res[direct.p_rid].ok and not any(res[r.p_rid].ok for r in (lease, abort, cancel)), res
        assert res[lease.p_rid].cause == "expired", res[lease.p_rid]
        [dr] = d.call("results", k + "d", 1, 10.0)
        assert dr.ok, dr
        exp = make_cache(dg, None)
        apply_push(exp, dg, p.call("snapshot", k + "p"), pg, direct)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        st = p.call("stats", k + "p")
        assert st.get("plan_direct_total") == 1 and st.get("packs_at_hand_over_used_total", 0) == 0, st
        assert_idle(p, k + "p")


def test_a_registered_push_takes_a_parked_slot_back(nodes: tuple[Node, Node]) -> None:
    """P's staging holds one payload: the first parked prefill packs into it; the second's D registers
    first and takes that slot back (its pack is on a request's path, the parked one maybe never), then the
    first's D registers and its push packs at pairing. Both arrive byte-exact; nothing leaks."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64, order="HND")
    k = _key("evict")
    a = Req(f"{k}-a", f"{k}-pa", f"{k}-da", [1, 2, 3, 4], [10, 11, 12, 13], 64)
    b = Req(f"{k}-b", f"{k}-pb", f"{k}-db", [5, 6, 7, 8], [20, 21, 22, 23], 64)
    with engines(p, "sender", [(k + "x", pg, _staged(), "X" + k)]):
        p.call("prefill", k + "x", a.tid, a.p_rid, a.p_blocks, a.n)
        assert p.call("wait_stat", k + "x", "packs_at_hand_over_total", 1, 10.0)
        size = p.call("stats", k + "x")["parked_staging_bytes"]
    with (
        engines(p, "sender", [(k + "p", pg, _staged(staging_bytes=-(-size // 4096) * 4096), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _staged(staged_min_descriptors=1), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in (a, b):
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        assert p.call("wait_stat", k + "p", "packs_at_hand_over_total", 1, 10.0)
        assert _parked_slots(p, k + "p") == (1, 1)  # the second found no free slot: it packs at pairing
        d.call("register", k + "d", b.tid, b.d_rid, peer, b.d_blocks, b.n, 0)
        assert d.call("results", k + "d", 1, 10.0)[0].ok
        d.call("register", k + "d", a.tid, a.d_rid, peer, a.d_blocks, a.n, 0)
        assert d.call("results", k + "d", 1, 10.0)[0].ok
        assert all(x.ok for x in p.call("results", k + "p", 2, 10.0))
        exp = make_cache(dg, None)
        for r in (a, b):
            apply_push(exp, dg, p.call("snapshot", k + "p"), pg, r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        st = p.call("stats", k + "p")
        assert st.get("packs_at_hand_over_evicted_total") == 1 and st.get("plan_staged_total") == 2, st
        assert st.get("packs_at_hand_over_used_total", 0) == 0, st
        assert_idle(p, k + "p")


def test_under_auto_a_parked_prefill_is_packed_when_the_last_plan_was_staged(nodes: tuple[Node, Node]) -> None:
    """P's blocks in one run bound the direct plan too low for P alone to choose staging, but D's blocks are
    scattered, so the plan at pairing is staged: the first finished prefill is packed at pairing, the next
    ones at hand-over (the last plan was staged), and D gets every byte."""
    p, d = nodes
    pg, dg = Geom(num_blocks=128), Geom(num_blocks=128, block_size=32, order="HND")
    k = _key("lastplan")
    rng = np.random.default_rng(5)
    reqs = [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", list(range(8 * i, 8 * i + 8)), rng.permutation(32)[:4].tolist(), 128)
        for i in range(3)
    ]
    pcfg = _cfg(plan="auto", descriptor_cost_us=1.0)  # staged at pairing, not by P's runs alone (scanned)
    with (
        engines(p, "sender", [(k + "p", pg, pcfg, "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _staged(staged_min_descriptors=1), "D" + k)]),
    ):
        for i, r in enumerate(reqs):
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            if i:
                assert p.call("wait_stat", k + "p", "packs_at_hand_over_total", i, 10.0)
            st = p.call("stats", k + "p")
            assert st.get("packs_at_hand_over_total", 0) == i, st
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
            assert p.call("wait_stat", k + "p", "plan_staged_total", i + 1, 10.0)
        st = p.call("stats", k + "p")
        assert st.get("packs_at_hand_over_used_total") == len(reqs) - 1 and st.get("plan_direct_total", 0) == 0, st
        _check(p, d, k + "p", k + "d", dg, pg, reqs)
