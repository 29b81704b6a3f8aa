"""Peer copies (``kvpush.backends.peer.PeerCopy``) between the P and the D worker process, checked byte for byte.

A backend that implements ``PeerCopy`` promises that a process on D's host
can write D's KV from D's ``export_peer`` blob. D's worker exports a fresh
cache; P's worker opens the blob and copies every request's pieces (the
direct plan's, as the engine hands them) with ``start_peer_copy``, then waits
for the markers; D's whole cache, read back through the backend, must be what
the suite's own model says, and P's cache unchanged. No engine or NIXL agent
takes part: the engine only adds the notification. A backend without
``PeerCopy`` skips these cases: peer copies are optional.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest

from kvpush.conformance.model import Geom, apply_push, assert_same, make_requests, payload
from kvpush.conformance.worker import Node, Pair

_ids = itertools.count()


@pytest.fixture(scope="module")
def nodes(kvpush_pair: Pair) -> tuple[Node, Node]:
    return kvpush_pair.ready()


def _export(d: Node, key: str, geom: Geom, seed: int) -> tuple[object, bytes]:
    """D's layout and blob; skips when the backend has no ``PeerCopy`` or offers none here."""
    got = d.call("peer_export", key, geom, seed)
    if got is None:
        pytest.skip("backend does not implement kvpush.backends.peer.PeerCopy (peer copies are optional)")
    layout, blob = got
    if blob is None:
        d.call("close", key)
        pytest.skip("export_peer answered None in D's worker: this process cannot offer peer copies here")
    return layout, blob


def _closed(node: Node, key: str) -> None:
    report = node.call("close", key)
    assert report == {"registered_after_close": 0, "thread_alive": False}, f"{node.name} {key}: {report}"


PAIRS = {
    "same_geometry": (Geom(num_blocks=64), Geom(num_blocks=96)),
    "block_size_and_order": (Geom(num_blocks=96, block_size=16), Geom(num_blocks=96, block_size=32, order="HND")),
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_peer_copy_is_byte_exact(nodes: tuple[Node, Node], pair: str) -> None:
    """Contract (peer copy, byte-exact): D exports its KV regions (``export_peer``); P, another process of
    the host, opens the blob (``open_peer``: not None, D is in reach) and copies each request's direct
    pieces with ``start_peer_copy``, several in flight at once; once P's ``wait_ready`` returned for every
    marker, D's cache holds exactly the requested tokens of the shared heads over its own bytes (random
    block sets, partial blocks, a prefix D already holds; same geometry, or other block sizes and orders:
    many small pieces), and P's cache is unchanged."""
    p, d = nodes
    pg, dg = PAIRS[pair]
    k = f"peer{next(_ids)}"
    seeds = (500, 600)
    layout, blob = _export(d, k + "d", dg, seeds[1])
    try:
        reqs = make_requests(np.random.default_rng(7), 8, pg, dg, k, max_tokens=140)
        work = [(r.p_blocks, r.d_blocks, r.n, r.start) for r in reqs]
        try:
            opened = p.call("peer_copy", k + "p", pg, seeds[0], blob, layout, work)
            assert opened, "open_peer answered None for a D on this host that exported its KV"
            src = payload(pg, seeds[0])
            assert_same(p.call("snapshot", k + "p"), src, pg, "P's cache")
            expected = payload(dg, seeds[1])
            for r in reqs:
                apply_push(expected, dg, src, pg, r)
            assert not np.array_equal(expected, payload(dg, seeds[1])), "no request moves a byte"
            assert_same(d.call("snapshot", k + "d"), expected, dg)
        finally:
            _closed(p, k + "p")
    finally:
        _closed(d, k + "d")


def test_peer_open_refuses_what_d_did_not_offer(nodes: tuple[Node, Node]) -> None:
    """Contract (peer copy, reach): ``open_peer`` answers None for a layout with a region outside what D's
    blob exports (P writes only memory D offered) while the same blob opens D's real layout, and raises
    ``BackendError`` (nothing else) for a blob that is not one."""
    p, d = nodes
    g = Geom(num_blocks=32)
    k = f"peer{next(_ids)}"
    layout, blob = _export(d, k + "d", g, 700)
    try:
        assert p.call("peer_copy", k + "p", g, 800, blob, layout, [])  # P's rank, on P's device; copies nothing
        try:
            assert p.call("peer_open", k + "p", blob, layout) == "handle"
            r0 = layout.regions[0]
            far = msgspec.structs.replace(r0, base=r0.base + (1 << 44))
            outside = msgspec.structs.replace(layout, regions=(far, *layout.regions[1:]))
            assert p.call("peer_open", k + "p", blob, outside) == "none"
            got = p.call("peer_open", k + "p", b"\x00not a peer blob\xff", layout)
            assert got.startswith("BackendError: "), got
        finally:
            _closed(p, k + "p")
    finally:
        _closed(d, k + "d")
