"""D's links to its P ranks (``kvpush.decode.link``): hello, refusals, heartbeats, death and fencing, over every
interleaving.

The state machine plays D's registrations, D's fencing (who waits on a
link, who is quarantined on it), the network and P ranks that answer hellos
(ok, busy, refused; late, with the epoch of an older hello; or never: frozen)
around a real ``Links``, with time passed in. It checks the rules as
properties of what the links ask for, without restating the code:

- every hello of a link carries one more epoch than the one before;
- only the answer to a link's latest hello, while that hello waits, counts: any
  other (an older epoch; the session in which P was declared dead) is stale and
  changes nothing, so a late answer never fences a quarantined writer;
- a P rank is declared dead only after ``peer_dead_s`` without a word, and
  only while something waits on it (a registration's hello, or a writer);
- while writers are quarantined on a dead (or refused) link, a fencing hello
  goes out every ``heartbeat_s``; one unanswered for ``peer_dead_s`` is sent
  again; a busy refusal is asked again while writers wait;
- a registration never waits on a link that cannot answer it (a fencing hello
  sent long ago, a link silent past ``peer_dead_s``, a refusal past its
  retry), and never redials a link that is fine;
- a ready link sends heartbeats numbered 1, 2, ... at least ``heartbeat_s`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvpush.core import protocol
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.topology import ConnKey
from kvpush.decode.fencing_actions import UNKNOWN_SENDER
from kvpush.decode.link import (
    REFUSED_RETRY_S,
    Dead,
    Heartbeat,
    Hello,
    Links,
    LinkState,
    Ready,
    Refused,
    StaleReply,
)

PEER_DEAD_S = 5.0
HEARTBEAT_S = 1.0
KEYS: tuple[ConnKey, ...] = (("p", 1), ("p", 2))
LAYOUT = KVLayout(
    block_size=16,
    num_blocks=8,
    block_stride=4096,
    head_bytes=256,
    num_heads=1,
    head_start=0,
    local_heads=1,
    order=TokenOrder.HND,
    mem=MemKind.DRAM,
    dtype="bfloat16",
    regions=(Region(base=1 << 30, size=8 * 4096, device_id=0),),
)


@dataclass
class FakeFences:
    """D's fencing, as the links see it: which links writers wait on, and which hold quarantined writers."""

    waits: set[ConnKey] = field(default_factory=set)
    quarantined: set[ConnKey] = field(default_factory=set)

    def writes_on(self, conn: ConnKey) -> bool:
        return conn in self.waits

    def quarantined_on(self, conn: ConnKey) -> bool:
        return conn in self.quarantined


@dataclass
class Seen:
    """What the test saw of one link (from the actions only)."""

    epochs: list[int] = field(default_factory=list)  # every hello's epoch, in order
    hello_at: float = 0.0
    by_registration: bool = False  # the latest hello was a registration's (``open``), not a tick's
    waited_at_hello: bool = False  # writers waited on the link when the latest hello went out
    answered: bool = False  # the latest hello was answered (ok or refused)
    state: str = "none"  # none | hello | ready | refused | busy | dead
    since: float = 0.0  # when it entered that state
    heard: float = 0.0  # the last word from P (a message, or the hello itself)
    dead_epochs: set[int] = field(default_factory=set)
    ready_epochs: set[int] = field(default_factory=set)
    hb_seq: int = 0
    hb_at: float = float("-inf")
    agent: str = ""


class LinkMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fences = FakeFences()
        self.links = Links(PEER_DEAD_S, HEARTBEAT_S, self.fences)
        self.now = 0.0
        self.seen = {k: Seen() for k in KEYS}
        self.failures: dict[ConnKey, str] = {}

    # -- the shell: every action checked against the rules ---------------------------------------------
    def _take(self, actions: list, by_registration: bool) -> None:
        for a in actions:
            s = self.seen[a.key]
            if isinstance(a, Hello):
                assert a.epoch == (s.epochs[-1] if s.epochs else 0) + 1, f"epochs skip or repeat: {s.epochs} {a}"
                s.epochs.append(a.epoch)
                s.hello_at = s.heard = s.since = self.now
                s.by_registration, s.waited_at_hello = by_registration, a.key in self.fences.waits
                s.answered, s.state, s.hb_seq, s.hb_at = False, "hello", 0, float("-inf")
            elif isinstance(a, Heartbeat):
                assert s.state == "ready", f"a heartbeat on a link not ready: {s}"
                assert a.seq == s.hb_seq + 1 and self.now - s.hb_at >= HEARTBEAT_S, (a, s)
                s.hb_seq, s.hb_at = a.seq, self.now
            elif isinstance(a, Dead):
                silent = self.now - s.heard
                assert silent > PEER_DEAD_S, f"declared dead after {silent}s of silence"
                registration = s.state == "hello" and (s.by_registration or s.waited_at_hello)
                assert registration or (s.state == "ready" and a.key in self.fences.waits), f"nobody waited: {s}"
                assert a.epoch == s.epochs[-1] and a.agent == (s.agent if s.state == "ready" else "")
                assert self.failures.get(a.key, "") in a.reason
                s.dead_epochs.add(a.epoch)
                s.state, s.since = "dead", self.now
            else:
                raise AssertionError(f"not a tick's or a registration's action: {a}")

    # -- D's registrations and fencing ---------------------------------------------------------------
    @rule(key=st.sampled_from(KEYS))
    def register(self, key: ConnKey) -> None:
        """A registration needs the link to ``key``: it is ready and fresh, or a hello of its own goes out."""
        s = self.seen[key]
        before = s.epochs[-1] if s.epochs else 0
        fine = s.state == "ready" and self.now - s.heard <= PEER_DEAD_S
        waiting = s.state == "hello" and (s.by_registration or s.waited_at_hello)
        refused_recently = s.state in ("refused", "busy") and self.now - s.since < REFUSED_RETRY_S
        self._take(self.links.open(key, self.now), by_registration=True)
        redialed = (s.epochs[-1] if s.epochs else 0) != before
        if fine or waiting or refused_recently:
            assert not redialed, f"redialed a link that did not need it: {s}"
        else:
            assert redialed, f"a registration waits on a link that cannot answer it: {s}"
        standing = self.links.standing(key)
        assert standing is not None and standing.epoch == s.epochs[-1]

    @rule(key=st.sampled_from(KEYS), waits=st.booleans(), quarantined=st.booleans())
    def fencing_changes(self, key: ConnKey, waits: bool, quarantined: bool) -> None:
        """Writers start or stop waiting on ``key``, or are quarantined on it, or released."""
        (self.fences.waits.add if waits else self.fences.waits.discard)(key)
        (self.fences.quarantined.add if quarantined else self.fences.quarantined.discard)(key)

    # -- P and the network ---------------------------------------------------------------------------
    @precondition(lambda self: any(s.epochs for s in self.seen.values()))
    @rule(data=st.data(), answer=st.sampled_from(["ok", "busy", "refused"]))
    def p_answers(self, data, answer: str) -> None:
        """P answers one of the hellos it got: the latest, or an older one arriving late."""
        key = data.draw(st.sampled_from([k for k in KEYS if self.seen[k].epochs]))
        s = self.seen[key]
        epoch = data.draw(st.sampled_from(s.epochs))
        agent = f"agent-{key[1]}-{epoch}"
        msg = protocol.HelloReply(
            ok=answer == "ok",
            reason="" if answer == "ok" else "no",
            rank=key[1],
            agent_name=agent,
            layout=LAYOUT if answer == "ok" else None,
            epoch=epoch,
            busy=answer == "busy",
        )
        before = self.links.standing(key)
        self.links.heard(key, self.now)
        s.heard = self.now
        out = self.links.hello_reply(key, msg, self.now)
        counts = epoch == s.epochs[-1] and s.state == "hello"
        if not counts:
            assert out == [StaleReply(key, epoch, s.epochs[-1])], out
            assert self.links.standing(key) == before, "a stale answer changed the link"
            return
        s.answered, s.since = True, self.now
        if answer == "ok":
            assert out == [Ready(key, epoch)], out
            assert epoch not in s.dead_epochs and epoch not in s.ready_epochs
            s.ready_epochs.add(epoch)
            s.state, s.agent = "ready", agent
            assert self.links.key_of(agent) == key
        else:
            [refused] = out
            assert isinstance(refused, Refused) and refused.busy == (answer == "busy"), out
            s.state = "busy" if answer == "busy" else "refused"
        standing = self.links.standing(key)
        assert standing is not None and standing.state is LinkState(
            {"ok": "ready", "busy": "refused", "refused": "refused"}[answer]
        )
        assert (standing.layout is not None) == (answer == "ok")

    @rule(key=st.sampled_from(KEYS), via_agent=st.booleans())
    def p_speaks(self, key: ConnKey, via_agent: bool) -> None:
        """A message from P on the link, or a NIXL notification from its agent (known once it said ready)."""
        s = self.seen[key]
        if via_agent:
            if not s.agent:
                self.links.heard_from_agent("nobody", self.now)
                assert self.links.key_of("nobody") == UNKNOWN_SENDER
                return
            self.links.heard_from_agent(s.agent, self.now)
        else:
            self.links.heard(key, self.now)
        if s.epochs:
            s.heard = self.now

    @rule(key=st.sampled_from(KEYS), failure=st.sampled_from(["", "the CURVE handshake failed"]))
    def socket_fails(self, key: ConnKey, failure: str) -> None:
        self.failures[key] = failure

    @rule(dt=st.sampled_from([0.0, 0.5, HEARTBEAT_S, PEER_DEAD_S, PEER_DEAD_S + 0.5, REFUSED_RETRY_S]))
    def time_passes(self, dt: float) -> None:
        """Time passes and the links tick (heartbeats, deaths, fencing hellos)."""
        self.now += dt
        due = {k: self._fencing_hello_due(k) for k in KEYS}
        beat = {
            k: self.seen[k].state == "ready" and self.now - max(self.seen[k].hb_at, 0.0) >= HEARTBEAT_S for k in KEYS
        }
        dies = {k: self._death_due(k) for k in KEYS}
        out = self.links.tick(self.now, self.failures)
        for a in out:
            assert not isinstance(a, Hello) or due[a.key], f"a fencing hello nothing asked for: {a}"
        self._take(out, by_registration=False)
        for k in KEYS:
            if due[k]:
                assert self.seen[k].state == "hello" and self.seen[k].hello_at == self.now, f"no fencing hello: {k}"
            assert not beat[k] or Heartbeat(k, self.seen[k].hb_seq) in out, f"no heartbeat on a ready link: {k}"
            assert not dies[k] or self.seen[k].state == "dead", f"silent past peer_dead_s, waited on, not dead: {k}"

    def _death_due(self, key: ConnKey) -> bool:
        """A tick now must declare ``key`` dead: silent for ``peer_dead_s`` while a registration's hello, or
        writers, wait on it."""
        s = self.seen[key]
        waited = (s.state == "hello" and (s.by_registration or s.waited_at_hello)) or (
            s.state == "ready" and key in self.fences.waits
        )
        return waited and self.now - s.heard > PEER_DEAD_S

    def _fencing_hello_due(self, key: ConnKey) -> bool:
        """A tick now must say hello to ``key`` again: its fencing hello went unanswered for ``peer_dead_s``,
        or quarantined writers wait for one (or writers wait past a busy answer) ``heartbeat_s`` after the
        link died or was refused."""
        s = self.seen[key]
        fencing_hello = s.state == "hello" and not s.by_registration and not s.waited_at_hello
        if fencing_hello and self.now - s.hello_at >= PEER_DEAD_S:
            return True
        held = key in self.fences.quarantined or (s.state == "busy" and key in self.fences.waits)
        return s.state in ("dead", "refused", "busy") and self.now - s.since >= HEARTBEAT_S and held


LinkMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_link_state_machine = LinkMachine.TestCase


# -- examples ---------------------------------------------------------------------------------------


def test_a_late_ok_for_the_session_declared_dead_does_not_fence() -> None:
    """P is declared dead while writers wait; its ok to that session's hello, arriving late, is stale: only the
    answer to a later (fencing) hello counts, and that one says Ready."""
    fences = FakeFences(waits={KEYS[0]})
    links = Links(PEER_DEAD_S, HEARTBEAT_S, fences)
    [hello] = links.open(KEYS[0], 0.0)
    reply = protocol.HelloReply(ok=True, agent_name="a", layout=LAYOUT, epoch=hello.epoch)
    assert links.hello_reply(KEYS[0], reply, 0.1) == [Ready(KEYS[0], 1)]
    [dead] = [a for a in links.tick(PEER_DEAD_S + 1.0) if isinstance(a, Dead)]
    assert dead.epoch == 1 and dead.agent == "a"
    assert links.hello_reply(KEYS[0], reply, PEER_DEAD_S + 1.1) == [StaleReply(KEYS[0], 1, 1)]
    fences.waits.clear()
    fences.quarantined.add(KEYS[0])
    [again] = [a for a in links.tick(PEER_DEAD_S + 1.0 + HEARTBEAT_S) if isinstance(a, Hello)]
    assert again.epoch == 2
    fenced = protocol.HelloReply(ok=True, agent_name="a", layout=LAYOUT, epoch=2)
    assert links.hello_reply(KEYS[0], fenced, PEER_DEAD_S + 3.0) == [Ready(KEYS[0], 2)]


def test_the_hello_reply_says_whether_p_writes_with_peer_copies() -> None:
    """A ready link carries P's word on peer copies to the registrations sent on it; a new session's reply
    replaces it."""
    links = Links(PEER_DEAD_S, HEARTBEAT_S, FakeFences())
    links.open(KEYS[0], 0.0)
    links.hello_reply(KEYS[0], protocol.HelloReply(ok=True, layout=LAYOUT, epoch=1, peer_copies=True), 0.0)
    standing = links.standing(KEYS[0])
    assert standing is not None and standing.peer_copies
    links.open(KEYS[0], 10 * PEER_DEAD_S)  # stale: a new hello
    links.hello_reply(KEYS[0], protocol.HelloReply(ok=True, layout=LAYOUT, epoch=2), 10 * PEER_DEAD_S)
    standing = links.standing(KEYS[0])
    assert standing is not None and not standing.peer_copies


def test_a_silent_link_nobody_waits_on_is_not_declared_dead() -> None:
    """A ready link with no writer waiting falls silent: nothing dies; the next registration says hello again."""
    links = Links(PEER_DEAD_S, HEARTBEAT_S, FakeFences())
    links.open(KEYS[0], 0.0)
    links.hello_reply(KEYS[0], protocol.HelloReply(ok=True, layout=LAYOUT, epoch=1), 0.0)
    assert not [a for a in links.tick(10 * PEER_DEAD_S) if isinstance(a, Dead)]
    assert links.open(KEYS[0], 10 * PEER_DEAD_S) == [Hello(KEYS[0], 2)]


def test_a_link_p_forgot_says_hello_again_at_the_next_registration() -> None:
    """P refused a registration for want of a hello (it forgot this D rank): a ready link, fresh as it looks,
    says hello again at the next registration; the next one after that uses the new session."""
    links = Links(PEER_DEAD_S, HEARTBEAT_S, FakeFences())
    links.open(KEYS[0], 0.0)
    links.hello_reply(KEYS[0], protocol.HelloReply(ok=True, layout=LAYOUT, epoch=1), 0.0)
    assert links.open(KEYS[0], 1.0) == []
    links.forgotten(KEYS[1])  # no link: nothing to do
    links.forgotten(KEYS[0])
    assert links.open(KEYS[0], 1.0) == [Hello(KEYS[0], 2)]
    links.forgotten(KEYS[0])  # waiting for its hello's answer: it is saying hello already
    assert links.open(KEYS[0], 1.1) == []
    links.hello_reply(KEYS[0], protocol.HelloReply(ok=True, layout=LAYOUT, epoch=2), 1.2)
    assert links.open(KEYS[0], 1.3) == []
