"""Notifications bound to the authenticated link, against real engines: P, D and a forger in three processes.

The attack of issue 41 (item 1): NIXL names a notification's sender by the name the sender gave its agent, P
rank 0's agent is ``<engine id>-p0``, and every P of the fleet gets D's NIXL metadata from D's hello. So a
process holding the P key makes a NIXL agent under P1's name, loads D's metadata, and sends D notifications
as P1. Before seals, D took a forged Completion of a transfer registered with P1 as the push (it reported it
ok before P1 wrote anything, so vLLM would decode from blocks nobody wrote), a forged Failure as P1's
refusal, and forged heartbeats as P1's liveness (a frozen P1 was not declared dead while they came); both
transfers were reported fenced, so D gave the blocks back and P1's real push then wrote into reused blocks.

Here every notification D acts on must be sealed with the key P1 gave D over the CURVE side channel
(``kvpush.decode.seals``); the forger's (unsealed, sealed with a key of its own, a genuine seal over another
body, a genuine notification replayed, of another session) are dropped, counted and logged, the real push
lands byte for byte, and a frozen P1 is declared dead on time. The same forger, named as D's agent and
loaded with P1's metadata (which every D of the fleet gets from P's hello reply), changes nothing on P: P
acts on no NIXL notification at all.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from typing import Any

import helpers_libfabric as lf
import msgspec
import pytest
import zmq
from procs import Geom, Node, assert_same, dealer, make_cache
from test_auth_nixl import _attack
from test_faults_nixl import _wait_stopped

from kvpush.conformance.model import Req, apply_push
from kvpush.core import protocol, seal
from kvpush.core.outcome import Cause, Stage
from kvpush.transport import key_set

FAST = {"heartbeat_s": 0.2, "peer_dead_s": 2.0, "staging_bytes": 1 << 20}
REUSED = 0x5A
_ids = iter(range(1_000_000))
ORDERS = ("after", "before")
"""When the forger loads D's metadata: once P1 is linked to D (the attack as issue 41 ran it), or before D
ever said hello to P1 (the forger's connection under P1's name is then D's first under that name)."""


@pytest.fixture
def trio(nixl_backend: str) -> Iterator[tuple[Node, Node, Node, tuple[int, ...]]]:
    """A P, a D and a forger worker of their own (a test freezes P, and a forger may leave P's posts blocked in
    NIXL), with the NIXL version they run."""
    with lf.spawn_env(nixl_backend):
        p, d, f = Node("P", nixl_backend), Node("D", nixl_backend), Node("F", nixl_backend)
    try:
        for n in (p, d, f):
            n.wait_ready()
        version = tuple(int(x) for x in p.call("nixl_traits")[0].split("+")[0].split(".")[:3])
        yield p, d, f, version
    finally:
        for n in (p, d, f):
            n.stop(timeout=10.0)


def reaches_d(backend: str, version: tuple[int, ...], order: str) -> tuple[bool, bool]:
    """Whether NIXL delivers to D the notifications of (the forger, P1), as measured on each lane.

    UCX: both, whatever the order (a notification carries the name its sender gave; UCX connects endpoints,
    not names). LIBFABRIC names a connection by the connecting agent's name and D keeps the first made under a
    name: from NIXL 1.4 (loading a peer connects to it), the forger's sends never complete when P1 came first,
    and P1's never do when the forger came first (its posts block, and D declares it dead: a denial of service
    kvpush does not control); NIXL 1.3.2 (connecting at the first send) delivers both."""
    if backend == "UCX" or version < (1, 4):
        return True, True
    return order == "before", order == "after"


class FleetP:
    """A holder of the P fleet's key (any P of the fleet) that D says hello to: it reads D's hello, which
    carries D's NIXL agent name and metadata (D waits for the answer meanwhile, progressing its agent)."""

    def __init__(self) -> None:
        keys = key_set.server_keys("curve", "")
        assert keys is not None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.CURVE_SERVER, 1)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self._ident = b""
        self._epoch = 0

    def hello(self, d: Node, k: str, timeout_s: float = 10.0) -> protocol.Hello:
        """D's hello, when D registers a transfer with this P."""
        d.call("register", k + "d", f"decoy{next(_ids)}", "dd", ("127.0.0.1", self.port, 1), [30], 16, 0)
        assert self.sock.poll(int(timeout_s * 1000)), "D never said hello to the fleet's other P"
        self._ident, data = self.sock.recv_multipart()
        msg = protocol.decode(data, expected=protocol.Hello)
        self._epoch = msg.epoch
        return msg

    def close(self) -> None:
        """Refuse D's hello (its decoy fails), and go."""
        if self._ident:
            reply = protocol.HelloReply(ok=False, reason="not serving", epoch=self._epoch)
            self.sock.send_multipart([self._ident, protocol.encode(reply)])
        self.sock.close(linger=500)
        self.ctx.term()


def p_reply(d: Node, k: str, addr: tuple[str, int], g: Geom) -> protocol.HelloReply:
    """P's hello reply (its NIXL agent name and metadata), as any D of the fleet gets it by saying hello."""
    keys = key_set.client_keys("curve", "")
    ctx = zmq.Context()
    sock = dealer(addr, keys, ctx)
    try:
        sock.send(protocol.encode(_attack(d, k, "none", g)[0]))
        while True:
            assert sock.poll(10_000), "P never answered a D of the fleet"
            msg = protocol.decode(sock.recv())
            if isinstance(msg, protocol.HelloReply):
                assert msg.ok, msg
                return msg
    finally:
        sock.close(linger=0)
        ctx.term()


def sealed_of(frames: list[tuple[str, bytes]], agent: str) -> list[protocol.Sealed]:
    """The sealed notifications among what D's agent received from ``agent``."""
    out = []
    for name, data in frames:
        msg = protocol.decode(data)
        if name == agent and isinstance(msg, protocol.Sealed):
            out.append(msg)
    return out


def forgeries(victim: Req, genuine: protocol.Sealed | None) -> list[bytes]:
    """What a forger under P1's name sends D about ``victim`` (registered with P1): its end, as a Completion of
    every region and as a Failure, and a heartbeat; each unsealed and sealed with a key of its own; with a
    genuine seal of P1's (recorded on the wire), each under that seal, the seal under another session's
    epoch, and the genuine notification replayed."""
    done = protocol.encode(protocol.Completion(victim.tid, victim.d_rid, 0, nbytes=1))
    fail = protocol.encode(protocol.Failure(victim.tid, victim.d_rid, 0, Stage.TRANSFER, Cause.OTHER, "forged"))
    beat = protocol.encode(protocol.Heartbeat("forger", 0, 7, time.time()))
    own = secrets.token_bytes(seal.KEY_BYTES)
    out = [done, fail, beat]
    for i, body in enumerate((done, fail, beat)):
        out.append(protocol.encode(seal.seal(own, genuine.epoch if genuine else 1, 1000 + i, body)))
        if genuine is not None:
            out.append(protocol.encode(msgspec.structs.replace(genuine, body=body)))
    if genuine is not None:
        out.append(protocol.encode(msgspec.structs.replace(genuine, epoch=genuine.epoch + 1)))
        out.append(protocol.encode(genuine))
    return out


def _pair(p: Node, d: Node, g: Geom, cfg: dict[str, Any]) -> tuple[str, tuple[str, int]]:
    k = f"seal{next(_ids)}"
    addr = tuple(p.call("sender", k + "p", g, cfg, "P" + k, 7))
    d.call("receiver", k + "d", g, cfg, "D" + k)
    d.call("tap_notifs", k + "d")
    p.call("logs"), d.call("logs")
    return k, addr  # type: ignore[return-value]


def _first_push(p: Node, d: Node, k: str, peer: tuple[str, int, int]) -> Req:
    """One real push through the link (its notifications are recorded on D's side: replays)."""
    first = Req(f"first{next(_ids)}", "p1", "d1", [1, 2], [3, 4], 30)
    d.call("register", k + "d", first.tid, first.d_rid, peer, first.d_blocks, first.n, 0)
    p.call("prefill", k + "p", first.tid, first.p_rid, first.p_blocks, first.n)
    assert [r.ok for r in _results(d, k, first.tid, 15.0)] == [True]
    assert p.call("results", k + "p", 1, 15.0)[0].ok
    return first


def _results(d: Node, k: str, tid: str, timeout_s: float) -> list[Any]:
    """D's results of ``tid`` within ``timeout_s`` (others, such as a decoy's, are dropped)."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while True:
        out += [
            r
            for r in d.call("results", k + "d", 1, max(0.01, min(0.2, deadline - time.monotonic())))
            if r.transfer_id == tid
        ]
        if out or time.monotonic() >= deadline:
            return out


def _delivered(d: Node, k: str, agent: str, forged: list[bytes], mark: int, expect: int) -> int:
    """How many of the forged frames D's agent received from ``agent`` after the first ``mark`` it received,
    waiting up to 10 s for ``expect``."""
    wanted = set(forged)
    deadline = time.monotonic() + 10.0
    while True:
        got = d.call("tapped", k + "d")[mark:]
        n = sum(1 for name, data in got if name == agent and data in wanted)
        if n >= expect or time.monotonic() >= deadline:
            return n
        time.sleep(0.1)


@pytest.mark.parametrize("order", ORDERS)
def test_a_forger_under_a_p_ranks_name_ends_no_transfer(
    trio: tuple[Node, Node, Node, tuple[int, ...]], nixl_backend: str, order: str
) -> None:
    """Forged Completions, Failures and heartbeats of a transfer registered with P1, from an agent named as
    P1's and loaded with D's metadata (read from D's hello by another P of the fleet): D acts on none (each
    counted, logged once per interval), does not report the transfer, and P1's real push lands byte for byte
    with nothing in blocks given back meanwhile. Where NIXL lets the forger's connection displace P1's
    (LIBFABRIC from NIXL 1.4, the forger first: ``reaches_d``), P1's push never arrives and D fails the transfer
    as P1's death, its blocks withheld; it still acts on no forgery."""
    p, d, f, version = trio
    forger_in, p_in = reaches_d(nixl_backend, version, order)
    g = Geom(num_blocks=32)
    k, addr = _pair(p, d, g, {**FAST, "peer_dead_s": 5.0})
    peer = (*addr, 1)
    p_agent = f"P{k}-p0"  # P rank 0's agent name: its engine id (which travels in kv_transfer_params), -p, rank
    fleet = FleetP()
    try:
        hello = fleet.hello(d, k)
        if order == "before":
            f.call("rogue", p_agent, hello.agent_metadata)
    finally:
        fleet.close()
    first = _first_push(p, d, k, peer) if p_in else None
    genuine = sealed_of(d.call("tapped", k + "d"), p_agent)
    assert bool(genuine) == p_in, "P's completion reached D unsealed"
    victim = Req(f"victim{next(_ids)}", "pv", "dv", [5, 6], [7, 8], 30)
    d.call("register", k + "d", victim.tid, victim.d_rid, peer, victim.d_blocks, victim.n, 0)
    assert p.call("wait_stat", k + "p", "registrations_total", 2 if p_in else 1, 10.0)
    if order == "after":
        f.call("rogue", p_agent, hello.agent_metadata)
    if not p_in:
        p.call("prefill", k + "p", victim.tid, victim.p_rid, victim.p_blocks, victim.n)  # its post never returns
    before = d.call("stats", k + "d")
    mark = len(d.call("tapped", k + "d"))
    forged = forgeries(victim, genuine[0] if genuine else None)
    sent = f.call("rogue_send", p_agent, forged)
    delivered = _delivered(d, k, p_agent, forged, mark, len(forged) if forger_in else 0)
    assert delivered == (len(forged) if forger_in else 0), (order, version, sent, delivered, f.call("logs"))
    assert d.call("wait_stat", k + "d", "unverified_notifications_total", delivered, 10.0)
    early = _results(d, k, victim.tid, 1.0 if p_in else 0.0)
    taken = [r for r in early if r.ok or r.fenced]  # a forgery taken: D reported the transfer, blocks given back
    if taken:  # vLLM reuses them at once
        d.call("fill", k + "d", victim.d_blocks, REUSED)
    st = d.call("stats", k + "d")
    if delivered:
        d.wait_logged([f"ignored a NIXL notification from agent '{p_agent}' (P {addr[0]}:{addr[1]}'s link)"])
    if p_in:
        p.call("prefill", k + "p", victim.tid, victim.p_rid, victim.p_blocks, victim.n)
    late = _results(d, k, victim.tid, 15.0)
    snap = d.call("snapshot", k + "d")
    if taken:
        written = int((snap[:, :, victim.d_blocks] != REUSED).sum())
        pytest.fail(f"D took a forgery as P1's word ({taken}); {written} bytes then landed in the reused blocks")
    unverified = st.get("unverified_notifications_total", 0) - before.get("unverified_notifications_total", 0)
    assert unverified == delivered, (st, before, delivered)
    assert st.get("foreign_messages_total", 0) == before.get("foreign_messages_total", 0), st
    exp = make_cache(g, None)
    if p_in:
        assert not early and [r.ok for r in late] == [True], (early, late)
        snap_p = p.call("snapshot", k + "p")
        for req in (first, victim):
            assert req is not None
            apply_push(exp, g, snap_p, g, req)
    else:  # P1 cut off by NIXL: its death, the blocks withheld (nothing of a forgery counted)
        got = early + late
        assert got and not got[0].ok and "dead" in got[0].reason and not got[0].fenced, got
    assert_same(snap, exp, g)
    if p_in:
        d.call("close", k + "d")
        p.call("close", k + "p")


def test_a_forger_neither_keeps_a_frozen_p_rank_alive_nor_frees_what_it_may_still_write(
    trio: tuple[Node, Node, Node, tuple[int, ...]], nixl_backend: str
) -> None:
    """P1 is stopped (SIGSTOP) as it posts a transfer's WRITE. The forger, under P1's name, sends D heartbeats
    (unsealed, sealed with its own key) and P1's genuine sealed notifications replayed, every 0.1 s: none counts
    as P1's word, so D declares P1 dead on time. Then, while D's fencing hello waits for the frozen P1, it sends
    that transfer's Completion (every region: what would tell D that nothing more of it can land): D keeps the
    blocks withheld. P1 resumes and its WRITE lands; D gives the blocks back only after that, and not one byte of
    them changes once given back."""
    p, d, f, version = trio
    forger_in, _ = reaches_d(nixl_backend, version, "after")
    g = Geom(num_blocks=32)
    k, addr = _pair(p, d, g, FAST)
    peer = (*addr, 1)
    p_agent = f"P{k}-p0"
    _first_push(p, d, k, peer)
    genuine = sealed_of(d.call("tapped", k + "d"), p_agent)
    assert genuine, "P's completion reached D unsealed"
    fleet = FleetP()
    try:
        metadata = fleet.hello(d, k).agent_metadata
    finally:
        fleet.close()
    victim = Req(f"victim{next(_ids)}", "pv", "dv", [5, 6], [7, 8], 30)
    d.call("register", k + "d", victim.tid, victim.d_rid, peer, victim.d_blocks, victim.n, 0)
    assert p.call("wait_stat", k + "p", "registrations_total", 2, 10.0)
    f.call("rogue", p_agent, metadata)
    own = secrets.token_bytes(seal.KEY_BYTES)
    mark = len(d.call("tapped", k + "d"))
    p.call("stop_at_post", k + "p")
    p.send("prefill", k + "p", victim.tid, victim.p_rid, victim.p_blocks, victim.n)
    _wait_stopped(p.proc.pid)
    stopped = time.monotonic()
    sent: list[bytes] = []
    reused: list[Any] = []  # fenced results of the victim: D gave its blocks back, vLLM reuses them at once

    def forge(frames: list[bytes]) -> None:
        if forger_in or not sent:  # a send NIXL never completes blocks the forger: once shows it
            f.call("rogue_send", p_agent, frames, 0.5)
            sent.extend(frames)

    def collect(timeout_s: float) -> list[Any]:
        got = _results(d, k, victim.tid, timeout_s)
        for r in got:
            if r.fenced:
                d.call("fill", k + "d", victim.d_blocks, REUSED)
                reused.append(r)
        return got

    try:
        got: list[Any] = []
        i = 0
        while not got and time.monotonic() - stopped < 4 * FAST["peer_dead_s"]:
            i += 1
            beat = protocol.encode(protocol.Heartbeat("forger", 0, i, time.time()))
            forge(
                [
                    beat,
                    protocol.encode(seal.seal(own, genuine[0].epoch, 1000 + i, beat)),
                    *map(protocol.encode, genuine),
                ]
            )
            got = collect(0.1)
        dead_after = time.monotonic() - stopped
        done = protocol.encode(protocol.Completion(victim.tid, victim.d_rid, 0, nbytes=1))
        for j in range(10):  # D's fencing hello waits for P1 meanwhile
            forge([done, protocol.encode(seal.seal(own, genuine[0].epoch, 2000 + j, done))])
            got += collect(0.1)
        freed_frozen = list(reused)
        st = d.call("stats", k + "d")
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    p.answer(30.0)
    deadline = time.monotonic() + 30.0
    while not reused and time.monotonic() < deadline:
        got += collect(0.5)
    time.sleep(1.0)  # anything still on its way lands now
    snap = d.call("snapshot", k + "d")
    changed = int((snap[:, :, victim.d_blocks] != REUSED).sum()) if reused else 0
    assert got and not got[0].ok and "dead" in got[0].reason and not got[0].fenced, got
    assert dead_after < FAST["peer_dead_s"] + 2.0, f"P1 frozen, declared dead only after {dead_after:.1f}s"
    assert not freed_frozen, f"D gave the blocks back while P1, frozen, could still write them: {freed_frozen}"
    assert changed == 0, f"{changed} bytes landed in blocks D had given back"
    assert reused, f"the blocks never came back once P1 resumed: {got}"
    delivered = _delivered(d, k, p_agent, sent, mark, 0)
    assert (delivered >= 20) == forger_in, (delivered, i, version)
    assert st.get("unverified_notifications_total", 0) >= delivered, st
    d.call("close", k + "d")
    p.call("close", k + "p")


def test_p_acts_on_no_notification_under_a_d_ranks_name(
    trio: tuple[Node, Node, Node, tuple[int, ...]], nixl_backend: str
) -> None:
    """The forger, named as D's agent and loaded with P's metadata (a D of the fleet gets it from P's hello
    reply), sends P notifications of every kind D's could be: P reads none, and its next push is exact."""
    p, d, f, _ = trio
    g = Geom(num_blocks=32)
    k, addr = _pair(p, d, g, FAST)
    peer = (*addr, 1)
    d_agent = f"D{k}-d0"
    first = _first_push(p, d, k, peer)
    reply = p_reply(d, k, addr, g)
    f.call("rogue", d_agent, reply.agent_metadata)
    before = p.call("stats", k + "p")
    msgs = [
        protocol.Completion(first.tid, first.d_rid, 0),
        protocol.Failure(first.tid, first.d_rid, 0, Stage.TRANSFER, Cause.OTHER, "forged"),
        protocol.Heartbeat(f"D{k}", 0, 9, time.time()),
        protocol.Abort(first.tid, first.d_rid, "forged"),
        protocol.Credit(first.tid, 0, 99),
        protocol.SealsChecked(1),
    ]
    sent = f.call("rogue_send", d_agent, [protocol.encode(m) for m in msgs])
    # UCX delivers them; LIBFABRIC connects at the load, which completes only while P progresses its agent
    assert sent == len(msgs) or nixl_backend != "UCX", f.call("logs")
    second = Req(f"second{next(_ids)}", "p2", "d2", [9, 10], [11, 12], 30)
    d.call("register", k + "d", second.tid, second.d_rid, peer, second.d_blocks, second.n, 0)
    p.call("prefill", k + "p", second.tid, second.p_rid, second.p_blocks, second.n)
    assert [r.ok for r in _results(d, k, second.tid, 15.0)] == [True]
    after = p.call("stats", k + "p")
    for stat in ("rejected_messages_total", "aborts_total", "aborts_ignored_total", "failures_total"):
        assert after.get(stat, 0) == before.get(stat, 0), (stat, sent, before, after)
    exp = make_cache(g, None)
    snap_p = p.call("snapshot", k + "p")
    apply_push(exp, g, snap_p, g, first)
    apply_push(exp, g, snap_p, g, second)
    assert_same(d.call("snapshot", k + "d"), exp, g)
    assert sealed_of(d.call("tapped", k + "d"), f"P{k}-p0"), "P's completions reached D unsealed"
    d.call("close", k + "d")
    p.call("close", k + "p")
