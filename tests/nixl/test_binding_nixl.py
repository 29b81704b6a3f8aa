"""Transfers bound to the D the router chose, against real engines (P and D in two processes, real NIXL
agents) and two key sets: the session's, and a D key of its own (``kvpush keys DIR --decode d-evil``, a
compromised D instance that knows the victim's transfer ids from logs or metrics).

The attacks of issue 28, each a test that fails on the code before capabilities (the intruder took the
victim's KV, or killed its transfer, or D took a forged completion as the push) and passes with them,
a real push alongside checked byte for byte:

* the intruder registers the victim's transfer id before the victim does (no capability, or the
  capability of a transfer of its own);
* it registers for a prefill P finished and parked;
* it aborts a parked prefill, and a registered transfer;
* a P of the fleet (it holds the P key) that D talks to sends D a Completion or Failure for a transfer
  D registered with another P;
* D is asked to register with a P outside its ``allowed_prefills``: it fails at once and dials nothing.
"""

from __future__ import annotations

import select
import socket
from typing import Any

import msgspec
import pytest
import zmq
from procs import Geom, Node, answer, assert_same, dealer, make_cache
from test_auth_nixl import FAST, _attack, _check_pushed, _ids, pair

from kvpush.conformance.model import Req, apply_push
from kvpush.core import protocol
from kvpush.core.outcome import Cause, Stage
from kvpush.transport import key_set


class Intruder:
    """An authenticated D of a key of its own, on one connection, that said hello."""

    def __init__(self, d: Node, k: str, addr: tuple[str, int], g: Geom) -> None:
        own = key_set.add_decode_key(key_set.keys_dir(""), f"d-evil-{next(_ids)}")
        keys = key_set.client_keys("curve", str(own))
        assert keys is not None
        self.ctx = zmq.Context()
        self.sock = dealer(addr, keys, self.ctx)
        self.hello, self.register, self.abort, _, _ = _attack(d, k, "placeholder", g)
        self.sock.send(protocol.encode(self.hello))
        assert answer(self.sock).ok, "P must hear an allowed D key"

    def send(self, msg: Any) -> None:
        self.sock.send(protocol.encode(msg))

    def registers(self, tid: str, capability: str) -> protocol.Failure:
        """Register ``tid``; P's answer, which must be a refusal."""
        self.send(msgspec.structs.replace(self.register, transfer_id=tid, capability=capability))
        fail = answer(self.sock, 5.0)
        assert isinstance(fail, protocol.Failure) and fail.cause is Cause.REFUSED, fail
        return fail

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


CAPS = {"none": lambda: "", "own": lambda: key_set.session_capability("the-intruders-own-transfer")}
"""What the intruder registers or aborts with: nothing, or the capability the router gave it for a
transfer of its own."""


@pytest.mark.parametrize("cap", sorted(CAPS))
def test_a_second_d_key_registering_the_victims_transfer_first_gets_nothing(nodes: tuple[Node, Node], cap: str) -> None:
    p, d = nodes
    g = Geom(num_blocks=32)
    with pair(nodes, FAST, g) as (k, addr):
        evil = Intruder(d, k, addr, g)
        try:
            victim = Req(f"victim{next(_ids)}", "pv", "dv", [3, 4], [5, 6], 30)
            fail = evil.registers(victim.tid, CAPS[cap]())
            assert "capability" in fail.reason and fail.stage is Stage.RENDEZVOUS, fail
            d.call("register", k + "d", victim.tid, victim.d_rid, (*addr, 1), victim.d_blocks, victim.n, 0)
            p.call("prefill", k + "p", victim.tid, victim.p_rid, victim.p_blocks, victim.n)
            _check_pushed(p, d, k, g, victim)
            assert not evil.sock.poll(200), "the intruder heard more of the victim's transfer"
        finally:
            evil.close()


def test_a_second_d_key_cannot_take_a_parked_prefill(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    g = Geom(num_blocks=32)
    with pair(nodes, FAST, g) as (k, addr):
        evil = Intruder(d, k, addr, g)
        try:
            parked = Req(f"parked{next(_ids)}", "pp", "dp", [7, 8], [9, 10], 30)
            p.call("prefill", k + "p", parked.tid, parked.p_rid, parked.p_blocks, parked.n)
            for cap in sorted(CAPS):
                assert "capability" in evil.registers(parked.tid, CAPS[cap]()).reason
            assert p.call("stats", k + "p")["parked_prefills"] == 1, "the parked prefill went"
            d.call("register", k + "d", parked.tid, parked.d_rid, (*addr, 1), parked.d_blocks, parked.n, 0)
            _check_pushed(p, d, k, g, parked)
        finally:
            evil.close()


def test_a_second_d_key_cannot_abort_a_parked_prefill_nor_a_registered_transfer(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    g = Geom(num_blocks=32)
    with pair(nodes, FAST, g) as (k, addr):
        evil = Intruder(d, k, addr, g)
        try:
            parked = Req(f"parked{next(_ids)}", "pp", "dp", [7, 8], [9, 10], 30)
            waiting = Req(f"waiting{next(_ids)}", "pw", "dw", [3, 4], [5, 6], 30)
            p.call("prefill", k + "p", parked.tid, parked.p_rid, parked.p_blocks, parked.n)
            d.call("register", k + "d", waiting.tid, waiting.d_rid, (*addr, 1), waiting.d_blocks, waiting.n, 0)
            assert p.call("wait_stat", k + "p", "registrations_total", 1, 10.0)
            for tid in (parked.tid, waiting.tid):
                for cap in sorted(CAPS):
                    evil.send(msgspec.structs.replace(evil.abort, transfer_id=tid, capability=CAPS[cap]()))
            p.wait_logged([f"ignored an abort of {parked.tid}", "capability"])
            assert p.call("wait_stat", k + "p", "aborts_ignored_total", 4, 10.0)
            st = p.call("stats", k + "p")
            assert (st["parked_prefills"], st["waiting_registrations"], st.get("aborts_total", 0)) == (1, 1, 0), st
            d.call("register", k + "d", parked.tid, parked.d_rid, (*addr, 1), parked.d_blocks, parked.n, 0)
            p.call("prefill", k + "p", waiting.tid, waiting.p_rid, waiting.p_blocks, waiting.n)
            results = d.call("results", k + "d", 2, 15.0)
            assert len(results) == 2 and all(r.ok for r in results), results
            exp = make_cache(g, None)
            snap = p.call("snapshot", k + "p")
            apply_push(exp, g, snap, g, parked)
            apply_push(exp, g, snap, g, waiting)
            assert_same(d.call("snapshot", k + "d"), exp, g)
        finally:
            evil.close()


@pytest.mark.parametrize("forged", ["completion", "failure"])
def test_d_hears_a_transfers_end_only_from_the_p_rank_it_registered_with(nodes: tuple[Node, Node], forged: str) -> None:
    """A second P of the fleet (it holds the P key, and D's metadata since D registered a transfer with
    it) sends D's agent a Completion or Failure of a transfer D registered with the first P: D ignores it,
    logs it, and takes the real push byte for byte."""
    p, d = nodes
    g = Geom(num_blocks=32)
    with pair(nodes, FAST, g) as (k, addr):
        other = tuple(p.call("sender", k + "e", g, FAST, "E" + k, 8))
        try:
            decoy = Req(f"decoy{next(_ids)}", "pe", "de", [1, 2], [11, 12], 30)
            d.call("register", k + "d", decoy.tid, decoy.d_rid, (*other, 1), decoy.d_blocks, decoy.n, 0)
            p.call("prefill", k + "e", decoy.tid, decoy.p_rid, decoy.p_blocks, decoy.n)
            [first] = d.call("results", k + "d", 1, 15.0)
            assert first.ok, first
            victim = Req(f"victim{next(_ids)}", "pv", "dv", [3, 4], [5, 6], 30)
            d.call("register", k + "d", victim.tid, victim.d_rid, (*addr, 1), victim.d_blocks, victim.n, 0)
            assert p.call("wait_stat", k + "p", "registrations_total", 1, 10.0)
            if forged == "completion":
                msg: Any = protocol.Completion(victim.tid, victim.d_rid, 0, nbytes=1)
            else:
                msg = protocol.Failure(victim.tid, victim.d_rid, 0, Stage.TRANSFER, Cause.OTHER, "forged")
            # sealed with the second P's own key: its seal verifies, the message is still not its to send
            p.call("forge_notif", k + "e", f"D{k}-d0", protocol.encode(msg), (f"D{k}", 0))
            d.wait_logged([f"ignored a message for {victim.tid} naming P rank 0 from P {other[0]}:{other[1]}"])
            assert d.call("results", k + "d", 1, 0.0) == [], "D took the forged message"
            assert d.call("stats", k + "d")["pending"] == 1
            p.call("prefill", k + "p", victim.tid, victim.p_rid, victim.p_blocks, victim.n)
            [res] = d.call("results", k + "d", 1, 15.0)
            assert res.ok, res
            exp = make_cache(g, None)
            apply_push(exp, g, p.call("snapshot", k + "e"), g, decoy)
            apply_push(exp, g, p.call("snapshot", k + "p"), g, victim)
            assert_same(d.call("snapshot", k + "d"), exp, g)
        finally:
            p.call("close", k + "e")


def test_d_dials_no_p_outside_its_allow_list(nodes: tuple[Node, Node]) -> None:
    """With ``allowed_prefills``, a registration or cancel naming another address fails at once, saying
    why, and no connection reaches that address; a P on the list pushes byte for byte."""
    p, d = nodes
    g = Geom(num_blocks=32)
    k = f"allow{next(_ids)}"
    addr = tuple(p.call("sender", k + "p", g, FAST, "P" + k, 7))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        d.call("receiver", k + "d", g, {**FAST, "allowed_prefills": [f"127.0.0.1:{addr[1]}"]}, "D" + k)
        try:
            d.call("logs")
            d.call("register", k + "d", "outside", "d1", ("127.0.0.1", port, 1), [1, 2], 30, 0)
            [res] = d.call("results", k + "d", 1, 10.0)
            assert not res.ok and f"127.0.0.1:{port} is not in this D's allowed_prefills" in res.reason, res
            d.call("cancel", k + "d", "outside2", "d2", ("127.0.0.1", port, 1), "gone")
            victim = Req("inside", "pv", "dv", [3, 4], [5, 6], 30)
            d.call("register", k + "d", victim.tid, victim.d_rid, (*addr, 1), victim.d_blocks, victim.n, 0)
            p.call("prefill", k + "p", victim.tid, victim.p_rid, victim.p_blocks, victim.n)
            _check_pushed(p, d, k, g, victim)
            assert select.select([listener], [], [], 0.5)[0] == [], "D connected to an address outside its list"
        finally:
            d.call("close", k + "d")
    finally:
        p.call("close", k + "p")
        listener.close()
