"""The push path end to end: real NIXL UCX agents in separate processes on loopback.

P and D live in two long-lived worker processes (``procs.py``); every case
creates fresh ``Sender``/``Receiver`` engines inside them, drives requests over
the command queues and then checks D's whole KV cache against the conformance
suite's reference model (``kvpush.conformance.model``), built token by token
and head by head without ``kvpush.core.layout``: a wrong offset in the mapping
would otherwise be checked by the code that made it. Blocks D did not
register must still hold the sentinel byte.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from procs import SENTINEL, Geom, Node, answer, assert_same, dealer, make_cache

from kvpush.conformance.model import Req, apply_push, make_requests
from kvpush.core import protocol
from kvpush.core.layout import KVLayout
from kvpush.core.nixl_backends import traits
from kvpush.core.outcome import PlanKind, Result
from kvpush.transport import key_set
from kvpush_tools.demo.launcher import free_port

STAGING = 4 << 20


# -- fixtures ---------------------------------------------------------------------


_counter = iter(range(1_000_000))


def _key(name: str) -> str:
    return f"{name}{next(_counter)}"


def _cfg(**kw: Any) -> dict[str, Any]:
    return {"staging_bytes": STAGING, **kw}


@contextmanager
def engines(node: Node, kind: str, specs: list[tuple[str, Geom, dict[str, Any], str]]) -> Iterator[list[Any]]:
    """Start ``kind`` engines (``sender``/``receiver``) in ``node``; close them afterwards."""
    out = []
    started: list[str] = []
    try:
        for i, (key, geom, cfg, engine_id) in enumerate(specs):
            args = (key, geom, cfg, engine_id, 1000 + i) if kind == "sender" else (key, geom, cfg, engine_id)
            out.append(node.call(kind, *args))
            started.append(key)
        yield out
    finally:
        for key in started:
            node.call("close", key)
        crashes = node.call("crashes")
        assert not crashes, "exceptions escaped into an engine loop:\n" + "\n".join(crashes)


def by_rid(results: list[Result]) -> dict[str, Result]:
    return {r.request_id: r for r in results}


def assert_idle(node: Node, key: str) -> None:
    """P or D holds nothing any more."""
    st = node.call("stats", key)
    if "pending" in st:
        assert st["pending"] == 0, st
        assert st["staging_slots_in_use"] == 0, st
    else:
        assert (st["parked_prefills"], st["waiting_registrations"], st["in_flight"]) == (0, 0, 0), st
        assert (st["staging_slots_in_use"], st["parked_staging_slots"]) == (0, 0), st


# -- the checker can fail ------------------------------------------------------------------


def test_reference_check_catches_a_flipped_byte() -> None:
    pg, dg = Geom(num_blocks=8), Geom(num_blocks=8, block_size=32, order="HND")
    src, exp = make_cache(pg, 1), make_cache(dg, None)
    req = Req("t", "p", "d", [3, 1, 6], [5, 2], 40, 2)
    apply_push(exp, dg, src, pg, req)
    # token 17 of P is block 1 slot 1; on D it is block 5 slot 17 (HND: head before token)
    np.testing.assert_array_equal(exp[0, 1, 5, 2, 17], src[0, 1, 1, 1, 2])
    got = exp.copy()
    assert_same(got, exp, dg)
    got[2, 0, 5, 3, 30, 7] ^= 1  # a written byte
    with pytest.raises(AssertionError, match="1 bytes differ"):
        assert_same(got, exp, dg)
    got = exp.copy()
    got[0, 0, 0, 0, 0, 0] ^= 1  # an untouched block
    with pytest.raises(AssertionError, match="sentinel"):
        assert_same(got, exp, dg)
    got = exp.copy()
    got[0, 0, 5, 0, 1, 0] = SENTINEL ^ 0xFF  # a prefix token D already had (start_token=2)
    with pytest.raises(AssertionError):
        assert_same(got, exp, dg)


# -- many concurrent requests, both orders, every plan ---------------------------------------------


@pytest.mark.parametrize("plan", ["direct", "staged", "auto"])
def test_many_concurrent_requests(nodes: tuple[Node, Node], plan: str) -> None:
    p, d = nodes
    pg, dg = Geom(num_blocks=256), Geom(num_blocks=512)
    k = _key(plan)
    # auto: D grants staging to fragmented requests only, P's cost model decides
    d_cfg = _cfg(plan=plan, staged_min_descriptors=1 if plan == "staged" else 40)
    rng = np.random.default_rng(42)
    reqs = make_requests(rng, 40, pg, dg, k)
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(plan=plan), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, d_cfg, "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        d_first, p_first = reqs[0::2], reqs[1::2]
        for r in d_first:
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
        for r in p_first:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        time.sleep(0.3)  # the first half waits on P, the second half on D
        for r in d_first:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        for r in p_first:
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
        d_res = by_rid(d.call("results", k + "d", len(reqs), 30.0))
        p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
        assert sorted(d_res) == sorted(r.d_rid for r in reqs)
        assert sorted(p_res) == sorted(r.p_rid for r in reqs)
        assert all(x.ok for x in d_res.values()), [x for x in d_res.values() if not x.ok]
        assert all(x.ok for x in p_res.values()), [x for x in p_res.values() if not x.ok]

        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        np.testing.assert_array_equal(src, make_cache(pg, 1000))
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(got, exp, dg)

        st = p.call("stats", k + "p")
        nonempty = sum(r.n > r.start for r in reqs)
        staged, direct = st.get("plan_staged_total", 0), st.get("plan_direct_total", 0)
        assert staged + direct == nonempty
        if plan == "direct":
            assert staged == 0
        elif plan == "staged":
            assert direct == 0
        else:
            assert staged > 0 and direct > 0, st  # the cost model really chooses
        assert d_res[reqs[1].d_rid].stats.bytes == 0  # zero new tokens: a bare completion
        big = max(reqs, key=lambda r: r.n - r.start)
        pst = p_res[big.p_rid].stats
        assert pst.bytes == (big.n - big.start) * pg.num_heads * pg.head_dim * 2 * pg.layers, pst
        assert pst.pieces >= pst.descriptors >= 1 and pst.complete_s is not None and pst.complete_s >= 0, pst
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")

        # idle: the threads sleep in zmq.poll (idle_poll_max_s=20 ms), they do not spin
        before = (p.call("loops", k + "p"), d.call("loops", k + "d"))
        time.sleep(1.0)
        after = (p.call("loops", k + "p"), d.call("loops", k + "d"))
        assert after[0] - before[0] < 150 and after[1] - before[1] < 150, (before, after)


def test_a_push_larger_than_ds_staging_region_goes_direct_and_is_counted(nodes: tuple[Node, Node]) -> None:
    """D wants every push staged (``staged_min_descriptors=1``) but its staging region is one 4 KiB page: the
    pushes larger than it go direct, byte-exact, and D counts each one (``staging_too_small_total``, with the
    warning operators read: configuration, not load); those that fit are staged and not counted."""
    p, d = nodes
    pg, dg = Geom(num_blocks=128), Geom(num_blocks=128)
    k = _key("toosmall")
    reqs = make_requests(np.random.default_rng(5), 10, pg, dg, k, max_tokens=120)
    region = 4096
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(staged_min_descriptors=1, staging_bytes=region), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:  # one at a time: a slot that fits is always free
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            [res] = d.call("results", k + "d", 1, 30.0)
            assert res.ok, res
        p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
        assert all(x.ok for x in p_res.values()), p_res
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(got, exp, dg)
        per_token = pg.num_heads * pg.head_dim * 2 * pg.layers
        sizes = [(r.n - r.start) * per_token for r in reqs]
        large, small = sum(b > region for b in sizes), sum(0 < b <= region for b in sizes)
        assert large and small, sizes  # both kinds are in the run
        assert d.call("stats", k + "d").get("staging_too_small_total", 0) == large
        st = p.call("stats", k + "p")
        assert st.get("plan_direct_total", 0) == large and st.get("plan_staged_total", 0) == small, st
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


# -- different block sizes and in-block orders ------------------------------------------------------


@pytest.mark.parametrize(
    ("pbs", "dbs", "porder", "dorder", "plan"),
    [
        (16, 32, "NHD", "NHD", "direct"),
        (32, 16, "NHD", "HND", "staged"),
        (16, 64, "HND", "NHD", "direct"),
        (16, 32, "HND", "HND", "staged"),
        (32, 16, "HND", "NHD", "auto"),
        (16, 64, "NHD", "HND", "staged"),
    ],
)
def test_block_sizes_and_orders(
    nodes: tuple[Node, Node], pbs: int, dbs: int, porder: str, dorder: str, plan: str
) -> None:
    p, d = nodes
    pg = Geom(num_blocks=128, block_size=pbs, order=porder)
    dg = Geom(num_blocks=96, block_size=dbs, order=dorder)
    k = _key("bs")
    reqs = make_requests(np.random.default_rng(pbs * 1000 + dbs), 8, pg, dg, k, max_tokens=200)
    d_cfg = _cfg(plan=plan, staged_min_descriptors=1)
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(plan=plan), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, d_cfg, "D" + k)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        d_res = d.call("results", k + "d", len(reqs), 20.0)
        assert len(d_res) == len(reqs) and all(x.ok for x in d_res), d_res
        assert len(p.call("results", k + "p", len(reqs), 10.0)) == len(reqs)
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(got, exp, dg)


# -- re-issued requests -----------------------------------------------------------------------


def test_p_reissues_prefill_under_new_request_id(nodes: tuple[Node, Node]) -> None:
    """P preempted and re-ran a prefill: D gets the re-run's bytes, P releases both request ids."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64)
    k = _key("rp")
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(), "D" + k)]),
    ):
        first = Req("t", "r1", "d1", [1, 2, 3, 4], [10, 20, 30, 40], 60)
        again = Req("t", "r2", "d1", [50, 51, 52, 53], [10, 20, 30, 40], 60)
        p.call("prefill", k + "p", first.tid, first.p_rid, first.p_blocks, first.n)
        p.call("prefill", k + "p", again.tid, again.p_rid, again.p_blocks, again.n)
        time.sleep(0.1)
        d.call("register", k + "d", "t", "d1", (addr[0], addr[1], 1), again.d_blocks, again.n, 0)
        [dr] = d.call("results", k + "d", 1, 10.0)
        assert dr.ok, dr
        pr = by_rid(p.call("results", k + "p", 2, 10.0))
        assert set(pr) == {"r1", "r2"}
        assert not pr["r1"].ok and "re-issued" in pr["r1"].reason
        assert pr["r2"].ok
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        apply_push(exp, dg, src, pg, again)
        assert_same(got, exp, dg)
        assert_idle(p, k + "p")


@pytest.mark.parametrize("gap_s", [0.0, 0.3])
def test_d_reregisters_with_new_blocks(nodes: tuple[Node, Node], gap_s: float) -> None:
    """D preempted and re-allocated: the new blocks get the data, the old registration is reported fenced.

    ``gap_s=0.3`` lets the first registration reach P before the second one
    replaces it; with 0 both may leave D in one batch.
    """
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64)
    k = _key("rd")
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        old = Req("t", "r", "d-old", [5, 6, 7], [1, 2, 3], 40)
        new = Req("t", "r", "d-new", [5, 6, 7], [30, 31, 9], 40)
        d.call("register", k + "d", old.tid, old.d_rid, peer, old.d_blocks, old.n, 0)
        time.sleep(gap_s)
        d.call("register", k + "d", new.tid, new.d_rid, peer, new.d_blocks, new.n, 0)
        time.sleep(0.2)
        p.call("prefill", k + "p", "t", "r", new.p_blocks, new.n)
        dr = by_rid(d.call("results", k + "d", 2, 10.0))
        assert set(dr) == {"d-old", "d-new"}, dr
        assert dr["d-new"].ok, dr
        assert not dr["d-old"].ok and "superseded" in dr["d-old"].reason, dr
        [pr] = p.call("results", k + "p", 1, 10.0)
        assert pr.ok, pr
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        apply_push(exp, dg, src, pg, new)  # old blocks keep the sentinel
        assert_same(got, exp, dg)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


# -- tensor parallelism --------------------------------------------------------------------------


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_two_p_ranks_write_one_d_rank(nodes: tuple[Node, Node], plan: str) -> None:
    """P tp=2 (half the heads each) into D tp=1: D completes after one completion per P rank.

    Staged, each P rank packs its head slice into its own slot of D's staging region.
    """
    p, d = nodes
    base = free_port(span=2)  # P rank r binds base + r
    pgs = [Geom(num_blocks=64, tp_rank=r, tp_size=2) for r in range(2)]
    dg = Geom(num_blocks=64, block_size=32, order="HND")
    k = _key("tp21")
    p_cfg = _cfg(side_channel_port=base, plan=plan)
    reqs = make_requests(np.random.default_rng(7), 6, pgs[0], dg, k, max_tokens=150)
    with (
        engines(p, "sender", [(f"{k}p{r}", pgs[r], p_cfg, "P" + k) for r in range(2)]) as addrs,
        engines(d, "receiver", [(k + "d", dg, _cfg(plan=plan, staged_min_descriptors=1), "D" + k)]),
    ):
        assert [a[1] for a in addrs] == [base, base + 1]
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, ("127.0.0.1", base, 2), r.d_blocks, r.n, r.start)
            for rank in range(2):
                p.call("prefill", f"{k}p{rank}", r.tid, r.p_rid, r.p_blocks, r.n)
        d_res = by_rid(d.call("results", k + "d", len(reqs), 20.0))
        assert len(d_res) == len(reqs) and all(x.ok for x in d_res.values()), d_res
        for r in reqs:
            # both ranks' bytes counted: the result waited for both completions
            want = (r.n - r.start) * dg.num_heads * dg.head_dim * 2 * dg.layers
            assert d_res[r.d_rid].stats.bytes == want, (r, d_res[r.d_rid])
        exp = make_cache(dg, None)
        for rank in range(2):
            assert len(p.call("results", f"{k}p{rank}", len(reqs), 10.0)) == len(reqs)
            st = p.call("stats", f"{k}p{rank}")
            assert st.get(f"plan_{plan}_total") == sum(r.n > r.start for r in reqs), st
            src = p.call("snapshot", f"{k}p{rank}")
            for r in reqs:
                apply_push(exp, dg, src, pgs[rank], r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)


def test_one_p_rank_writes_two_d_ranks(nodes: tuple[Node, Node]) -> None:
    """P tp=1 into D tp=2: P writes each D rank its half of the heads and releases once, after both.

    Staged (and HND on P, NHD on D): P packs each D rank's head slice separately.
    """
    p, d = nodes
    pg = Geom(num_blocks=64, order="HND")
    dgs = [Geom(num_blocks=64, block_size=16, tp_rank=r, tp_size=2) for r in range(2)]
    k = _key("tp12")
    reqs = make_requests(np.random.default_rng(8), 6, pg, dgs[0], k, max_tokens=150)
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(plan="staged"), "P" + k)]) as [addr],
        engines(d, "receiver", [(f"{k}d{r}", dgs[r], _cfg(staged_min_descriptors=1), "D" + k) for r in range(2)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            for rank in range(2):
                d.call("register", f"{k}d{rank}", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        src = p.call("snapshot", k + "p")
        for rank in range(2):
            d_res = d.call("results", f"{k}d{rank}", len(reqs), 20.0)
            assert len(d_res) == len(reqs) and all(x.ok for x in d_res), d_res
            exp = make_cache(dgs[rank], None)
            for r in reqs:
                apply_push(exp, dgs[rank], src, pg, r)
            assert_same(d.call("snapshot", f"{k}d{rank}"), exp, dgs[rank])
        p_res = p.call("results", k + "p", len(reqs) + 1, 1.0)
        assert len(p_res) == len(reqs) and all(x.ok for x in p_res), p_res  # one release per request
        st = p.call("stats", k + "p")
        assert st.get("plan_staged_total") == 2 * sum(r.n > r.start for r in reqs), st
        assert_idle(p, k + "p")


# -- expiry ---------------------------------------------------------------------------------


def test_unmatched_registration_and_prefill_expire(nodes: tuple[Node, Node]) -> None:
    """A registration whose prefill never comes fails on D and leaves nothing on P;
    a prefill whose registration never comes is released by P with ok=False."""
    p, d = nodes
    g = Geom(num_blocks=32)
    k = _key("exp")
    with (
        engines(p, "sender", [(k + "p", g, _cfg(prefill_lease_s=1.0), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", g, _cfg(transfer_timeout_s=1.5), "D" + k)]),
    ):
        t0 = time.monotonic()
        d.call("register", k + "d", "lonely-reg", "d1", (addr[0], addr[1], 1), [1, 2], 20, 0)
        p.call("prefill", k + "p", "lonely-prefill", "p1", [3, 4], 20)
        time.sleep(0.3)
        assert p.call("stats", k + "p")["waiting_registrations"] == 1
        [pr] = p.call("results", k + "p", 1, 5.0)
        assert (pr.request_id, pr.ok) == ("p1", False) and "lease expired" in pr.reason, pr
        [dr] = d.call("results", k + "d", 1, 5.0)
        elapsed = time.monotonic() - t0
        assert (dr.request_id, dr.ok) == ("d1", False) and "no KV from P" in dr.reason, dr
        assert 1.4 < elapsed < 4.0, elapsed
        time.sleep(0.2)  # D's abort reaches P
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


# -- malformed messages ---------------------------------------------------------------------


def _dealer(addr: tuple[str, int]) -> zmq.Socket:
    """A raw socket holding a D key of the session's key set: a buggy peer, but an authenticated one."""
    return dealer(addr, key_set.client_keys("curve", ""))


def _reply(sock: zmq.Socket, timeout_s: float = 5.0) -> Any:
    return answer(sock, timeout_s)


def test_malformed_messages_do_not_hurt_p(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    g = Geom(num_blocks=32)
    k = _key("bad")
    with (
        engines(p, "sender", [(k + "p", g, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", g, _cfg(), "D" + k)]),
    ):
        p.call("logs")
        d_layout = msgspec.msgpack.decode(d.call("layout", k + "d"), type=KVLayout)
        reg = protocol.Register(
            transfer_id="x", request_id="x", engine_id="raw", rank=0, block_ids=((1,),), num_tokens=4
        )
        raw = _dealer(addr)
        raw.send(b"\xc1 not msgpack at all")
        raw.send(protocol.encode(reg)[:-7])  # truncated
        raw.send(msgspec.msgpack.encode([999, msgspec.to_builtins(reg)]))  # a future protocol version
        raw.send_multipart([b"two", b"parts"])
        raw.send(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))  # over the frame limit
        p.wait_logged(
            [
                "malformed message",
                "truncated",
                "protocol version mismatch: peer speaks v999",
                "dropped frame with 3 parts",
                "exceeds the",
            ],
            timeout_s=5.0,
        )
        # a registration from a peer that never said hello: answered with a Failure naming why
        raw.send(protocol.encode(reg))
        fail = _reply(raw)
        assert isinstance(fail, protocol.Failure) and "before a successful hello" in fail.reason, fail
        # a valid hello (a real NIXL agent's metadata), then block ids D does not have
        meta = d.call("bare_agent", k + "-raw")
        hello = protocol.Hello(
            engine_id="raw", rank=0, tp_size=1, agent_name=k + "-raw", agent_metadata=meta, layout=d_layout, model=""
        )
        raw.send(protocol.encode(hello))
        assert _reply(raw).ok
        raw.send(protocol.encode(msgspec.structs.replace(reg, block_ids=((g.num_blocks + 5,),))))
        fail = _reply(raw)
        assert isinstance(fail, protocol.Failure) and "out of range" in fail.reason, fail
        # far over the limit: ZMQ itself cuts the connection before allocating it
        huge = _dealer(addr)
        huge.send(b"\x00" * (64 << 20))
        time.sleep(0.3)
        huge.close()
        raw.close()
        p.wait_logged(["out of range"], timeout_s=5.0)  # the failure is logged on P too
        # P is alive and a correct transfer still succeeds
        req = Req("good", "pg", "dg", [7, 8], [3, 9], 30)
        p.call("prefill", k + "p", req.tid, req.p_rid, req.p_blocks, req.n)
        d.call("register", k + "d", req.tid, req.d_rid, (addr[0], addr[1], 1), req.d_blocks, req.n, 0)
        [dr] = d.call("results", k + "d", 1, 10.0)
        assert dr.ok, dr
        exp = make_cache(g, None)
        apply_push(exp, g, p.call("snapshot", k + "p"), g, req)
        assert_same(d.call("snapshot", k + "d"), exp, g)


# -- incompatible peers ---------------------------------------------------------------------


def test_incompatible_peers_get_a_clear_error(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    g = Geom(num_blocks=32)
    k = _key("inc")
    cases = {
        "head_bytes": (Geom(num_blocks=32, head_dim=8), {}),
        "dtype": (Geom(num_blocks=32, dtype="float16"), {}),
        "number of regions": (Geom(num_blocks=32, layers=2), {}),
        "num_heads": (Geom(num_blocks=32, num_heads=8, tp_size=2), {}),
        "model differs": (g, {"model": "Qwen/Qwen3-8B"}),
    }
    specs = [(f"{k}d{i}", geom, _cfg(**extra), f"D{k}{i}") for i, (geom, extra) in enumerate(cases.values())]
    with (
        engines(p, "sender", [(k + "p", g, _cfg(model="Qwen/Qwen3-32B"), "P" + k)]) as [addr],
        engines(d, "receiver", specs),
    ):
        t0 = time.monotonic()
        for i, _ in enumerate(cases):
            d.call("register", f"{k}d{i}", "t", f"d{i}", (addr[0], addr[1], 1), [1, 2], 20, 0)
        for i, what in enumerate(cases):
            [res] = d.call("results", f"{k}d{i}", 1, 5.0)
            assert not res.ok and what in res.reason and "refused the handshake" in res.reason, (what, res)
        assert time.monotonic() - t0 < 5.0
        assert_idle(p, k + "p")


def test_d_reregisters_while_the_old_attempt_is_written(nodes: tuple[Node, Node]) -> None:
    """The re-registration reaches P while P writes the first attempt (a large WRITE).

    P must not report the old blocks fenced before that WRITE ends, and must
    still push into the new blocks afterwards. Whether the race is hit depends
    on timing; the outcome must be right either way (the counter says which).
    On a loaded host the re-registration may even reach P after the push ended
    and P released the KV: it is then refused at once (D fails the attempt and
    recomputes), never parked until its lease.
    """
    p, d = nodes
    # 16 KiB per block and region, 8 MiB per request: the first WRITE to a new
    # peer also pays UCX's endpoint wire-up, so it is in flight for a while
    g = Geom(layers=4, num_blocks=64, num_heads=8, head_dim=128)
    dg = Geom(layers=4, num_blocks=128, num_heads=8, head_dim=128)
    k = _key("race")
    n = 60 * 16
    with (
        engines(p, "sender", [(k + "p", g, _cfg(plan="direct"), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="direct"), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        pblocks = list(range(60))
        old = Req("t", "r", "d-old", pblocks, list(range(0, 120, 2)), n)
        new = Req("t", "r", "d-new", pblocks, list(range(1, 120, 2)), n)
        d.call("register", k + "d", old.tid, old.d_rid, peer, old.d_blocks, n, 0)
        time.sleep(0.3)
        p.call("prefill", k + "p", "t", "r", pblocks, n)
        d.call("register", k + "d", new.tid, new.d_rid, peer, new.d_blocks, n, 0)
        dr = by_rid(d.call("results", k + "d", 2, 20.0))
        assert set(dr) == {"d-old", "d-new"} and not dr["d-old"].ok, dr
        late = not dr["d-new"].ok  # came after P had let the KV go
        assert not late or "earlier attempt and released" in dr["d-new"].reason, dr
        [pr] = p.call("results", k + "p", 1, 10.0)
        assert pr.ok, pr
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(dg, None)
        if not late:
            apply_push(exp, dg, src, g, new)
        raced = p.call("stats", k + "p").get("deferred_registrations_total", 0) > 0
        if raced or late:
            apply_push(exp, dg, src, g, old)  # the old WRITE landed, and was waited for
        assert_same(got, exp, dg)
        print("re-registration raced with the WRITE:", raced, "| came after the release:", late)


def test_a_registration_after_the_push_was_released_is_refused_at_once(nodes: tuple[Node, Node]) -> None:
    """D registers a transfer P already pushed and released (a re-registration that came late): P refuses it
    at once, naming why, so D fails the attempt and recomputes instead of waiting out the lease."""
    p, d = nodes
    g = Geom(num_blocks=16)
    k = _key("late")
    with (
        engines(p, "sender", [(k + "p", g, _cfg(plan="direct"), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", g, _cfg(plan="direct", registration_lease_s=60.0), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        d.call("register", k + "d", "t", "d-1", peer, [1, 2], 30, 0)
        p.call("prefill", k + "p", "t", "r", [3, 4], 30)
        [first] = d.call("results", k + "d", 1, 10.0)
        [pr] = p.call("results", k + "p", 1, 10.0)
        assert first.ok and pr.ok, (first, pr)
        d.call("register", k + "d", "t", "d-2", peer, [5, 6], 30, 0)
        [late] = d.call("results", k + "d", 1, 10.0)
        assert late.request_id == "d-2" and not late.ok and "earlier attempt and released" in late.reason, late
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_d_goes_away_mid_write(nodes: tuple[Node, Node]) -> None:
    """D closes while P's WRITE is in flight: P releases the request with a reason and keeps running.

    Whether the close lands before the WRITE ends depends on timing; either
    way P must answer once, hold nothing, and not fail its loop.
    """
    p, d = nodes
    g = Geom(layers=4, num_blocks=64, num_heads=8, head_dim=128)
    k = _key("gone")
    n = 60 * 16
    with engines(p, "sender", [(k + "p", g, _cfg(plan="direct"), "P" + k)]) as [addr]:
        p.call("logs")
        d.call("receiver", k + "d", g, _cfg(plan="direct"), "D" + k)
        d.call("register", k + "d", "t", "d", (addr[0], addr[1], 1), list(range(60)), n, 0)
        time.sleep(0.3)
        p.call("prefill", k + "p", "t", "r", list(range(60)), n)
        time.sleep(0.05)
        d.call("close", k + "d", True)
        [pr] = p.call("results", k + "p", 1, 15.0)
        assert pr.ok or "WRITE" in pr.reason or "post failed" in pr.reason, pr
        assert_idle(p, k + "p")
        logs = p.call("logs")
        assert not [line for line in logs if "step failed" in line or "command failed" in line], logs
        print("D closed before the WRITE ended:", not pr.ok, pr.reason)


# -- aborts -----------------------------------------------------------------------------------


def test_aborts_on_either_side_free_everything(nodes: tuple[Node, Node]) -> None:
    """D aborts a registration P is holding; P aborts a prefill nobody registered for."""
    p, d = nodes
    g = Geom(num_blocks=32)
    k = _key("abort")
    with (
        engines(p, "sender", [(k + "p", g, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", g, _cfg(), "D" + k)]),
    ):
        d.call("register", k + "d", "t-d", "d1", (addr[0], addr[1], 1), [1, 2], 20, 0)
        p.call("prefill", k + "p", "t-p", "p1", [3, 4], 20)
        time.sleep(0.3)
        assert p.call("stats", k + "p")["waiting_registrations"] == 1
        d.call("abort", k + "d", "t-d", "client went away")
        p.call("abort", k + "p", "t-p", "request cancelled")
        [dr] = d.call("results", k + "d", 1, 5.0)
        assert (dr.request_id, dr.ok) == ("d1", False) and "client went away" in dr.reason, dr
        [pr] = p.call("results", k + "p", 1, 5.0)
        assert (pr.request_id, pr.ok) == ("p1", False) and "request cancelled" in pr.reason, pr
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_d_restarts_with_the_same_identity(nodes: tuple[Node, Node]) -> None:
    """A D rank comes back (new process, same engine id and rank, so the same NIXL agent name):
    P forgets the old session and serves the new one (NIXL refuses to load one agent name twice)."""
    p, d = nodes
    g = Geom(num_blocks=32)
    k = _key("restart")
    with engines(p, "sender", [(k + "p", g, _cfg(), "P" + k)]) as [addr]:
        for life in range(2):
            with engines(d, "receiver", [(f"{k}d{life}", g, _cfg(), "D" + k)]):
                req = Req(f"t{life}", f"p{life}", f"d{life}", [life + 1, 9], [4, life + 6], 20)
                p.call("prefill", k + "p", req.tid, req.p_rid, req.p_blocks, req.n)
                d.call("register", f"{k}d{life}", req.tid, req.d_rid, (addr[0], addr[1], 1), req.d_blocks, req.n, 0)
                [dr] = d.call("results", f"{k}d{life}", 1, 10.0)
                assert dr.ok, (life, dr)
                exp = make_cache(g, None)
                apply_push(exp, g, p.call("snapshot", k + "p"), g, req)
                assert_same(d.call("snapshot", f"{k}d{life}"), exp, g)
        assert len(p.call("results", k + "p", 2, 5.0)) == 2
        assert p.call("stats", k + "p")["peers"] == 1


def test_a_live_peer_given_up_and_loaded_again_is_written_at_once(nodes: tuple[Node, Node]) -> None:
    """A D rank P gave up (declared dead, or it said hello again) but that lives on comes back with the
    same NIXL metadata: P's next WRITE to it lands at once. Over LIBFABRIC, unloading and loading a live
    peer again made that WRITE's post wait the plugin's 60 s handshake timeout (``reloads_live_peer``)."""
    p, _ = nodes
    assert p.call("reload_live_peer", 8, timeout=30.0) == [True, True]


def test_agents_drive_the_traits_measured_on_the_running_nixl(nodes: tuple[Node, Node], nixl_backend: str) -> None:
    """Each worker's agents drive the traits kvpush measured on the NIXL version they run (the LIBFABRIC
    plugin behaves differently across versions), and that version is the installed wheel's."""
    from importlib.metadata import version

    for node in nodes:
        running, got = node.call("nixl_traits")
        assert running in {version(w) for w in ("nixl-cu13", "nixl-cu12", "nixl")}, running
        assert got == traits([nixl_backend], running), (running, got)


@pytest.mark.parametrize("announced", [False, True])
def test_a_direct_push_announced_ahead_posts_the_write_built_at_pairing(
    nodes: tuple[Node, Node], announced: bool
) -> None:
    """A direct push paired before its KV is reported (D registered while P computes) builds its WRITE at
    pairing, so "KV ready" only posts it; paired after the KV was reported, it is built when posted. Either
    way D gets the bytes exactly and no handle is left behind."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32, order="HND")
    k = _key("direct-ahead")
    rng = np.random.default_rng(7)
    reqs = [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", rng.permutation(64)[:8].tolist(), [3 * i, 3 * i + 1, 50 + i], 90)
        for i in range(3)
    ]
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(plan="direct"), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="direct"), "D" + k)]),
    ):
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
            if announced:
                p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            else:
                p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        if announced:
            assert p.call("wait_stat", k + "p", "in_flight", len(reqs), 20.0)  # paired: WRITEs built
            p.call("layer_written", k + "p", [r.tid for r in reqs], pg.layers - 1)
        d_res = by_rid(d.call("results", k + "d", len(reqs), 20.0))
        p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
        assert all(x.ok for x in [*d_res.values(), *p_res.values()]), [*d_res.values(), *p_res.values()]
        assert all(p_res[r.p_rid].stats.plan is PlanKind.DIRECT for r in reqs)
        src = p.call("snapshot", k + "p")
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        assert p.call("stats", k + "p").get("parts_prebuilt_total", 0) == (len(reqs) if announced else 0)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_notifications_without_a_write_leave_even_when_p_never_writes(nodes: tuple[Node, Node]) -> None:
    """Empty pushes (D already holds every token) send a bare notification; with no WRITE in flight to
    progress P's agent, P must progress it itself until the notification left (``Agent.flushing``), or D
    waits for a completion queued on P forever."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=64)
    k = _key("bare")
    reqs = [Req(f"{k}-t{i}", f"{k}-p{i}", f"{k}-d{i}", [i], [i], 10, 10) for i in range(3)]
    with (
        engines(p, "sender", [(k + "p", pg, _cfg(), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(), "D" + k)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        d_res = d.call("results", k + "d", len(reqs), 10.0)
        assert len(d_res) == len(reqs) and all(x.ok and x.stats.bytes == 0 for x in d_res), d_res
        assert len(p.call("results", k + "p", len(reqs), 10.0)) == len(reqs)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_a_d_configured_with_its_p_is_ready_before_the_first_request(nodes: tuple[Node, Node]) -> None:
    """D started with ``prefill_peers`` naming P says hello at start: before any registration its link is up
    and P knows it (its NIXL metadata loaded), so the first request has no handshake on its path; it then
    lands byte-exact. A D without the setting has no link until its first registration."""
    p, d = nodes
    g = Geom(num_blocks=64)
    k = _key("warm")
    [r] = make_requests(np.random.default_rng(3), 1, g, g, k, max_tokens=100)
    with engines(p, "sender", [(k + "p", g, _cfg(), "P" + k)]) as [addr]:
        warm = {**_cfg(), "prefill_peers": [f"{addr[0]}:{addr[1]}"]}
        with engines(d, "receiver", [(k + "d", g, _cfg(), "D" + k), (k + "w", g, warm, "W" + k)]):
            assert d.call("wait_stat", k + "w", "connections", 1, 20.0), "the configured D did not connect at start"
            assert p.call("wait_stat", k + "p", "peers", 1, 20.0), "P does not know the configured D"
            assert d.call("stats", k + "d")["connections"] == 0  # the other D waits for its first registration
            assert p.call("stats", k + "p")["peers"] == 1
            d.call("register", k + "w", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            [res] = d.call("results", k + "w", 1, 20.0)
            assert res.ok, res
            exp = make_cache(g, None)
            apply_push(exp, g, p.call("snapshot", k + "p"), g, r)
            assert_same(d.call("snapshot", k + "w"), exp, g)
