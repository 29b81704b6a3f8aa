"""Seals (``kvpush.core.seal``, ``kvpush.prefill.seals``, ``kvpush.decode.seals``): which NIXL notifications D
acts on, over every interleaving, without NIXL.

The state machine plays one link of D's across many hellos: P ranks that answer them (on this protocol or an
older one, giving a key or not, refusing), the honest P of each session sealing notifications with its
``Sealer`` and the network delivering them in any order, late, twice, or after newer sessions began; and a
forger who knows everything but the keys (it has D's metadata, P's agent name, and every sealed frame that
crossed the wire), sending unsealed notifications, frames sealed with keys of its own, genuine seals over
other bodies or epochs, and replays. It checks, as properties:

- on a link whose latest ok answer came from a P that speaks seals, D acts only on a genuine sealed frame of
  that session or the one before, each at most once, never on anything the forger made or replayed;
- every genuine frame of those sessions delivered once, and no more than the replay window behind the
  newest D took, is acted on (a legitimate notification is never lost to the rule);
- whether seals are required changes only with an ok answer (a refused hello, a hello waiting, or anything
  the forger sends leaves it), so nobody off the link downgrades it;
- on a link whose P is on an older protocol, everything unsealed is taken, as before;
- P's greeting (an unsealed heartbeat of sequence 0) is never acted on where seals are required, nor counted.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.core import protocol, seal
from kvpush.core.errors import ProtocolError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.outcome import Cause, Stage
from kvpush.decode import seals
from kvpush.decode.fencing_actions import UNKNOWN_SENDER
from kvpush.decode.link import Links, Ready, SealsChecked
from kvpush.decode.seals import Accepted, Greeting, LinkSeals, Malformed, Unverified, Why
from kvpush.prefill.seals import Sealer

SMALL_WINDOW = 16
"""The replay window the state machine runs with: small, so that "too old" and wrap-around happen."""


# -- the seal itself -----------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=32, max_size=32),
    st.integers(0, (1 << 63) - 1),
    st.integers(1, (1 << 63) - 1),
    st.binary(max_size=300),
)
def test_a_seal_verifies_with_its_key_and_with_nothing_changed(key: bytes, epoch: int, seq: int, body: bytes) -> None:
    """A seal verifies under its key; another key, epoch, sequence number, body or MAC does not; a decoded copy
    of its frame verifies the same."""
    sealed = seal.seal(key, epoch, seq, body)
    assert seal.verifies(key, sealed)
    assert seal.verifies(key, protocol.decode(protocol.encode(sealed)))
    other = bytes([key[0] ^ 1]) + key[1:]
    assert not seal.verifies(other, sealed)
    assert not seal.verifies(key, msgspec.structs.replace(sealed, epoch=epoch ^ 1))
    assert not seal.verifies(key, msgspec.structs.replace(sealed, seq=seq ^ 1 or 2))
    assert not seal.verifies(key, msgspec.structs.replace(sealed, body=body + b"\x00"))
    assert not seal.verifies(key, msgspec.structs.replace(sealed, mac=bytes(a ^ 0x80 for a in sealed.mac)))


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.integers(0, 1 << 40), st.integers(1, 1 << 40), st.binary(max_size=200))
def test_a_key_made_ready_macs_as_the_reference(key: bytes, epoch: int, seq: int, body: bytes) -> None:
    """``seal.Key`` (keyed once, copied per MAC) gives the reference ``seal.mac``, and each verifies the other's."""
    ready = seal.Key(key)
    assert ready.mac(epoch, seq, body) == seal.mac(key, epoch, seq, body)
    assert ready.verifies(seal.seal(key, epoch, seq, body)) and seal.verifies(key, ready.seal(epoch, seq, body))
    assert key.hex() not in repr(ready)


def test_a_mac_is_personalised_with_its_direction() -> None:
    """What P seals for D does not verify as the other direction (a future seal of D's cannot be reflected)."""
    key = bytes(32)
    assert seal.mac(key, 1, 2, b"x") != seal.mac(key, 1, 2, b"x", person=b"kvpush-seal-d2p")


@st.composite
def _seqs(draw: st.DrawFn) -> tuple[int, list[int]]:
    size = draw(st.sampled_from([8, 16, 64]))
    base = draw(st.integers(1, 1 << 40))
    seqs = draw(st.lists(st.integers(0, 4 * size).map(lambda x: base + x), max_size=200))
    jumps = draw(st.lists(st.integers(0, 1 << 20), max_size=3))
    return size, seqs + [base + j for j in jumps]


@settings(max_examples=300, deadline=None)
@given(_seqs())
def test_the_replay_window_takes_each_number_once_and_none_too_old(case: tuple[int, list[int]]) -> None:
    """Against a model that remembers everything: a number is taken iff it was never taken and is less than the
    window's size behind the newest taken; refused as a replay iff taken before (within the window), as too old
    iff that far behind."""
    size, seqs = case
    window = seal.Window(size)
    taken: set[int] = set()
    newest = 0
    for s in seqs:
        got = window.take(s)
        if s <= newest - size:
            assert got is seal.Fresh.TOO_OLD, (s, newest)
        elif s in taken:
            assert got is seal.Fresh.REPLAYED, s
        else:
            assert got is seal.Fresh.NEW, s
            taken.add(s)
            newest = max(newest, s)


def test_a_window_is_a_whole_number_of_bytes() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        seal.Window(12)


# -- P's rule ------------------------------------------------------------------------------------------------


def test_p_seals_only_once_d_says_it_checks_that_very_session() -> None:
    """Until the D rank says it checks this session's seals, notifications go as they are (a D on an older
    protocol would refuse a sealed one); a word for another session changes nothing; then each is sealed with
    the next number."""
    key = secrets.token_bytes(seal.KEY_BYTES)
    sealer = Sealer(key, epoch=3)
    done = protocol.encode(protocol.Completion("t", "r", 0))
    assert sealer.seal(done) == done
    assert not sealer.checks(2) and sealer.seal(done) == done
    assert sealer.checks(3)
    got = [protocol.decode(sealer.seal(done)) for _ in range(3)]
    assert [(g.epoch, g.seq, g.body) for g in got] == [(3, 1, done), (3, 2, done), (3, 3, done)]
    assert all(seal.verifies(key, g) for g in got)
    assert key.hex() not in repr(sealer) and "Sealer(epoch=3" in repr(sealer)
    with pytest.raises(ValueError, match="32 bytes"):
        Sealer(b"short", 1)


def test_the_wire_bounds_what_a_seal_carries() -> None:
    """A key, a MAC or a sequence number of the wrong size, or an oversized body, is a ``ProtocolError``; a key
    is never shown in a message's repr."""
    good = protocol.Sealed(1, 1, bytes(16), b"x")
    for bad in (
        {"mac": b"\x00" * 15},
        {"seq": 0},
        {"body": b"\x00" * (protocol.MAX_SEALED_BODY + 1)},
        {"epoch": -1},
    ):
        raw = msgspec.msgpack.decode(protocol.encode(good))
        raw[1].update(bad)
        with pytest.raises(ProtocolError):
            protocol.decode(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(protocol.encode(protocol.LinkKey(bytes(32), 1)))
    raw[1]["key"] = bytes(31)
    with pytest.raises(ProtocolError):
        protocol.decode(msgspec.msgpack.encode(raw))
    assert bytes(range(32)).hex() not in repr(protocol.LinkKey(bytes(range(32)), 4))


# -- D's rule, one link across its hellos --------------------------------------------------------------------


@dataclass
class Session:
    """The model of one session: its hello's epoch, P's key and version, and what its P sealed."""

    epoch: int
    key: bytes | None
    version: int
    sealer: Sealer | None = None
    frames: list[bytes] = field(default_factory=list)  # sealed, not delivered yet
    delivered: list[bytes] = field(default_factory=list)
    taken: set[int] = field(default_factory=set)  # sequence numbers D took
    newest: int = 0


def _notif(i: int) -> bytes:
    kinds = (
        protocol.Completion(f"t{i}", "r", 0, region_start=0, region_end=1),
        protocol.Failure(f"t{i}", "r", 0, Stage.TRANSFER, Cause.OTHER, "why"),
        protocol.Heartbeat("p", 0, i + 1, 0.0),
    )
    return protocol.encode(kinds[i % 3])


class OneLink(RuleBasedStateMachine):
    """One link's ``LinkSeals`` against the model of the module's docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.seals = LinkSeals(window=SMALL_WINDOW)
        self.epoch = 0
        self.pending: Session | None = None
        self.current: Session | None = None
        self.previous: Session | None = None
        self.older: list[Session] = []
        self.required = False
        self.wire: list[protocol.Sealed] = []  # every sealed frame that crossed the wire: the forger reads them
        self.n = 0

    # -- hellos ---------------------------------------------------------------------------------------------
    @precondition(lambda self: self.pending is None)
    @rule(version=st.sampled_from([protocol.OLDEST_PROTOCOL_VERSION, protocol.ROUNDS_VERSION, protocol.SEALS_VERSION]))
    def hello(self, version: int) -> None:
        """D says hello; P gives a key with it iff it speaks seals (as ``PeerTable._on_hello`` does)."""
        self.epoch += 1
        key = secrets.token_bytes(seal.KEY_BYTES) if version >= protocol.SEALS_VERSION else None
        self.pending = Session(self.epoch, key, version)
        if key is not None:
            self.seals.offer(self.epoch, key)

    @precondition(lambda self: self.pending is not None)
    @rule(ok=st.booleans())
    def answer(self, ok: bool) -> None:
        s = self.pending
        assert s is not None
        self.pending = None
        if not ok:
            self.seals.refused()
            return
        checks = self.seals.answered(s.epoch, s.version)
        self.required = s.version >= protocol.SEALS_VERSION
        if self.previous is not None:
            self.older.append(self.previous)
        self.previous, self.current = self.current, s
        assert checks == (self.required and s.key is not None)
        if checks:
            assert s.key is not None
            s.sealer = Sealer(s.key, s.epoch)
            s.sealer.checks(s.epoch)  # D's SealsChecked reached P

    # -- the honest P of a session ---------------------------------------------------------------------------
    @precondition(lambda self: self.current is not None or self.previous is not None)
    @rule(which=st.sampled_from(["current", "previous"]), n=st.integers(1, 2 * SMALL_WINDOW))
    def p_notifies(self, which: str, n: int) -> None:
        """The P of a session (the previous one's still has notifications on their way) sends ``n``."""
        s = self.current if which == "current" else self.previous
        if s is None:
            return
        for _ in range(n):
            self.n += 1
            frame = s.sealer.seal(_notif(self.n)) if s.sealer is not None else _notif(self.n)
            s.frames.append(frame)

    def _sessions(self) -> list[Session]:
        return [s for s in (self.current, self.previous, *self.older) if s is not None]

    @precondition(lambda self: any(s.frames for s in self._sessions()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """The network delivers one of P's notifications, any of them, in any order."""
        s = data.draw(st.sampled_from([s for s in self._sessions() if s.frames]))
        frame = s.frames.pop(data.draw(st.integers(0, len(s.frames) - 1)))
        msg = protocol.decode(frame)
        verdict = self.seals.check(msg)
        s.delivered.append(frame)
        if not isinstance(msg, protocol.Sealed):  # its P speaks no seals (or D had not checked yet)
            assert s.sealer is None
            if self.required:
                assert isinstance(verdict, Greeting | Unverified) and not isinstance(verdict, Accepted)
            else:
                assert verdict == Accepted(msg, sealed=False)
            return
        self.wire.append(msg)
        live = s is self.current or s is self.previous
        if not live:
            assert verdict == Unverified(Why.NO_SESSION, msg.epoch, msg.seq)
        elif msg.seq <= s.newest - SMALL_WINDOW:
            assert verdict == Unverified(Why.TOO_OLD, msg.epoch, msg.seq)
        else:
            assert isinstance(verdict, Accepted) and verdict.sealed, verdict
            assert protocol.encode(verdict.msg) == msg.body
            s.taken.add(msg.seq)
            s.newest = max(s.newest, msg.seq)

    # -- the forger ------------------------------------------------------------------------------------------
    @rule(data=st.data(), kind=st.sampled_from(["unsealed", "greeting", "own_key", "swapped", "epoch", "replay"]))
    def forge(self, data: st.DataObject, kind: str) -> None:
        self.n += 1
        body = _notif(self.n)
        required_before = self.required
        if kind == "unsealed":
            msg = protocol.decode(body)
            if isinstance(msg, protocol.Heartbeat) and msg.seq == 0:
                return
            verdict = self.seals.check(msg)
            assert verdict == (Unverified(Why.UNSEALED) if self.required else Accepted(msg, sealed=False))
        elif kind == "greeting":
            msg = protocol.Heartbeat("p", 0, 0, 0.0)
            verdict = self.seals.check(msg)
            assert verdict == (Greeting() if self.required else Accepted(msg, sealed=False))
        else:
            if kind == "own_key":
                epoch = data.draw(st.integers(0, self.epoch + 1))
                forged = seal.seal(secrets.token_bytes(seal.KEY_BYTES), epoch, data.draw(st.integers(1, 99)), body)
            elif not self.wire:
                return
            else:
                genuine = data.draw(st.sampled_from(self.wire))
                if kind == "swapped":
                    forged = msgspec.structs.replace(genuine, body=body)
                elif kind == "epoch":
                    forged = msgspec.structs.replace(genuine, epoch=data.draw(st.integers(0, self.epoch + 1)))
                    if forged.epoch == genuine.epoch:
                        forged = msgspec.structs.replace(forged, seq=genuine.seq + 1)
                else:
                    forged = genuine
            verdict = self.seals.check(protocol.decode(protocol.encode(forged)))
            assert isinstance(verdict, Unverified), (kind, verdict)
        assert self.required == required_before

    # -- properties ------------------------------------------------------------------------------------------
    @invariant()
    def required_follows_the_latest_ok_answer(self) -> None:
        assert self.seals.required == self.required


TestOneLink = OneLink.TestCase
TestOneLink.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_a_sealed_frame_whose_body_does_not_decode_is_malformed_not_acted_on() -> None:
    """It verified (so P sealed it: a bug there), but D does not act on what it cannot read."""
    link = LinkSeals()
    key = bytes(range(32))
    link.offer(1, key)
    assert link.answered(1, protocol.SEALS_VERSION)
    verdict = link.check(seal.seal(key, 1, 1, b"\x92\x0b\xc1"))
    assert isinstance(verdict, Malformed)
    sealed_seal = seal.seal(key, 1, 2, protocol.encode(seal.seal(key, 1, 3, _notif(1))))
    assert isinstance(link.check(sealed_seal), Malformed), "a seal inside a seal is not a notification"


def test_a_p_that_says_it_speaks_seals_and_gives_no_key_gets_nothing_acted_on() -> None:
    """A link whose P said v13 requires seals: without a key, nothing it sends is acted on (a broken P fails its
    transfers by their timeouts, it cannot be used to downgrade the link)."""
    link = LinkSeals()
    assert not link.answered(1, protocol.SEALS_VERSION)
    assert link.required
    assert link.check(protocol.decode(_notif(1))) == Unverified(Why.UNSEALED)
    assert isinstance(link.check(seal.seal(bytes(32), 1, 1, _notif(1))), Unverified)


def test_a_notification_of_an_agent_no_link_named_goes_to_fencing_unless_sealed() -> None:
    msg = protocol.decode(_notif(1))
    assert seals.unlinked(msg) == Accepted(msg, sealed=False)
    assert seals.unlinked(seal.seal(bytes(32), 1, 1, _notif(1))) == Unverified(Why.NO_LINK, 1, 1)


# -- the links: the key kept with the hello it came with, and P told -----------------------------------------

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
KEY = ("p", 1)


class _NoFences:
    def writes_on(self, conn: object) -> bool:
        return False

    def quarantined_on(self, conn: object) -> bool:
        return False


def _hello(links: Links, version: int, key: bytes | None, epoch: int, now: float, stray: bool = False) -> list:
    """D's hello of ``epoch`` answered ok by a P of ``version``, with its Features and (``key``) LinkKey; ``stray``:
    a LinkKey of another epoch first, which must change nothing."""
    links.open(KEY, now, again=epoch > 1)
    links.features(KEY, protocol.Features(version, 0, epoch))
    if stray and key is not None:
        links.link_key(KEY, protocol.LinkKey(bytes(32), epoch + 1))
    if key is not None:
        links.link_key(KEY, protocol.LinkKey(key, epoch))
    reply = protocol.HelloReply(ok=True, agent_name="P-p0", layout=LAYOUT, epoch=epoch)
    return links.hello_reply(KEY, reply, now)


def test_d_tells_p_it_checks_seals_before_the_link_is_ready_and_only_where_p_gave_a_key() -> None:
    links = Links(5.0, 1.0, _NoFences())
    key = bytes(range(32))
    assert _hello(links, protocol.SEALS_VERSION, key, 1, 0.0, stray=True) == [SealsChecked(KEY, 1), Ready(KEY, 1)]
    assert links.sealed(KEY)
    done = seal.seal(key, 1, 1, _notif(0))
    assert links.check("P-p0", done)[0] == KEY and isinstance(links.check("P-p0", done)[1], Unverified)  # replayed
    assert links.check("P-p0", seal.seal(key, 1, 2, _notif(0)))[1] == Accepted(protocol.decode(_notif(0)), True)
    assert links.check("P-p0", protocol.decode(_notif(0))) == (KEY, Unverified(Why.UNSEALED))
    assert links.check("another", protocol.decode(_notif(0))) == (
        UNKNOWN_SENDER,
        Accepted(protocol.decode(_notif(0)), False),
    )
    # a LinkKey after the answer is not the session's: the next seal of it does not verify
    links.link_key(KEY, protocol.LinkKey(bytes(32), 1))
    assert isinstance(links.check("P-p0", seal.seal(bytes(32), 1, 3, _notif(0)))[1], Unverified)
    # P restarted on an older protocol at that address: an ok answer of its own takes the requirement away
    assert _hello(links, protocol.ROUNDS_VERSION, None, 2, 10.0) == [Ready(KEY, 2)]
    assert not links.sealed(KEY)
    assert links.check("P-p0", protocol.decode(_notif(0)))[1] == Accepted(protocol.decode(_notif(0)), False)


def test_a_hello_waiting_for_its_answer_keeps_the_earlier_sessions_seals() -> None:
    """A fencing hello to a P rank declared dead (perhaps frozen) waits: the link still requires seals, and only
    the earlier session's verify; a refusal of it changes nothing either."""
    links = Links(5.0, 1.0, _NoFences())
    key = bytes(range(32))
    _hello(links, protocol.SEALS_VERSION, key, 1, 0.0)
    links.open(KEY, 1.0, again=True)  # epoch 2, no answer yet
    links.features(KEY, protocol.Features(protocol.OLDEST_PROTOCOL_VERSION, 0, 2))  # what a forger cannot send
    assert links.sealed(KEY)
    assert links.check("P-p0", protocol.decode(_notif(0)))[1] == Unverified(Why.UNSEALED)
    assert isinstance(links.check("P-p0", seal.seal(key, 1, 5, _notif(0)))[1], Accepted)
    links.hello_reply(KEY, protocol.HelloReply(ok=False, reason="no", epoch=2), 2.0)
    assert links.sealed(KEY)


# -- both sides, every pairing of versions -------------------------------------------------------------------


@pytest.mark.parametrize("p_seals", [True, False], ids=["P v13", "P v12"])
@pytest.mark.parametrize("d_seals", [True, False], ids=["D v13", "D v12"])
def test_every_pairing_of_versions_pairs_and_only_two_v13_sides_seal(p_seals: bool, d_seals: bool) -> None:
    """P and D as the shells run them, with an older side played by what it does: an older P sends no LinkKey
    and says v12; an older D drops the LinkKey unread and never says it checks seals. Every pairing takes P's
    notifications; they are sealed, and a forger's are dropped, only where both sides are v13."""
    links = Links(5.0, 1.0, _NoFences())
    key = secrets.token_bytes(seal.KEY_BYTES)
    version = protocol.SEALS_VERSION if p_seals else protocol.ROUNDS_VERSION
    links.open(KEY, 0.0)
    if d_seals:  # an older D reads Features as v12 and the LinkKey not at all
        links.features(KEY, protocol.Features(version, 0, 1))
        if p_seals:
            links.link_key(KEY, protocol.LinkKey(key, 1))
    else:
        links.features(KEY, protocol.Features(protocol.ROUNDS_VERSION, 0, 1))
    actions = links.hello_reply(KEY, protocol.HelloReply(ok=True, agent_name="P-p0", layout=LAYOUT, epoch=1), 0.0)
    sealer = Sealer(key, 1) if p_seals else None
    told = [a for a in actions if isinstance(a, SealsChecked)] if d_seals else []
    if sealer is not None:
        for a in told:
            sealer.checks(a.epoch)
    both = p_seals and d_seals
    assert bool(told) == both
    done = _notif(0)
    frame = sealer.seal(done) if sealer is not None else done
    assert (protocol.decode(frame).__class__ is protocol.Sealed) == both
    verdict = links.check("P-p0", protocol.decode(frame))[1]
    assert isinstance(verdict, Accepted) and protocol.encode(verdict.msg) == done
    forged = links.check("P-p0", protocol.decode(_notif(3)))[1]
    assert isinstance(forged, Unverified) == both
