"""Which NIXL peers an agent keeps loaded (``kvpush.core.peer_loads``), over any run of hellos, give-ups,
WRITEs and time, for each combination of the two backend traits it follows.

A model of NIXL's agent carries out the machine's actions (an unload of a peer not loaded, or a load of
metadata already loaded, is a fault of the rules) and tracks which peers have WRITEs unreleased. After every
step:

- NIXL holds loaded exactly the peers the machine says are in use or retired: nothing leaks, nothing is
  unloaded twice;
- metadata already loaded is never loaded again (on LIBFABRIC the reload's handshake would never be
  answered), and a peer in use is never unloaded;
- where a live peer can be reloaded nothing is kept but for its WRITEs; otherwise at most ``retired_max`` are,
  besides those;
- where a dead peer's WRITEs end by themselves, a peer with WRITEs unreleased is never unloaded (but as the agent
  closes, or once it restarted): unloading would not stop what the transport queued for them. The first look
  after they ended unloads it where a live peer can be reloaded;
- where they would not, a peer given up under WRITEs with a time is kept for the grace, whatever the other
  trait; no retired peer holds WRITEs without a deadline; a stuck peer is unloaded by the first look at or after
  its deadline, and not before it.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.core.peer_loads import LoadNew, PeerLoads, TakenBack, Unload

NAMES = ("D0", "D1", "D2", "D3")
GRACE_S = 3.0
RETIRED_MAX = 2


class _Loads(RuleBasedStateMachine):
    reloads_live_peer = True
    dead_peer_writes_end = True

    def __init__(self) -> None:
        super().__init__()
        self.m = PeerLoads(self.reloads_live_peer, self.dead_peer_writes_end, GRACE_S, RETIRED_MAX)
        self.nixl: dict[str, bytes] = {}  # loaded in NIXL: name -> metadata
        self.epoch = dict.fromkeys(NAMES, 0)  # a peer's process: a new epoch is a restart (new metadata)
        self.writes: dict[str, int] = {}  # unreleased WRITEs per peer
        self.deadline: dict[str, float] = {}  # stuck peers: the grace's end, as given up
        self.now = 0.0

    def _unload(self, actions: tuple[Unload, ...] | list[Unload], writing_may_go: bool = False) -> None:
        """Carry out unloads; ``writing_may_go``: the agent closes, or the peer restarted (its WRITEs are gone)."""
        for a in actions:
            assert a.name in self.nixl, f"unloads {a.name}, which is not loaded"
            assert a.name not in self.m.in_use, f"unloads {a.name}, in use"
            if self.dead_peer_writes_end and not writing_may_go:
                assert a.name not in self.writes, f"unloads {a.name} under WRITEs that would end by themselves"
            del self.nixl[a.name]
            self.writes.pop(a.name, None)  # unloading ends its WRITEs (failed)
            self.deadline.pop(a.name, None)

    @rule(name=st.sampled_from(NAMES), restart=st.booleans())
    def hello(self, name: str, restart: bool) -> None:
        if restart:
            self.epoch[name] += 1
        meta = f"{name}:{self.epoch[name]}".encode()
        verdict = self.m.add(meta, name)
        if isinstance(verdict, TakenBack):
            assert self.nixl.get(verdict.name) == meta
            self.deadline.pop(verdict.name, None)
            return
        assert isinstance(verdict, LoadNew)
        self._unload(verdict.unload_first, writing_may_go=restart)
        assert meta not in self.nixl.values(), "loads metadata already loaded"
        assert name not in self.nixl or self.reloads_live_peer or name in self.m.in_use
        self.nixl[name] = meta
        self.m.loaded(name, meta)

    @rule(name=st.sampled_from(NAMES))
    def write(self, name: str) -> None:
        if name in self.m.in_use:
            self.writes[name] = self.writes.get(name, 0) + 1

    @rule(name=st.sampled_from(NAMES))
    def release(self, name: str) -> None:
        if self.writes.get(name):
            self.writes[name] -= 1
            if not self.writes[name]:
                del self.writes[name]

    @rule(name=st.sampled_from(NAMES), timed=st.booleans())
    def give_up(self, name: str, timed: bool) -> None:
        in_use = name in self.m.in_use
        writing = name in self.writes
        acts = self.m.remove(name, writing, self.now if timed else None)
        stuck = writing and not self.dead_peer_writes_end and timed
        if in_use and stuck:
            self.deadline[name] = self.now + GRACE_S
        self._unload(acts)
        draining = writing and self.dead_peer_writes_end
        if in_use and (draining or stuck):
            assert name in self.nixl, "a peer given up under WRITEs is unloaded at once"
        elif in_use and (self.reloads_live_peer or writing):
            assert name not in self.nixl, "a peer that must go stays loaded"

    @rule(dt=st.sampled_from([0.5, 1.0, GRACE_S]))
    def look(self, dt: float) -> None:
        self.now += dt
        due = {n for n, t in self.deadline.items() if t <= self.now and n in self.writes}
        self._unload(self.m.expire(self.now, set(self.writes)))
        assert not due & set(self.nixl), f"stuck peers past their grace still loaded: {due & set(self.nixl)}"
        assert self.m.draining <= set(self.writes), "a peer drains with no WRITE left"
        for n in [n for n in self.deadline if n not in self.writes]:
            del self.deadline[n]  # its WRITEs ended first: it stays as retired

    @precondition(lambda self: self.m.loaded_names())
    @rule()
    def close(self) -> None:
        self._unload(self.m.close(), writing_may_go=True)
        assert not self.nixl

    @invariant()
    def loads_match(self) -> None:
        assert set(self.nixl) == self.m.loaded_names()
        assert not set(self.m.in_use) & set(self.m.retired)
        assert all(self.nixl[n] == meta for n, meta in (*self.m.in_use.items(), *self.m.retired.items()))
        kept = set(self.m.retired) - self.m.draining - set(self.m.stuck_until)
        assert len(kept) <= (0 if self.reloads_live_peer else RETIRED_MAX)
        assert set(self.m.stuck_until) <= set(self.m.retired) and self.m.draining <= set(self.m.retired)
        assert not self.m.draining or self.dead_peer_writes_end

    @invariant()
    def writes_that_end_keep_their_peer_loaded(self) -> None:
        if self.dead_peer_writes_end:
            assert set(self.writes) <= set(self.nixl), f"unloaded under WRITEs: {set(self.writes) - set(self.nixl)}"

    @invariant()
    def no_writes_held_for_ever(self) -> None:
        if not self.dead_peer_writes_end:
            held = {n for n in self.m.retired if n in self.writes}
            assert held <= set(self.m.stuck_until), f"retired with WRITEs and no deadline: {held}"
            for n in held:
                assert self.m.stuck_until[n] == self.deadline[n]


def _case(reloads: bool, writes_end: bool) -> type[_Loads]:
    return type(
        f"Loads_{reloads}_{writes_end}", (_Loads,), {"reloads_live_peer": reloads, "dead_peer_writes_end": writes_end}
    )


@pytest.mark.parametrize("reloads", [True, False], ids=["reloads", "keeps"])
@pytest.mark.parametrize("writes_end", [True, False], ids=["writes-end", "writes-stick"])
def test_peer_loads_over_any_run(reloads: bool, writes_end: bool) -> None:
    machine = _case(reloads, writes_end)
    machine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()


def test_a_restarted_peer_is_unloaded_before_its_new_metadata_loads() -> None:
    m = PeerLoads(reloads_live_peer=False, dead_peer_writes_end=True)
    m.loaded("D0", b"D0:1")
    assert m.remove("D0", writing=False, now=1.0) == []
    assert m.add(b"D0:2", "D0") == LoadNew((Unload("D0"),))
    assert m.add(b"D1:1", "D1") == LoadNew()


def test_a_stalled_peer_back_within_its_grace_is_taken_back_on_its_old_load() -> None:
    m = PeerLoads(reloads_live_peer=False, dead_peer_writes_end=False, grace_s=GRACE_S)
    m.loaded("D0", b"D0:1")
    assert m.remove("D0", writing=True, now=10.0) == []
    assert m.expire(12.9, {"D0"}) == []
    assert m.add(b"D0:1", "D0") == TakenBack("D0")
    assert m.expire(20.0, {"D0"}) == [] and m.in_use == {"D0": b"D0:1"}


def test_a_peer_given_up_under_writes_that_end_stays_loaded_until_they_have() -> None:
    """UCX: a D rank declared dead (cut off by the network) with a WRITE in flight is not unloaded then (that
    fails the WRITE in NIXL's eyes while its queued bytes still reach D once the network heals), but by the
    first look after the WRITE ended."""
    m = PeerLoads(reloads_live_peer=True, dead_peer_writes_end=True)
    m.loaded("D0", b"D0:1")
    assert m.remove("D0", writing=True, now=10.0) == [] and m.draining == {"D0"}
    assert m.expire(1e9, {"D0"}) == []  # never on a timer
    assert m.expire(1e9, set()) == [Unload("D0")] and not m.loaded_names()
    m.loaded("D1", b"D1:1")
    assert m.remove("D1", writing=True, now=None) == []
    assert m.add(b"D1:1", "D1") == TakenBack("D1") and not m.draining  # back before its WRITE ended


def test_a_peer_given_up_under_writes_that_stick_gets_the_grace_where_it_could_be_reloaded() -> None:
    """LIBFABRIC on NIXL 1.3.2: a D rank given up under a WRITE is kept for the grace (a D cut off briefly is back
    on its old connection and its WRITE ends), then unloaded once the WRITE ended, or at the deadline."""
    m = PeerLoads(reloads_live_peer=True, dead_peer_writes_end=False, grace_s=GRACE_S)
    m.loaded("D0", b"D0:1")
    m.loaded("D1", b"D1:1")
    assert m.remove("D0", writing=True, now=10.0) == [] and m.remove("D1", writing=True, now=10.0) == []
    assert m.expire(11.0, {"D1"}) == [Unload("D0")]  # its WRITE ended within the grace
    assert m.expire(12.9, {"D1"}) == []
    assert m.expire(13.0, {"D1"}) == [Unload("D1")] and not m.loaded_names()
