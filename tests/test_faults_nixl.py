"""Dead peers: a P or D process killed outright (SIGKILL), with real NIXL agents.

The other side must notice within ``peer_dead_s`` through the liveness
heartbeats, fail or release what it held for the dead peer, and keep working.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from helpers_libfabric import spawn_env
from procs import Geom, Node, make_cache

from kvpush.conformance.model import Req, apply_push
from kvpush.transport.backends import traits

FAST = {"heartbeat_s": 0.2, "peer_dead_s": 1.5, "staging_bytes": 1 << 20}


@pytest.fixture
def pair(nixl_backend: str) -> Iterator[tuple[Node, Node]]:
    with spawn_env(nixl_backend):
        p, d = Node("P", nixl_backend), Node("D", nixl_backend)
    try:
        p.wait_ready()
        d.wait_ready()
        assert p.call("nixl_backends") == d.call("nixl_backends") == (nixl_backend,)
        yield p, d
    finally:
        p.stop()
        d.stop()


def _idle_sender(node: Node, key: str) -> None:
    st = node.call("stats", key)
    assert (st["parked_prefills"], st["waiting_registrations"], st["in_flight"]) == (0, 0, 0), st


def test_p_killed_d_fails_its_transfers_within_peer_dead(pair: tuple[Node, Node]) -> None:
    p, d = pair
    g = Geom(num_blocks=16)
    addr = p.call("sender", "s", g, FAST, "P", 7)
    d.call("receiver", "r", g, FAST, "D")
    d.call("register", "r", "t1", "d1", (addr[0], addr[1], 1), [1, 2], 30, 0)
    time.sleep(0.5)  # handshake done, registration parked on P (no prefill yet)
    p.proc.kill()
    t0 = time.monotonic()
    [res] = d.call("results", "r", 1, 10.0)
    waited = time.monotonic() - t0
    assert not res.ok and "dead" in res.reason, res
    assert waited < FAST["peer_dead_s"] + 3, waited
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["staging_slots_in_use"] == 0, st
    d.call("close", "r")


@pytest.mark.parametrize("prefill_after_death", [False, True])
def test_d_killed_p_releases_its_blocks(pair: tuple[Node, Node], prefill_after_death: bool) -> None:
    """D dies with a registration on P: the prefill is released (ok=False), not held for a lease."""
    p, d = pair
    g = Geom(num_blocks=16)
    cfg = {**FAST, "prefill_lease_s": 60.0}
    addr = p.call("sender", "s", g, cfg, "P", 7)
    d.call("receiver", "r", g, cfg, "D")
    d.call("register", "r", "t1", "d1", (addr[0], addr[1], 1), [1, 2], 30, 0)
    time.sleep(0.5)
    assert p.call("stats", "s")["waiting_registrations"] == 1
    d.proc.kill()
    t0 = time.monotonic()
    if prefill_after_death:
        time.sleep(FAST["peer_dead_s"] + 1.0)  # P has declared D dead before its prefill finishes
    p.call("prefill", "s", "t1", "p1", [3, 4], 30)
    [res] = p.call("results", "s", 1, 15.0)
    assert res.request_id == "p1"
    assert time.monotonic() - t0 < cfg["peer_dead_s"] + 5  # far below the 60 s lease
    _idle_sender(p, "s")
    p.call("close", "s")


def test_a_dead_d_fails_only_its_own_transfers(pair: tuple[Node, Node], nixl_backend: str) -> None:
    """D1 is killed while P writes to it and to D2 at once.

    Over a backend that keeps peers' errors apart (UCX), every transfer to D2
    succeeds. LIBFABRIC does not: a failed completion is returned by whichever
    call reads it, for whatever transfer that call was about, so D1's death
    may fail D2's transfers too (``BackendTraits.peer_errors_isolated``,
    docs/libfabric.md). There each of D2's transfers must still end once, ok
    with exactly P's bytes or failed, nothing may stay held, and D2 must be
    served again afterwards.
    """
    p, d2 = pair
    with spawn_env(nixl_backend):
        d1 = Node("D1", nixl_backend)
    try:
        g = Geom(layers=4, num_blocks=64, num_heads=32, head_dim=128)  # 8 MiB a transfer: long-lived WRITEs
        cfg = {**FAST, "plan": "direct", "peer_dead_s": 3.0}
        addr = p.call("sender", "s", g, cfg, "P", 7)
        peer = (addr[0], addr[1], 1)
        for d, name in ((d1, "D1"), (d2, "D2")):
            d.call("receiver", "r", g, cfg, name)
        # every 4th block on both sides: one descriptor per block and region, 128 per transfer
        reqs = {
            (d, i): Req(f"{tag}{i}", f"p{tag}{i}", f"{tag}{i}", list(range(i, 64, 4)), list(range(i, 64, 4)), 256)
            for d, tag in ((d1, "a"), (d2, "b"))
            for i in range(3)
        }
        for (d, _), r in reqs.items():
            d.call("register", "r", r.tid, r.d_rid, peer, r.d_blocks, r.n, 0)
        time.sleep(0.5)
        for r in reqs.values():
            p.call("prefill", "s", r.tid, r.p_rid, r.p_blocks, r.n)
        assert p.call("wait_stat", "s", "in_flight", 1, 10.0)
        time.sleep(0.02)
        d1.proc.kill()
        got = {r.request_id: r for r in d2.call("results", "r", 3, 30.0)}
        assert sorted(got) == ["b0", "b1", "b2"], got
        if traits([nixl_backend]).peer_errors_isolated:
            assert all(r.ok for r in got.values()), got
        exp = make_cache(g, None)
        src = p.call("snapshot", "s")
        ok = [r for (d, _), r in reqs.items() if d is d2 and got[r.d_rid].ok]
        for r in ok:
            apply_push(exp, g, src, g, r)
        snap = d2.call("snapshot", "r")
        for r in ok:  # the blocks of every transfer D2 was told is done hold exactly P's bytes
            for b in r.d_blocks:
                assert (snap[:, :, b] == exp[:, :, b]).all(), (r.tid, b)
        pres = {r.request_id: r for r in p.call("results", "s", 6, 30.0)}
        assert sorted(pres) == sorted(r.p_rid for r in reqs.values()), pres
        assert all(pres[f"pb{i}"].ok == got[f"b{i}"].ok for i in range(3)), (pres, got)
        _idle_sender(p, "s")
        assert d2.call("stats", "r")["pending"] == 0
        # D2 is served again
        r = Req("c", "pc", "c", [60, 61], [62, 63], 20)
        d2.call("register", "r", r.tid, r.d_rid, peer, r.d_blocks, r.n, 0)
        p.call("prefill", "s", r.tid, r.p_rid, r.p_blocks, r.n)
        [res] = d2.call("results", "r", 1, 10.0)
        assert res.ok, res
        apply_push(exp, g, src, g, r)
        assert (d2.call("snapshot", "r")[:, :, 62:64] == exp[:, :, 62:64]).all()
        p.call("close", "s")
    finally:
        d1.stop()
