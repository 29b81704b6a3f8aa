"""A network that drops and heals: P and D in network namespaces of their own, joined by a veth pair the test
makes (``helpers_netns``), with real NIXL agents over it (UCX's tcp transport, libfabric's tcp provider).

The network is cut right after P posts a WRITE of a 128 MiB push (direct, or a part of a push in rounds) and
stays cut until both sides gave the other up (longer than ``peer_dead_s``), then heals. The push in flight must
end cleanly (D's transfer failed or complete, P's push ended, never a byte in blocks D gave back), D's blocks
quarantined by the cut must be given back once P is fenced after the heal, and a new transfer must land,
byte-exact, within seconds of the heal, with nothing restarted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import helpers_netns
import pytest
from helpers_libfabric import spawn_env
from procs import Geom, Node

from kvpush.conformance.model import Req
from kvpush.core.counts import Count

PEER_DEAD_S = 2.0
CFG = {
    "heartbeat_s": 0.2,
    "peer_dead_s": PEER_DEAD_S,
    "staging_bytes": 1 << 20,
    "quarantine_s": 60.0,  # a quarantine never ends on a timer: past it, it is only counted overdue
    "side_channel_host": helpers_netns.P_ADDR,
}
ROUNDS = {"plan": "staged", "staged_min_descriptors": 1, "min_part_bytes": 256 << 10, "ring_slots": 4}
"""A push in rounds through the 1 MiB staging region: four slots of 256 KiB (512 parts for 128 MiB)."""
HEALED_WITHIN_S = 15.0
"""The issue's "within seconds of the heal", generously: a new transfer lands this soon after the heal."""
UNLOADED_ON_A_TIMER = (
    "LIBFABRIC on NIXL {}: a D rank given up under a WRITE is unloaded once peer_dead_s more ran out (its WRITEs"
    " to a dead D would not end otherwise, docs/libfabric.md difference 11); cut off that long, D is then written"
    " again only after the plugin's handshake timeout (1.4.1: the reload's handshake is never answered) or the"
    " WRITE's queued bytes land after P answered D's fencing hello (1.3.2). Open: docs/design.md, Fencing and faults"
)
"""Why the test is expected to fail where P unloads a D rank given up under WRITEs on a timer."""
REUSED = 0x3C
"""What D's blocks hold once vLLM reused them for another request (the test fills them)."""


@pytest.fixture(scope="module")
def net(nixl_backend: str) -> Iterator[tuple[helpers_netns.Net, Node, Node]]:
    """P's and D's namespaces, and a P and a D worker in them (one set per backend: a UCX worker takes
    seconds to start)."""
    try:
        netns = helpers_netns.Net()
    except helpers_netns.NoNamespaces as exc:
        pytest.skip(f"this machine cannot make network namespaces: {exc}")
    try:
        with spawn_env(nixl_backend):
            p = Node("P", nixl_backend, netns=(netns.p_ns, netns.transport_env("p")))
            d = Node("D", nixl_backend, netns=(netns.d_ns, netns.transport_env("d")))
        try:
            p.wait_ready()
            d.wait_ready()
            yield netns, p, d
            crashes = p.call("crashes") + d.call("crashes")
            assert not crashes, "exceptions escaped into an engine loop:\n" + "\n".join(crashes)
        finally:
            p.stop()
            d.stop()
    finally:
        netns.close()


def _drained(netns: helpers_netns.Net, side_channel: int, timeout: float) -> float:
    """When nothing but the side channel's words was on the way to D (``Net.on_the_way_to_d``) for three looks
    in a row."""
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < 3:
        left = netns.on_the_way_to_d(side_channel)
        assert time.monotonic() < deadline, f"still on the way to D after {timeout}s: {left} bytes"
        quiet = quiet + 1 if left == 0 else 0
        time.sleep(0.1)
    return time.monotonic()


def _cut_commands(netns: helpers_netns.Net) -> list[list[str]]:
    """``Net.drop`` as commands a worker runs (``run_at_post``)."""
    return [["ip", "-n", ns, "link", "set", dev, "down"] for ns, dev in netns.ends()]


@pytest.mark.parametrize("plan", ["direct", "rounds"])
def test_network_drops_mid_push_and_heals(
    net: tuple[helpers_netns.Net, Node, Node], plan: str, request: pytest.FixtureRequest
) -> None:
    """The network is cut right after P posts a WRITE of a 128 MiB push (in rounds: its third part), for
    longer than ``peer_dead_s``, then heals; nothing is restarted.

    Cut off, each side gives the other up: D fails its transfer (P silent) and quarantines its blocks (and,
    in rounds, its ring), P fails its push (D silent while a part was posted). After the heal D's fencing
    hello reaches P, P answers it once its WRITE to D has ended, and D gives the blocks back, which are
    filled at once (vLLM reusing them): not one byte of them may change afterwards. A new transfer,
    registered as the network heals, lands exactly within seconds.
    """
    netns, p, d = net
    version, traits = p.call("nixl_traits")
    if not traits.dead_peer_writes_end:
        request.applymarker(pytest.mark.xfail(reason=UNLOADED_ON_A_TIMER.format(version), strict=False))
    g = Geom(layers=8, num_blocks=136, num_heads=32, head_dim=128)  # 1 MiB a block over all layers
    cfg = {**CFG, **(ROUNDS if plan == "rounds" else {"plan": "direct"})}
    addr = p.call("sender", "s", g, cfg, "P", 7)
    d.call("receiver", "r", g, cfg, "D")
    peer = (addr[0], addr[1], 1)
    first = Req("t1", "p1", "d1", list(range(128)), list(range(128)), 128 * g.block_size)
    second = Req("t2", "p2", "d2", list(range(128, 136)), list(range(128, 136)), 8 * g.block_size)
    got: dict[str, list[Any]] = {"t1": [], "t2": []}
    given_back = 0.0  # when D gave the cut transfer's blocks back (and the test reused them)

    def collect(timeout: float) -> None:
        nonlocal given_back
        for res in d.call("results", "r", 1, timeout):
            got[res.transfer_id].append(res)
            if res.transfer_id == "t1" and res.ok:  # all of it landed before the cut: it must be whole
                assert (d.call("snapshot", "r", first.d_blocks) == p.call("snapshot", "s", first.p_blocks)).all()
            if res.transfer_id == "t1" and res.fenced:
                d.call("fill", "r", first.d_blocks, REUSED)  # given back: vLLM reuses them at once
                given_back = time.monotonic()

    try:
        d.call("register", "r", first.tid, first.d_rid, peer, first.d_blocks, first.n, 0)
        time.sleep(0.5)  # handshake done, registration parked on P
        p.call("run_at_post", "s", _cut_commands(netns), 3 if plan == "rounds" else 1)
        p.call("prefill", "s", first.tid, first.p_rid, first.p_blocks, first.n)
        deadline = time.monotonic() + 4 * PEER_DEAD_S + 10.0
        while not got["t1"] and time.monotonic() < deadline:
            collect(0.5)
        assert got["t1"], "D never ended the transfer cut off mid-push"
        assert p.call("wait_stat", "s", Count.DEAD_PEERS, 1, 4 * PEER_DEAD_S + 10.0), "P never gave D up"
        # ... and the cut outlasts whatever P waits on a timer for a D rank given up under a WRITE (the grace of a
        # peer whose WRITEs would not end by themselves, kvpush.core.peer_loads)
        time.sleep(PEER_DEAD_S + 0.5)
        at_cut = d.call("stats", "r")
    finally:
        netns.heal()
    t_heal = time.monotonic()
    [cut] = got["t1"]
    assert cut.ok or "dead" in cut.reason, cut
    assert cut.ok or not cut.fenced, f"D gave the blocks back while cut off from P: {cut}"
    if not cut.ok:  # withheld, ring included, until P is fenced
        assert at_cut["quarantined_blocks"] == len(first.d_blocks), at_cut
        assert plan != "rounds" or at_cut["staging_slots_in_use"] == 1, at_cut
    # D registers its next request with the same P as the network heals, as vLLM's scheduler would
    d.call("register", "r", second.tid, second.d_rid, peer, second.d_blocks, second.n, 0)
    p.call("prefill", "s", second.tid, second.p_rid, second.p_blocks, second.n)
    deadline = t_heal + HEALED_WITHIN_S
    while (not got["t2"] or not given_back) and time.monotonic() < deadline:
        collect(0.2)
    assert got["t2"] and got["t2"][0].ok, f"no new transfer within {HEALED_WITHIN_S}s of the heal: {got}"
    assert given_back, f"D did not give the cut transfer's blocks back after the heal: {got}, {d.call('stats', 'r')}"
    new_s, fenced_s = got["t2"][0].times.result - t_heal, given_back - t_heal  # one host: one monotonic clock
    pres = {r.request_id: r for r in p.call("results", "s", 2, 30.0)}
    assert sorted(pres) == ["p1", "p2"] and pres["p2"].ok, pres  # P's push cut off ended, landed or failed
    assert not pres["p1"].ok or cut.ok, f"P counted a push D had given up: {pres}"
    exact = d.call("snapshot", "r", second.d_blocks) == p.call("snapshot", "s", second.p_blocks)
    assert exact.all(), "the new transfer is not byte-exact"
    # Whatever of the cut push was still on the way (a socket's queue, even of a connection closed meanwhile)
    # arrives once the network healed, and D's transport writes it where it was addressed when D progresses:
    # D registers a third transfer (polling its agent meanwhile), which P pushes only once nothing is on the
    # way to D any more; only then are the reused blocks looked at.
    third = Req("t3", "p3", "d3", first.p_blocks[:8], second.d_blocks, 8 * g.block_size)
    d.call("register", "r", third.tid, third.d_rid, peer, third.d_blocks, third.n, 0)
    drained = _drained(netns, addr[1], 30.0)
    p.call("prefill", "s", third.tid, third.p_rid, third.p_blocks, third.n)
    [res3] = d.call("results", "r", 1, 30.0)
    assert res3.ok and res3.transfer_id == "t3", res3
    exact = d.call("snapshot", "r", third.d_blocks) == p.call("snapshot", "s", third.p_blocks)
    assert exact.all(), "the third transfer is not byte-exact"
    changed = d.call("blocks_not", "r", first.d_blocks, REUSED)
    assert not changed, f"{len(changed)} of {len(first.d_blocks)} reused blocks were written after D gave them back"
    st = d.call("stats", "r")
    assert st["pending"] == 0 and st["quarantined_blocks"] == 0 and st["staging_slots_in_use"] == 0, st
    pst = p.call("stats", "s")
    assert (pst["parked_prefills"], pst["waiting_registrations"], pst["in_flight"]) == (0, 0, 0), pst
    assert plan != "rounds" or pst.get(Count.PLAN_ROUNDS, 0) == 3, "the pushes did not go in rounds"
    print(
        f"{plan}: cut transfer ok={cut.ok}; after the heal: blocks back {fenced_s:.2f}s, new transfer {new_s:.2f}s,"
        f" nothing on the way to D {drained - t_heal:.2f}s"
    )
    p.call("close", "s")
    d.call("close", "r")
