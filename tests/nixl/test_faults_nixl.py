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
from typing import Any

import pytest
from helpers_libfabric import spawn_env
from procs import Geom, Node, make_cache

from kvpush.conformance.model import Req, apply_push
from kvpush.core.counts import Count

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


def test_p_killed_d_fails_its_transfers_within_peer_dead(pair: tuple[Node, Node], nixl_backend: str) -> None:
    """P is killed with a registration parked: D fails the transfer within ``peer_dead_s``, keeps its blocks out
    past ``quarantine_s`` (a frozen P would look the same), and gives them back once a P started again at that
    address answers its fencing hello (a new process: nothing of the old one can write)."""
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
    # A P declared dead may only be frozen: its blocks stay quarantined; a killed one never answers a fencing
    # hello, so they stay out past quarantine_s (overdue, counted) rather than be given back on a timer
    assert not res.fenced and d.call("stats", "r")["quarantined_blocks"] == 2, res
    assert d.call("results", "r", 1, FAST["quarantine_s"] + 1.0) == []
    st = d.call("stats", "r")
    assert st["quarantined_blocks"] == 2 and st.get("quarantines_overdue_total", 0) == 1, st
    with spawn_env(nixl_backend):
        p2 = Node("P2", nixl_backend)
    try:
        assert tuple(p2.call("sender", "s", g, {**FAST, "side_channel_port": addr[1]}, "P", 7)) == tuple(addr)
        [released] = d.call("results", "r", 1, 30.0)
        assert released.fenced and not released.ok and released.transfer_id == "t1", released
        st = d.call("stats", "r")
        assert st["pending"] == 0 and st["staging_slots_in_use"] == 0 and st["quarantined_blocks"] == 0, st
        p2.call("close", "s")
    finally:
        p2.stop()
    d.call("close", "r")


def test_p_killed_and_fenced_by_the_operator_gives_the_blocks_back(pair: tuple[Node, Node], nixl_backend: str) -> None:
    """P is killed for good with a registration parked, and not started again at its address: D's quarantine
    holds past ``quarantine_s`` until the operator fences that P (``kvpush fence``, here its order reaching the
    engine); then the blocks go back at once, the link is dropped, and a P started later at that address (a
    new process, a new engine id: a new pod) is dialled afresh and pushes byte-exact. (Under the old engine id,
    LIBFABRIC's plugin on D would still hold the old P's connection: docs/libfabric.md, difference 10.)"""
    p, d = pair
    g = Geom(num_blocks=16)
    addr = p.call("sender", "s", g, FAST, "P", 7)
    d.call("receiver", "r", g, FAST, "D")
    d.call("register", "r", "t1", "d1", (addr[0], addr[1], 1), [1, 2], 30, 0)
    time.sleep(0.5)  # handshake done, registration parked on P (no prefill yet)
    p.proc.kill()
    [res] = d.call("results", "r", 1, 10.0)
    assert not res.ok and not res.fenced, res
    assert d.call("results", "r", 1, FAST["quarantine_s"] + 1.0) == []  # overdue, held: no timer ends it
    assert d.call("stats", "r")["quarantined_blocks"] == 2
    t0 = time.monotonic()
    d.call("fence", "r", (addr[0], addr[1], 1), "pod deleted")
    [released] = d.call("results", "r", 1, 5.0)
    assert released.fenced and not released.ok and released.transfer_id == "t1", released
    assert time.monotonic() - t0 < 2.0
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["quarantined_blocks"] == 0 and st["connections"] == 0, st
    with spawn_env(nixl_backend):
        p2 = Node("P2", nixl_backend)
    try:
        assert tuple(p2.call("sender", "s", g, {**FAST, "side_channel_port": addr[1]}, "P-new", 7)) == tuple(addr)
        p2.call("fill", "s", [3, 4], 9)
        d.call("register", "r", "t2", "d2", (addr[0], addr[1], 1), [5, 6], 30, 0)
        p2.call("prefill", "s", "t2", "p2", [3, 4], 30)
        [ok] = d.call("results", "r", 1, 30.0)
        assert ok.ok and ok.transfer_id == "t2", ok
        src, dst = p2.call("snapshot", "s"), d.call("snapshot", "r")
        assert (dst[:, :, 5] == src[:, :, 3]).all() and (src[:, :, 3] == 9).all()  # tokens 0-15: a whole block
        p2.call("close", "s")
    finally:
        p2.stop()
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


ROUNDS = {"plan": "staged", "staged_min_descriptors": 1, "min_part_bytes": 256 << 10, "ring_slots": 4}
"""A push in rounds through FAST's 1 MiB staging region: four slots of 256 KiB (512 parts for 128 MiB)."""


def _big_transfer_pair(p: Node, d: Node, plan: str = "direct", **polling: float) -> tuple[Geom, tuple[str, int, int]]:
    """P (``s``) and D (``r``) over a cache whose block is 1 MiB over all layers (128 of them: a 128 MiB
    transfer, whose WRITE lasts), direct plans or (``plan="rounds"``) pushes in rounds, FAST but for
    ``polling``; returns the geometry and D's peer address of P."""
    g = Geom(layers=8, num_blocks=136, num_heads=32, head_dim=128)
    cfg = {**FAST, **(ROUNDS if plan == "rounds" else {"plan": "direct"}), **polling}
    addr = p.call("sender", "s", g, cfg, "P", 7)
    d.call("receiver", "r", g, cfg, "D")
    return g, (addr[0], addr[1], 1)


REUSED = 0x3C
"""What D's blocks hold once vLLM reused them for another request (the test fills them)."""


@pytest.mark.parametrize("plan", ["direct", "rounds"])
def test_p_frozen_mid_push_writes_nothing_into_reused_blocks(pair: tuple[Node, Node], plan: str) -> None:
    """P is stopped (SIGSTOP) as it posts the WRITE of a 128 MiB transfer, past ``peer_dead_s``, then resumed.

    D fails the transfer at once but quarantines its blocks: vLLM may reuse them only when D gives them back
    (``fenced``), and from then on not one byte of them may change. Without the quarantine D gave them back
    at the dead declaration and the resumed P wrote most of the transfer into them. In rounds P is stopped
    as it posts its first part into D's ring: the ring stays D's until P is fenced, and the next transfer,
    through the same ring's slots, lands byte-exact.
    """
    p, d = pair
    # Once resumed, P must not look silent again: right after SIGCONT it reaps its failed WRITE, answers the
    # fencing hello and loads D's agent again, on a host whose cores other tests share. That took longer than
    # a 1 s bar there. The rule under test does not depend on the bar's length.
    g, peer = _big_transfer_pair(p, d, plan, peer_dead_s=6.0, quarantine_s=60.0)
    blocks, other = list(range(128)), list(range(128, 136))
    n = len(blocks) * g.block_size
    d.call("register", "r", "t1", "d1", peer, blocks, n, 0)
    time.sleep(0.5)
    p.call("stop_at_post", "s", True)  # resumed, P looks at D's silence before it reads what D sent
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
            st = d.call("stats", "r")
            assert st["quarantined_blocks"] == len(blocks), st
            # In rounds the ring stays the frozen writer's too: a part it posts once resumed lands in it.
            assert plan != "rounds" or st["staging_slots_in_use"] == 1, st
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
    exp = make_cache(g, None)
    apply_push(exp, g, p.call("snapshot", "s"), g, Req("t2", "p2", "d2", other, other, len(other) * g.block_size))
    assert (snap[:, :, other] == exp[:, :, other]).all(), "the next transfer, through the same staging, is not exact"
    if plan == "rounds":
        assert p.call("stats", "s").get(Count.PLAN_ROUNDS, 0) == 2, "the pushes did not go in rounds"
    late = int((snap[:, :, blocks] != at_failure[:, :, blocks]).any(axis=(0, 1, 3, 4, 5)).sum())
    changed = int((snap[:, :, blocks] != REUSED).any(axis=(0, 1, 3, 4, 5)).sum())
    assert changed == 0, f"{changed} of {len(blocks)} reused blocks were written after D gave them back"
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["quarantined_blocks"] == 0, st
    # P's silence was its own: it never gave D up (that unloaded D's agent under the WRITE in flight, and
    # over LIBFABRIC before NIXL 1.5 the WRITE of t2 to the agent loaded again then hung in its post).
    pst = p.call("stats", "s")
    assert pst.get(Count.DEAD_PEERS, 0) == 0 and pst.get(Count.STALLS, 0) >= 1, pst  # it saw its own stall
    print(f"blocks written after the dead declaration, then reused: {late} of {len(blocks)}")
    p.call("close", "s")
    d.call("close", "r")


FREEZE_S = 9.0
"""How long P stays frozen mid-WRITE: three times ``quarantine_s`` (past the old timer release, with margin)."""


def test_p_frozen_past_quarantine_writes_nothing_into_reused_blocks(pair: tuple[Node, Node]) -> None:
    """P is stopped as it posts the WRITE of a 128 MiB transfer for ``FREEZE_S``, three times ``quarantine_s``.

    A block is reused only when no writer can reach it: D declares P dead and fails the transfer, but keeps
    its blocks withheld past ``quarantine_s`` (overdue: counted and warned about), never releasing them on
    that timer, until the resumed P's WRITE has ended and P answered D's fencing hello. Whatever D gives
    back is filled at once (vLLM reusing it); not one byte of it may change afterwards. The resumed P learns
    that D gave it up and reports its push failed. Before this rule D released the blocks at
    ``quarantine_s`` and the resumed P wrote most of the transfer into them, reporting success.
    """
    p, d = pair
    quarantine_s = 3.0
    g, peer = _big_transfer_pair(p, d, peer_dead_s=3.0, quarantine_s=quarantine_s)  # the freeze outlasts both
    blocks, other = list(range(128)), list(range(128, 136))
    n = len(blocks) * g.block_size
    d.call("register", "r", "t1", "d1", peer, blocks, n, 0)
    time.sleep(0.5)
    p.call("stop_at_post", "s")
    p.send("prefill", "s", "t1", "p1", blocks, n)
    _wait_stopped(p.proc.pid)
    t_stop = time.monotonic()
    reused: list[int] = []  # what D gave back, filled at once as vLLM would

    def collect(timeout: float) -> list[Any]:
        got = d.call("results", "r", 2, timeout)
        for res in got:
            if res.fenced and res.transfer_id == "t1":
                d.call("fill", "r", blocks, REUSED)
                reused.extend(blocks)
        return got

    try:
        got = collect(10.0)
        assert got and not got[0].ok and "dead" in got[0].reason and not got[0].fenced, got
        while time.monotonic() - t_stop < FREEZE_S:
            got += collect(min(0.5, FREEZE_S - (time.monotonic() - t_stop)))
        frozen_s = time.monotonic() - t_stop
        st = d.call("stats", "r")
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    p.answer(30.0)
    assert frozen_s > 2 * quarantine_s, frozen_s
    released_frozen = bool(reused)
    # D goes on serving (the next request, for the same P): its agent progresses, P's fencing hello is answered
    d.call("register", "r", "t2", "d2", peer, other, len(other) * g.block_size, 0)
    deadline = time.monotonic() + 30.0
    while not reused and time.monotonic() < deadline:
        got += collect(0.5)
    [pres] = p.call("results", "s", 1, 30.0)  # P's push ended (its WRITE landed or failed)
    p.call("prefill", "s", "t2", "p2", other, len(other) * g.block_size)
    [second] = [r for r in got if r.transfer_id == "t2"] or d.call("results", "r", 1, 30.0)
    snap = d.call("snapshot", "r")
    changed = int((snap[:, :, blocks] != REUSED).any(axis=(0, 1, 3, 4, 5)).sum()) if reused else 0
    assert changed == 0, f"{changed} of {len(blocks)} reused blocks were written after D gave them back"
    assert not released_frozen, f"D gave the blocks back while P was frozen ({frozen_s:.1f}s): {got}"
    assert st["quarantined_blocks"] == len(blocks), st
    assert st.get("quarantines_overdue_total", 0) == 1, st
    assert any("still unfenced" in line for line in d.call("logs")), "no warning for the overdue quarantine"
    assert reused, f"the quarantined blocks were never given back once P resumed: {got}"
    assert pres.request_id == "p1" and not pres.ok, f"P counted a push D had given up: {pres}"
    assert second.ok and second.transfer_id == "t2", second  # P is served again once fenced
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["quarantined_blocks"] == 0, st
    p.call("close", "s")
    d.call("close", "r")


@pytest.mark.parametrize("plan", ["direct", "rounds"])
def test_d_frozen_mid_push_is_written_again_once_back(pair: tuple[Node, Node], plan: str) -> None:
    """D is stopped (SIGSTOP) while P writes 128 MiB to it, past ``peer_dead_s``, then resumed, and at once
    registers its next request with the same P, as vLLM's scheduler would.

    P gave D up (silent): it fails its push and forgets D, and D's next registration reaches a P that no
    longer knows it, over a link that may look live to D (P's last words reached it as it resumed). D counts
    the first transfer only if all of it landed before it looked (else it declares P dead in its turn and
    withholds its blocks until P is fenced); the second is written exactly, whichever way D learns that P
    forgot it: its link declared dead and said hello to again, or P refusing the registration for want of a
    hello, to which D says hello again and registers once more (before, that refusal failed the transfer).
    Over LIBFABRIC before NIXL 1.5 a WRITE to a peer given up does not end while the peer stays loaded, and
    a live peer loaded again is never handshaken: P unloaded D at once, loaded it again at its hello, and
    the next WRITE hung in its post (docs/libfabric.md, differences 10 and 11). P now keeps such a peer
    loaded for ``peer_dead_s`` more (``Agent.remove_peer``), time for a D only stalled to come back. In
    rounds D stops mid-round: P's parts wait on credits the stopped D does not send, P gives D up all the
    same, and D's ring, withheld until then, serves the next transfer exactly.
    """
    p, d = pair
    g, peer = _big_transfer_pair(p, d, plan, peer_dead_s=3.0, quarantine_s=60.0)
    first = Req("t1", "p1", "d1", list(range(128)), list(range(128)), 128 * g.block_size)
    second = Req("t2", "p2", "d2", list(range(128, 136)), list(range(128, 136)), 8 * g.block_size)
    d.call("register", "r", first.tid, first.d_rid, peer, first.d_blocks, first.n, 0)
    time.sleep(0.5)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(d.proc.pid)
        p.call("prefill", "s", first.tid, first.p_rid, first.p_blocks, first.n)
        assert p.call("wait_stat", "s", Count.DEAD_PEERS, 1, 15.0), "P did not give the silent D up"
        time.sleep(0.5)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    d.call("register", "r", second.tid, second.d_rid, peer, second.d_blocks, second.n, 0)
    p.call("prefill", "s", second.tid, second.p_rid, second.p_blocks, second.n)
    [pres] = p.call("results", "s", 1, 30.0)
    assert pres.request_id == "p1" and not pres.ok, pres  # P gave D up: its push failed
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 40.0
    while ("t2" not in got or not got.get("t1", got["t2"]).fenced) and time.monotonic() < deadline:
        for res in d.call("results", "r", 1, 1.0):
            got[res.transfer_id] = res
    assert "t2" in got and got["t2"].ok, got  # P writes D again: its post did not hang, nor was it refused
    assert "t1" in got and got["t1"].fenced, got  # the first transfer is over, its blocks given back
    exp = make_cache(g, None)
    src = p.call("snapshot", "s")
    apply_push(exp, g, src, g, second)
    req = [second]
    if got["t1"].ok:  # all of it landed, and its notification, before D looked: D counts it, and it is whole
        apply_push(exp, g, src, g, first)
        req.append(first)
    snap = d.call("snapshot", "r")
    for r in req:
        assert (snap[:, :, r.d_blocks] == exp[:, :, r.d_blocks]).all(), r.tid
    _idle_sender(p, "s")
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["quarantined_blocks"] == 0, st
    p.call("close", "s")
    d.call("close", "r")
