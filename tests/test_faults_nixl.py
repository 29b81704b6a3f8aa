"""Dead peers: a P or D process killed outright (SIGKILL) or frozen (SIGSTOP), with real NIXL agents.

The other side must notice within ``peer_dead_s`` through the liveness
heartbeats, fail or release what it held for the dead peer, and keep working;
a P frozen mid-push and resumed must write nothing into blocks D reused.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from helpers_libfabric import spawn_env
from procs import Geom, Node, make_cache

from kvpush.conformance.model import Req, apply_push

FAST = {"heartbeat_s": 0.2, "peer_dead_s": 1.5, "staging_bytes": 1 << 20, "quarantine_s": 2.0}


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
    # A P declared dead may only be frozen: its blocks stay quarantined (it never answers a fencing hello)
    assert not res.fenced and d.call("stats", "r")["quarantined_blocks"] == 2, res
    [released] = d.call("results", "r", 1, 10.0)
    assert released.fenced and not released.ok and released.transfer_id == "t1", released
    assert time.monotonic() - t0 >= FAST["quarantine_s"]
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["staging_slots_in_use"] == 0 and st["quarantined_blocks"] == 0, st
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
        if p.call("nixl_traits")[1].peer_errors_isolated:
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


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


REUSED = 0x3C
"""What D's blocks hold once vLLM reused them for another request (the test fills them)."""


def test_p_frozen_mid_push_writes_nothing_into_reused_blocks(pair: tuple[Node, Node]) -> None:
    """P is stopped (SIGSTOP) as it posts the WRITE of a 128 MiB transfer, past ``peer_dead_s``, then resumed.

    D fails the transfer at once but quarantines its blocks: vLLM may reuse them only when D gives them back
    (``fenced``), and from then on not one byte of them may change. Without the quarantine D gave them back
    at the dead declaration and the resumed P wrote most of the transfer into them.
    """
    p, d = pair
    g = Geom(layers=8, num_blocks=136, num_heads=32, head_dim=128)  # a block is 1 MiB over all layers
    cfg = {**FAST, "plan": "direct", "peer_dead_s": 1.0, "quarantine_s": 60.0}
    addr = p.call("sender", "s", g, cfg, "P", 7)
    peer = (addr[0], addr[1], 1)
    d.call("receiver", "r", g, cfg, "D")
    blocks, other = list(range(128)), list(range(128, 136))
    n = len(blocks) * g.block_size
    d.call("register", "r", "t1", "d1", peer, blocks, n, 0)
    time.sleep(0.5)
    p.call("stop_at_post", "s")
    p.send("prefill", "s", "t1", "p1", blocks, n)  # its answer may be held by the stop: collected after SIGCONT
    _wait_stopped(p.proc.pid)  # P stopped itself as it posts the WRITE
    reused = False
    try:
        [failed] = d.call("results", "r", 1, 15.0)
        assert not failed.ok and "dead" in failed.reason, failed
        if failed.fenced:
            d.call("fill", "r", blocks, REUSED)  # the blocks are given back: vLLM reuses them at once
            reused = True
        else:
            assert d.call("stats", "r")["quarantined_blocks"] == len(blocks)
        at_failure = d.call("snapshot", "r")
        time.sleep(1.0)
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    p.answer(30.0)
    # D goes on serving (here: the next request, for the same P), so its NIXL agent keeps progressing
    d.call("register", "r", "t2", "d2", peer, other, len(other) * g.block_size, 0)
    if not reused:
        [released] = d.call("results", "r", 1, 30.0)  # fenced once P's WRITEs ended and it answered a hello
        assert released.fenced and released.transfer_id == "t1" and not released.ok, released
        d.call("fill", "r", blocks, REUSED)
    [pres] = p.call("results", "s", 1, 30.0)  # P's push ended (its WRITEs landed or failed)
    assert pres.request_id == "p1"
    p.call("prefill", "s", "t2", "p2", other, len(other) * g.block_size)
    [second] = d.call("results", "r", 1, 30.0)
    assert second.ok and second.transfer_id == "t2", second  # P is served again once fenced
    snap = d.call("snapshot", "r")
    late = int((snap[:, :, blocks] != at_failure[:, :, blocks]).any(axis=(0, 1, 3, 4, 5)).sum())
    changed = int((snap[:, :, blocks] != REUSED).any(axis=(0, 1, 3, 4, 5)).sum())
    assert changed == 0, f"{changed} of {len(blocks)} reused blocks were written after D gave them back"
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["quarantined_blocks"] == 0, st
    print(f"blocks written after the dead declaration, then reused: {late} of {len(blocks)}")
    p.call("close", "s")
    d.call("close", "r")
