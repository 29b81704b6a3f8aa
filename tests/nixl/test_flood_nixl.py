"""Floods against a real P (own worker process, real NIXL agents): memory stays bounded, real transfers stay exact.

A peer holding a valid D key (a compromised or buggy D: authentication
keeps everyone else out before a byte is decoded) sends P, as fast as it can,
one registration carrying the most block ids a group may have, 10,000
registrations, 200,000 aborts of transfer ids P never saw, two seconds of
registrations of the largest frame size P decodes (and frames of that size
that fail to decode only after their bulk), and frames of 100 MB; a
process without a key sends 100 MB frames too. Meanwhile a real D
keeps pushing requests through the same P, each checked byte for byte. P's
resident memory is sampled throughout, through two floods: its growth during
them and what is left after each must stay under the bounds stated in
``docs/security.md`` (generous ones: this is about GBs, not MBs).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from procs import Geom, Node, answer, assert_same, dealer

from kvpush import PROTOCOL_VERSION
from kvpush.conformance.model import Req, apply_push
from kvpush.core import protocol
from kvpush.core.layout import KVLayout
from kvpush.core.limits import PeerLimits
from kvpush.core.outcome import Cause, Stage
from kvpush.transport import key_set

GROWTH_DURING_MB = 200
"""P's RSS may grow this much over its baseline while the flood runs (one frame being decoded, what ZMQ
holds per connection, what P admitted within its per-peer limits); measured values in docs/security.md."""
GROWTH_AFTER_MB = 100
"""What may be left once the flood is over: what the flooder holds within its limits, and allocator slack
(ZeroMQ's 8 MiB frames are allocated on its I/O thread, whose malloc arena keeps freed memory for reuse)."""
ABORTS = 200_000
REGISTRATIONS = 10_000
MAX_FRAMES_S = 2.0


def _assert_bounded(side: str, base: float, peak: float, after: list[float], pushed: int, st: dict) -> None:
    """The side's RSS grew less than the stated bound during the floods and kept less after each of them."""
    print(
        f"{side} RSS: {base:.0f} MB before, {peak:.0f} MB peak, {after} MB after each flood; {pushed} real pushes; {st}"
    )
    assert peak - base < GROWTH_DURING_MB, (base, peak, st)
    assert after[0] - base < GROWTH_AFTER_MB, (base, after, st)
    assert after[1] - base < GROWTH_AFTER_MB, (base, after, st)  # a second flood leaves no more behind


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Node, Node]]:
    """This module's own P and D processes: P's memory must not carry other tests' history."""
    p, d = Node("P"), Node("D")
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d
    finally:
        p.stop()
        d.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Sampler:
    """P's RSS every 50 ms on a thread of the test process."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples, self._stop = pid, [rss_mb(pid)], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(rss_mb(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.samples)


def _flood(addr: tuple[str, int], keys: key_set.ClientKeys, hello: protocol.Hello, errors: list[BaseException]) -> None:
    """What a hostile holder of a D key sends, as fast as ZMQ takes it; then 100 MB frames from anyone."""
    try:
        ctx = zmq.Context()
        s = dealer(addr, keys, ctx)
        s.setsockopt(zmq.SNDTIMEO, -1)  # block when full: the flood is as fast as P lets it be
        s.setsockopt(zmq.SNDHWM, 1000)
        s.send(protocol.encode(hello))
        ids = tuple(i % 128 for i in range(protocol.MAX_BLOCKS))  # the most ids a group holds
        name = hello.engine_id
        s.send(protocol.encode(protocol.Register("max-ids", "max-ids", name, 0, (ids,), 0, lease_ms=3_600_000)))
        # With each transfer's capability (the worst case: a D the router gave them), so that the floods
        # reach the per-peer limits instead of stopping at the capability check.
        cap = key_set.session_capability
        for i in range(REGISTRATIONS):
            reg = protocol.Register(
                f"flood-{i}", f"flood-{i}", name, 0, ((1, 2),), 30, lease_ms=3_600_000, capability=cap(f"flood-{i}")
            )
            s.send(protocol.encode(reg))
        long_id = "x" * 240
        for i in range(ABORTS):
            tid = f"{long_id}{i:08d}"
            s.send(protocol.encode(protocol.Abort(tid, "r" * 200, "forged" * 100, capability=cap(tid))))
        # frames of the largest size P decodes, each a registration of ~2M block ids (4 bytes each)
        group = tuple(300 + i % 60_000 for i in range(protocol.MAX_BLOCKS))
        n = (protocol.MAX_FRAME_BYTES - 4096) // 4 - protocol.MAX_BLOCKS
        big = protocol.encode(protocol.Register("max-frame", "m", name, 0, (group, group[:n]), 0))
        assert protocol.MAX_FRAME_BYTES - (64 << 10) < len(big) <= protocol.MAX_FRAME_BYTES, len(big)
        # frames of the largest size that fail to decode only after their bulk: a registration of ~8M
        # empty groups, and an abort led by a field of ~2M ints that comes before its type tag
        groups = {"type": "register", "transfer_id": "g", "request_id": "g", "engine_id": name, "rank": 0}
        groups |= {"block_ids": [[]] * (protocol.MAX_FRAME_BYTES - 4096), "num_tokens": 0}
        junk = {"junk": list(range(1 << 16, (1 << 16) + 1_670_000)), "type": "abort"}
        for frame in (
            big,
            msgspec.msgpack.encode([PROTOCOL_VERSION, groups]),
            msgspec.msgpack.encode([PROTOCOL_VERSION, junk]),
        ):
            assert protocol.MAX_FRAME_BYTES - (64 << 10) < len(frame) <= protocol.MAX_FRAME_BYTES, len(frame)
            t0 = time.monotonic()
            while time.monotonic() - t0 < MAX_FRAMES_S:
                s.send(frame)
        anon = dealer(addr, None, ctx)
        for sock in (s, anon):
            for _ in range(3):
                try:
                    sock.send(b"\x00" * (100 << 20), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        time.sleep(0.5)
        s.close(linger=0)
        anon.close(linger=0)
        ctx.term()
    except BaseException as exc:
        errors.append(exc)


def _push_exact(
    p: Node, d: Node, g: Geom, addr: tuple[str, int], i: int, rng: np.random.Generator, pk: str = "p", dk: str = "d"
) -> None:
    """One real request through P; D's cache must then be what it was plus exactly this request's KV."""
    blocks = [int(b) for b in rng.choice(g.num_blocks, 4, replace=False)]
    req = Req(f"real-{i}", f"p{i}", f"d{i}", blocks, sorted(blocks), 60)
    exp = d.call("snapshot", dk)
    d.call("register", dk, req.tid, req.d_rid, (*addr, 1), req.d_blocks, req.n, 0)
    p.call("prefill", pk, req.tid, req.p_rid, req.p_blocks, req.n)
    [res] = d.call("results", dk, 1, 30.0)
    assert res.ok, res
    [released] = p.call("results", pk, 1, 10.0)
    assert released.ok, released
    apply_push(exp, g, p.call("snapshot", pk), g, req)
    assert_same(d.call("snapshot", dk), exp, g)


def test_flood_keeps_p_bounded_and_real_transfers_exact(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    g = Geom(num_blocks=64)
    cfg: dict[str, Any] = {"staging_bytes": 1 << 20, "peer_dead_s": 600.0}
    addr = tuple(p.call("sender", "p", g, cfg, "P-flood", 3))
    d.call("receiver", "d", g, cfg, "D-real")
    try:
        rng = np.random.default_rng(1)
        _push_exact(p, d, g, addr, 0, rng)  # warm: handshake, agents, first WRITE
        base = rss_mb(p.proc.pid)
        d_layout = msgspec.msgpack.decode(d.call("layout", "d"), type=KVLayout)
        meta = d.call("bare_agent", "flood-agent")
        hello = protocol.Hello("D-flood", 0, 1, "flood-agent", meta, d_layout, "")
        # The flood's D key is one of the deployment's (P allows it), but not the real D's.
        own = key_set.add_decode_key(key_set.keys_dir(""), f"flood-{uuid.uuid4().hex[:8]}")
        keys = key_set.client_keys("curve", str(own))
        assert keys is not None
        sampler = Sampler(p.proc.pid)
        pushed, after = 0, []
        for _ in range(2):
            errors: list[BaseException] = []
            flood = threading.Thread(target=_flood, args=(addr, keys, hello, errors))
            flood.start()
            start = pushed
            while flood.is_alive() or pushed < start + 3:
                pushed += 1
                _push_exact(p, d, g, addr, pushed, rng)
            flood.join()
            assert not errors, errors
            time.sleep(2.0)  # P reads what is left of the flood
            after.append(rss_mb(p.proc.pid))
        peak = sampler.stop()
        st = p.call("stats", "p")
        _assert_bounded("P", base, peak, after, pushed, st)
        assert pushed >= 3
        # what P holds for the flooder: within its limits (two block ids each, twice its 64-block cache;
        # the tombstones its aborts of unknown transfers may leave, and those of the registrations P
        # dropped when the second flood said hello again)
        assert st["waiting_registrations"] <= g.num_blocks, st
        assert 0 < st["tombstones"] <= PeerLimits().max_peer_tombstones + g.num_blocks, st
        assert st["aborts_ignored_total"] > 0, st
    finally:
        d.call("close", "d")
        p.call("close", "p")


def test_one_d_key_is_known_as_at_most_peer_max_ranks_d_ranks(nodes: tuple[Node, Node]) -> None:
    """The per-D-rank limits bound a key only if it cannot make up D rank names: a key's hellos under more
    names than ``peer_max_ranks`` are refused, and so is a second name on one connection; another key (the
    real D) still gets in and pushes byte-exact."""
    p, d = nodes
    g = Geom(num_blocks=32)
    cfg: dict[str, Any] = {"staging_bytes": 1 << 20, "peer_max_ranks": 2}
    addr = tuple(p.call("sender", "pr", g, cfg, "P-ranks", 5))
    d.call("receiver", "dr", g, cfg, "D-ranks")
    ctx = zmq.Context()
    socks = []
    try:
        d_layout = msgspec.msgpack.decode(d.call("layout", "dr"), type=KVLayout)
        own = key_set.add_decode_key(key_set.keys_dir(""), f"names-{uuid.uuid4().hex[:8]}")
        keys = key_set.client_keys("curve", str(own))
        assert keys is not None

        def hello(sock: zmq.Socket, name: str) -> protocol.HelloReply:
            meta = d.call("bare_agent", f"{name}-agent")
            sock.send(protocol.encode(protocol.Hello(name, 0, 1, f"{name}-agent", meta, d_layout, "")))
            reply = answer(sock, 10.0)
            assert isinstance(reply, protocol.HelloReply), f"no answer to the hello as {name}: {reply}"
            return reply

        socks.append(dealer(addr, keys, ctx))
        assert hello(socks[0], "names-0").ok
        second = hello(socks[0], "names-other")  # the key holds one name: under the cap
        assert not second.ok and "this connection said hello as D names-0 rank 0" in second.reason, second
        replies = []
        for i in range(1, 4):
            socks.append(dealer(addr, keys, ctx))
            replies.append(hello(socks[-1], f"names-{i}"))
        assert [r.ok for r in replies] == [True, False, False], replies
        assert all("limit 2: peer_max_ranks" in r.reason for r in replies[1:]), replies
        assert p.call("stats", "pr")["peers"] == 2
        _push_exact(p, d, g, addr, 0, np.random.default_rng(2), "pr", "dr")
        assert p.call("stats", "pr")["peers"] == 3
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        d.call("close", "dr")
        p.call("close", "pr")


def _fake_p_flood(router: zmq.Socket, idents: list[bytes], errors: list[BaseException]) -> None:
    """A process holding P's key pair (a compromised P) floods the D that said hello to it (``idents``: the
    D's connection, once it said hello)."""
    try:
        if not idents:
            assert router.poll(20_000), "D never said hello to the fake P"
            ident, hello = router.recv_multipart()
            protocol.decode(hello, protocol.Hello)
            idents.append(ident)
        ident = idents[0]
        router.setsockopt(zmq.SNDTIMEO, -1)
        for i in range(ABORTS):
            fail = protocol.Failure(f"{'x' * 240}{i:08d}", "r" * 200, 0, Stage.TRANSFER, Cause.ABORTED, "forged" * 100)
            router.send_multipart([ident, protocol.encode(fail)])
        junk = {"junk": list(range(1 << 16, (1 << 16) + 1_670_000)), "type": "fail"}
        garbage = msgspec.msgpack.encode([PROTOCOL_VERSION, junk])
        t0 = time.monotonic()
        while time.monotonic() - t0 < MAX_FRAMES_S:
            router.send_multipart([ident, garbage])
        for _ in range(3):
            router.send_multipart([ident, b"\x00" * (100 << 20)])
        time.sleep(0.5)
    except BaseException as exc:
        errors.append(exc)


def test_a_flooding_p_keeps_d_bounded_and_real_transfers_exact(nodes: tuple[Node, Node]) -> None:
    """D's side: a P key holder that D registered a transfer with floods D with 200,000 failures of transfers
        D never had, 8 MiB frames that fail to decode only after their bulk, and 100 MB frames, while a real P
        pushes byte-exact through the same D, twice. D's RSS stays within the bounds of docs/security.md, and the
    second flood leaves no more behind than the first (what is left is allocator slack, not state)."""
    p, d = nodes
    g = Geom(num_blocks=64)
    cfg: dict[str, Any] = {"staging_bytes": 1 << 20, "peer_dead_s": 600.0, "transfer_timeout_s": 600.0}
    addr = tuple(p.call("sender", "pd", g, cfg, "P-dside", 9))
    d.call("receiver", "dd", g, cfg, "D-dside")
    keys = key_set.server_keys("curve", "")
    assert keys is not None
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.CURVE_SERVER, 1)
    router.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    router.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    router.setsockopt(zmq.MAXMSGSIZE, -1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        rng = np.random.default_rng(3)
        _push_exact(p, d, g, addr, 0, rng, "pd", "dd")
        base = rss_mb(d.proc.pid)
        sampler = Sampler(d.proc.pid)
        pushed, after, idents = 0, [], []
        for rep in range(2):
            errors: list[BaseException] = []
            flood = threading.Thread(target=_fake_p_flood, args=(router, idents, errors))
            flood.start()
            d.call("register", "dd", f"t-fake{rep}", "d-fake", ("127.0.0.1", port, 1), [60, 61], 30, 0)
            while flood.is_alive() or pushed < 3 * (rep + 1):
                pushed += 1
                _push_exact(p, d, g, addr, pushed, rng, "pd", "dd")
            flood.join()
            assert not errors, errors
            time.sleep(2.0)
            after.append(rss_mb(d.proc.pid))
        peak = sampler.stop()
        st = d.call("stats", "dd")
        _assert_bounded("D", base, peak, after, pushed, st)
        assert st["pending"] == 2, st  # the fake P's own registrations, nothing else
    finally:
        router.close(linger=0)
        ctx.term()
        d.call("close", "dd")
        p.call("close", "pd")
