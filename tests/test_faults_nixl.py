"""Dead peers: a P or D process killed outright (SIGKILL), with real NIXL agents.

The other side must notice within ``peer_dead_s`` through the liveness
heartbeats, fail or release what it held for the dead peer, and keep working.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from procs import Geom, Node

FAST = {"heartbeat_s": 0.2, "peer_dead_s": 1.5, "staging_bytes": 1 << 20}


@pytest.fixture
def pair() -> Iterator[tuple[Node, Node]]:
    p, d = Node("P"), Node("D")
    try:
        p.wait_ready()
        d.wait_ready()
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
