"""A D request that ends before it got blocks tells P at once (real NIXL agents, two processes).

Behind a sequential router P parks its finished prefill before D has even
seen the request; if D's request is then aborted while it waits for blocks,
nothing would ever register, and P would hold the blocks for its whole
lease. D's cancel frees them now.
"""

from __future__ import annotations

import time

from procs import Geom, Node

LEASE = {"heartbeat_s": 0.2, "peer_dead_s": 5.0, "prefill_lease_s": 60.0, "staging_bytes": 1 << 20}


def _parked(p: Node) -> int:
    return int(p.call("stats", "s")["parked_prefills"])


def test_cancel_frees_a_parked_prefill_long_before_the_lease(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    g = Geom(num_blocks=16)
    addr = p.call("sender", "s", g, LEASE, "P", 7)
    d.call("receiver", "r", g, LEASE, "D")
    peer = (addr[0], addr[1], 1)
    try:
        p.call("prefill", "s", "t1", "p1", [3, 4], 30)
        time.sleep(0.3)
        assert _parked(p) == 1
        t0 = time.monotonic()
        d.call("cancel", "r", "t1", "d1", peer, "request aborted on D before it got blocks")
        [res] = p.call("results", "s", 1, 10.0)
        assert (res.request_id, res.ok) == ("p1", False) and "aborted by D" in res.reason, res
        assert time.monotonic() - t0 < 5.0  # the lease is 60 s
        assert _parked(p) == 0

        # Cancelled before P's prefill finished: the prefill is released as soon as it is handed over.
        d.call("cancel", "r", "t2", "d2", peer, "request aborted on D before it got blocks")
        time.sleep(0.3)
        p.call("prefill", "s", "t2", "p2", [5, 6], 30)
        [res] = p.call("results", "s", 1, 5.0)
        assert (res.request_id, res.ok) == ("p2", False), res
        assert _parked(p) == 0
        assert d.call("stats", "r")["pending"] == 0  # nothing was registered on D
    finally:
        p.call("close", "s")
        d.call("close", "r")


def test_prefills_released_at_the_lease_are_counted_on_their_own() -> None:
    """A P request whose D never comes is released at the lease, and shows as such in the metrics."""
    from kvpush.observability.metrics import Recorder

    rec = Recorder("prefill")
    counters = {"expired_prefills_total": 2, "expired_registrations_total": 1, "registrations_total": 3}
    cnt = rec.take(counters, 10, 0, {}, "prefill:0", now=1.0).data["counts"]["prefill"]
    assert cnt["prefills_released_at_lease"] == 2 and cnt["expirations"] == 3
    cnt = rec.take({**counters, "expired_prefills_total": 3}, 20, 0, {}, "prefill:0", now=2.0).data["counts"]
    assert cnt["prefill"]["prefills_released_at_lease"] == 1
