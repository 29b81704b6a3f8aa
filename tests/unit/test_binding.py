"""Transfers bound to the D the router chose (sans-I/O): P's capability rule (``kvpush.core.capability``,
``Rendezvous`` with a ``Binding``), D's rule that only the P ranks it registered with complete or fail a
transfer (``Fencing``), and D's allow-list of P side channels (``kvpush.decode.allow``). Exhaustive over the
verdicts, and driven by hypothesis over every interleaving of honest D ranks (holding the capabilities
the router gave them), an intruder with a key of its own (no capability, a wrong one, or one of its own
transfer only), prefills, WRITEs ending, aborts, dead peers and time."""

from __future__ import annotations

import itertools

import pytest
from helpers_rendezvous import check_holdings
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.core import capability as capmod
from kvpush.core import protocol
from kvpush.core.capability import Binding, derive_key, mint, shared_id, sub_request_id, valid
from kvpush.core.counts import Count
from kvpush.core.errors import ConfigError
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.protocol import Register
from kvpush.decode.allow import Allowed, parse_entry
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import UNKNOWN_SENDER, Cancel, Foreign, Report, SendRegister, Stale
from kvpush.decode.incoming import Asked
from kvpush.prefill.decisions import Prefill, Push, Refuse
from kvpush.prefill.rendezvous import Rendezvous

KEY = derive_key(b"P" * 40)
OTHER = derive_key(b"Q" * 40)


def reg(tid: str, who: str = "dA", cap: str | None = None, serial: int = 1, attempt: int = 0) -> Register:
    blocks = (serial * 10, serial * 10 + 1)
    c = mint(KEY, tid) if cap is None else cap
    return Register(tid, f"{tid}-d", who, 0, (blocks,), 32, lease_ms=4000, attempt=attempt, capability=c)


# -- the capability itself ------------------------------------------------------------------------------


def test_a_capability_is_the_transfers_and_the_fleets() -> None:
    cap = mint(KEY, "t")
    assert len(cap) == capmod.CAPABILITY_CHARS and int(cap, 16) >= 0
    assert valid(KEY, "t", cap)
    assert not valid(KEY, "u", cap), "another transfer's"
    assert not valid(OTHER, "t", cap), "another fleet's key"
    assert not valid(KEY, "t", ""), "none"
    assert not valid(KEY, "t", cap[:-1] + ("0" if cap[-1] != "0" else "1")), "one digit off"
    assert derive_key(b"P" * 40) == KEY != OTHER, "every P rank of a fleet derives the same key"


def test_the_shared_ids_capability_covers_its_sub_requests_only() -> None:
    cap = mint(KEY, "req")
    assert valid(KEY, "req/1.0", cap) and valid(KEY, "req/0.3", cap) and valid(KEY, "req/10.20", cap)
    assert not valid(KEY, "req/x", cap) and not valid(KEY, "other/1.0", cap) and not valid(KEY, "req/1.0/2.0", cap)


@pytest.mark.parametrize(
    "tid",
    [
        "req/\u0661.\u0662",  # Arabic-Indic digits: a regular expression's \d takes them, int() reads them as 1.2
        "req/1.\u0662",
        "req/1\u0661.0",
        "req/\uff11.0",  # fullwidth
        "req/\u00b2.0",  # superscript two
        "req/1.0\n",  # $ matches before a final newline
        "req/01.0",  # no P writes a leading zero
        "req/1.00",
        "req/0.0",  # the first sub-request carries the shared id itself
        "req/-1.0",
        "req/1.",
        "req/.1",
    ],
)
def test_only_the_ids_p_derives_are_covered_by_the_shared_ids_capability(tid: str) -> None:
    """P and D derive a sub-request's id as ``sub_request_id`` writes it: ASCII digits, canonical. Any other
    spelling of the same indexes is another transfer id, which the shared capability does not cover."""
    assert shared_id(tid) is None
    assert not valid(KEY, tid, mint(KEY, "req"))
    assert (
        Binding(KEY).check(tid, mint(KEY, "req"), "registration")
        == "the registration's capability is not this transfer's"
    )


@given(st.text(min_size=1, max_size=12), st.integers(0, 10**6), st.integers(0, 10**6))
@settings(max_examples=300, deadline=None)
def test_every_sub_request_id_is_covered_by_its_shared_ids_capability(shared: str, prompt: int, child: int) -> None:
    tid = sub_request_id(shared, prompt, child)
    assert valid(KEY, tid, mint(KEY, shared))
    assert shared_id(tid) == (None if (prompt, child) == (0, 0) else shared)


DIGITS = "0123456789\u0660\u0661\u0662\u06f1\u0967\uff11\u00b2\u2460"
"""ASCII digits, and other scripts' digits (Arabic-Indic, extended, Devanagari, fullwidth, superscript, circled)."""


@given(
    st.text(min_size=1, max_size=6),
    st.text(DIGITS, min_size=0, max_size=3),
    st.sampled_from([".", "\uff0e", ""]),
    st.text(DIGITS, min_size=0, max_size=3),
    st.sampled_from(["", "\n", " ", "/0.1"]),
)
@settings(max_examples=500, deadline=None)
def test_a_shared_ids_capability_covers_no_id_but_those_p_derives(
    shared: str, prompt: str, dot: str, child: str, tail: str
) -> None:
    """Whatever id a capability of another id covers is one ``sub_request_id`` makes from that id."""
    tid = f"{shared}/{prompt}{dot}{child}{tail}"
    base = shared_id(tid)
    if base is None:
        assert not valid(KEY, tid, mint(KEY, shared))
        return
    p, _, c = tid[len(base) + 1 :].partition(".")
    assert sub_request_id(base, int(p), int(c)) == tid


@pytest.mark.parametrize("required", [True, False])
@pytest.mark.parametrize("given", ["none", "valid", "wrong", "other_transfer"])
def test_binding_check_every_case(required: bool, given: str) -> None:
    cap = {"none": "", "valid": mint(KEY, "t"), "wrong": mint(OTHER, "t"), "other_transfer": mint(KEY, "u")}[given]
    why = Binding(KEY, required).check("t", cap, "registration")
    if given == "valid" or (given == "none" and not required):
        assert why == ""
    elif given == "none":
        assert "carries no capability" in why
    else:
        assert "capability is not this transfer's" in why
    assert cap == "" or cap not in why, "a reason never shows the capability"


def test_messages_never_show_their_capability() -> None:
    r = reg("t")
    a = protocol.Abort("t", "r", "x", capability=mint(KEY, "t"))
    assert mint(KEY, "t") not in repr(r) + str(r) + repr(a) + repr(Asked("t", "r", ((1,),), 16, capability="s3"))
    assert protocol.decode(protocol.encode(r)).capability == mint(KEY, "t"), "it travels"
    assert "s3" not in repr(Cancel("t", "r", ("h", 1), "why", "s3"))


# -- P: registrations and aborts -----------------------------------------------------------------------


def test_registration_without_or_with_a_wrong_capability_is_refused_and_holds_nothing() -> None:
    rv = Rendezvous(binding=Binding(KEY))
    for cap in ("", mint(KEY, "other"), mint(OTHER, "t")):
        [r] = rv.on_register(reg("t", "dX", cap), 0.0, owner="key-X")
        assert isinstance(r, Refuse) and r.cause is Cause.REFUSED and "capability" in r.reason
    assert rv.stage("t") is None and rv.holdings.held(("dX", 0)) == (0, 0)
    assert rv.on_register(reg("t"), 0.0, owner="key-A") == []


def test_a_parked_prefill_goes_only_to_a_registration_with_its_capability() -> None:
    rv = Rendezvous(binding=Binding(KEY))
    rv.on_prefill(Prefill("t", "p", ((5, 6),), 32), 0.0)
    [r] = rv.on_register(reg("t", "dX", ""), 0.1, owner="key-X")
    assert isinstance(r, Refuse)
    [push] = rv.on_register(reg("t"), 0.2, owner="key-A")
    assert isinstance(push, Push) and push.reg.engine_id == "dA"


def test_a_prefill_handed_over_has_its_capability_minted_before_its_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P mints a parked prefill's capability (and its shared id's) at hand-over (``Binding.expect``), so the
    registration's check makes no HMAC; its verdicts are those of ``valid``."""
    capmod._kept.cache_clear()
    rv = Rendezvous(binding=Binding(KEY))
    rv.on_prefill(Prefill("tx/0.1", "p", ((5, 6),), 32), 0.0)
    wrong, shared, own = reg("tx/0.1", "dX", mint(OTHER, "tx")), reg("tx/0.1", cap=mint(KEY, "tx")), reg("tx/0.1")

    def no_hmac(*args: object, **kw: object) -> bytes:
        raise AssertionError("an HMAC while checking a registration")

    monkeypatch.setattr(capmod.hmac, "digest", no_hmac)
    [r] = rv.on_register(wrong, 0.1, owner="key-X")
    assert isinstance(r, Refuse) and r.cause is Cause.REFUSED
    [push] = rv.on_register(shared, 0.2, owner="key-A")
    assert isinstance(push, Push)
    assert Binding(KEY).check("tx/0.1", own.capability, "registration") == ""
    with pytest.raises(AssertionError, match="an HMAC"):
        Binding(KEY).check("never-handed-over", own.capability, "registration")


def test_a_second_key_registering_first_without_the_capability_does_not_take_the_transfer() -> None:
    rv = Rendezvous(binding=Binding(KEY))
    rv.on_register(reg("t", "dX", mint(KEY, "mine")), 0.0, owner="key-X")  # its own transfer's capability
    assert rv.on_register(reg("t"), 0.1, owner="key-A") == []
    [push] = rv.on_prefill(Prefill("t", "p", ((5, 6),), 32), 0.2)
    assert push.reg.engine_id == "dA"


def test_a_re_registration_needs_the_capability_too() -> None:
    rv = Rendezvous(binding=Binding(KEY))
    rv.on_register(reg("t"), 0.0, owner="key-A")
    [r] = rv.on_register(reg("t", cap="", serial=2, attempt=1), 0.1, owner="key-A")
    assert isinstance(r, Refuse) and "no capability" in r.reason
    assert rv.registrations("t")[0][0].attempt == 0, "the first registration stands"


def test_an_abort_needs_the_capability() -> None:
    rv = Rendezvous(binding=Binding(KEY))
    rv.on_register(reg("t"), 0.0, owner="key-A")
    rv.on_prefill(Prefill("parked", "p", ((5,),), 16), 0.0)
    for tid in ("t", "parked", "never-seen"):
        assert "no capability" in rv.may_abort(tid, "key-A", ("dA", 0))
        assert "not this transfer's" in rv.may_abort(tid, "key-X", ("dX", 0), mint(KEY, "mine"))
        assert rv.may_abort(tid, "key-A", ("dA", 0), mint(KEY, tid)) == ""
    assert "another D" in rv.may_abort("t", "key-X", ("dX", 0), mint(KEY, "t")), "the key rule still holds"


def test_without_a_binding_nothing_is_checked() -> None:
    """``"auth": "none"``: every peer is the same nobody; registrations work as before."""
    rv = Rendezvous()
    assert rv.on_register(reg("t", cap=""), 0.0) == []
    assert rv.may_abort("t", "", ("dA", 0)) == ""


def test_optional_a_valid_capability_takes_the_transfer_from_a_key_without_one() -> None:
    rv = Rendezvous(binding=Binding(KEY, required=False))
    thief = reg("t", "dX", "")
    assert rv.on_register(thief, 0.0, owner="key-X") == []
    assert rv.holdings.held(("dX", 0)) == (1, 2)
    out = rv.on_register(reg("t"), 0.1, owner="key-A")
    assert [(type(d), d.reg.engine_id) for d in out] == [(Refuse, "dX")]
    assert rv.holdings.held(("dX", 0)) == (0, 0) and rv.holdings.held(("dA", 0)) == (1, 2)
    [push] = rv.on_prefill(Prefill("t", "p", ((5, 6),), 32), 0.2)
    assert push.reg.engine_id == "dA"
    # bound now: neither a key without a capability nor another key with it takes it back
    assert isinstance(rv.on_register(reg("t", "dX", "", serial=3), 0.3, owner="key-X")[0], Refuse)
    assert isinstance(rv.on_register(reg("t", "dX", serial=4), 0.3, owner="key-X")[0], Refuse)


def test_optional_a_transfer_being_written_is_not_taken() -> None:
    rv = Rendezvous(binding=Binding(KEY, required=False))
    rv.on_prefill(Prefill("t", "p", ((5, 6),), 32), 0.0)
    [push] = rv.on_register(reg("t", "dX", ""), 0.1, owner="key-X")
    assert isinstance(push, Push)
    [r] = rv.on_register(reg("t"), 0.2, owner="key-A")
    assert isinstance(r, Refuse) and r.reg.engine_id == "dA", "the WRITE cannot be recalled"
    assert "capability is not" in Binding(KEY, required=False).check("t", mint(KEY, "u"), "abort")


# -- P: every interleaving -----------------------------------------------------------------------------

TIDS = ("t0", "t1", "mine")  # "mine" is the intruder's own transfer: the router gave it that one's capability
RANKS = (("dA", 0), ("dB", 0), ("intruder", 0))
OWNER_KEY = {"dA": "key-A", "dB": "key-B", "intruder": "key-X"}
INTRUDER_CAPS = ("none", "wrong", "own")


class BindingMachine(RuleBasedStateMachine):
    """Honest D ranks register with the capability the router gave them; the intruder registers and aborts
    any transfer with none, a wrong one or its own transfer's; prefills, WRITEs, dead peers and time."""

    required = True

    def __init__(self) -> None:
        super().__init__()
        self.rv = Rendezvous(prefill_lease_s=5.0, binding=Binding(KEY, self.required))
        self.now = 0.0
        self.serial = itertools.count(1)
        self.flying: set[tuple[str, str, int]] = set()
        self.bound: set[str] = set()  # transfers an honest registration with the capability was taken for

    def _cap(self, tid: str, who: str, kind: str) -> str:
        if who != "intruder":
            return mint(KEY, tid)
        return {"none": "", "wrong": mint(OTHER, tid), "own": mint(KEY, "mine")}[kind]

    def _apply(self, decisions: list) -> None:
        for d in decisions:
            if isinstance(d, Push):
                r = d.reg
                if r.engine_id == "intruder":
                    ok = r.transfer_id == "mine" or (not self.required and not r.capability)
                    assert ok, f"pushed {r.transfer_id} to the intruder"
                    assert r.transfer_id not in self.bound, "pushed a bound transfer to the intruder"
                if self.required:
                    assert valid(KEY, r.transfer_id, r.capability), "pushed to a registration without its capability"
                self.flying.add((r.transfer_id, r.engine_id, r.rank))
        for tid in list(self.bound):
            if self.rv.stage(tid) is None:
                self.bound.discard(tid)

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(RANKS), kind=st.sampled_from(INTRUDER_CAPS))
    def register(self, tid: str, who: tuple[str, int], kind: str) -> None:
        if who[0] != "intruder" and tid == "mine":
            return  # the router sends the intruder's transfer to the intruder only
        r = reg(tid, who[0], self._cap(tid, who[0], kind), next(self.serial))
        out = self.rv.on_register(r, self.now, owner=OWNER_KEY[who[0]])
        taken = not any(isinstance(d, Refuse) and d.reg is r for d in out)
        if taken and who[0] != "intruder":
            self.bound.add(tid)
        if who[0] == "intruder" and taken:
            assert tid == "mine" or (not self.required and kind == "none" and tid not in self.bound)
        self._apply(out)

    @rule(tid=st.sampled_from(TIDS))
    def prefill(self, tid: str) -> None:
        self._apply(self.rv.on_prefill(Prefill(tid, f"{tid}-p{next(self.serial)}", ((1, 2, 3),), 40), self.now))

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def written(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.flying)))
        self.flying.discard(key)
        self._apply(self.rv.on_pushed(*key))

    @rule(tid=st.sampled_from(TIDS), kind=st.sampled_from(INTRUDER_CAPS))
    def intruder_aborts(self, tid: str, kind: str) -> None:
        cap = self._cap(tid, "intruder", kind)
        if self.rv.may_abort(tid, "key-X", ("intruder", 0), cap) == "":
            assert tid == "mine" or (not self.required and not cap), f"the intruder may abort {tid}"
            assert tid not in self.bound or tid == "mine"
            why = Failed(Stage.RENDEZVOUS, Cause.ABORTED, "x")
            self._apply(self.rv.cancel(tid, self.now, why, by=("intruder", 0)))

    @rule(who=st.sampled_from(RANKS))
    def peer_gone(self, who: tuple[str, int]) -> None:
        self._apply(self.rv.drop_peer(who, self.now, "declared dead"))

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.rv.expire(self.now))

    @invariant()
    def holdings_are_what_the_entries_hold(self) -> None:
        check_holdings(self.rv, TIDS, RANKS)


class OptionalBindingMachine(BindingMachine):
    required = False


TestBinding = BindingMachine.TestCase
TestBinding.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestOptionalBinding = OptionalBindingMachine.TestCase
TestOptionalBinding.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


# -- D: who may complete or fail a transfer ------------------------------------------------------------

P0, P1, EVIL = ("p", 100), ("p", 101), ("evil", 100)


def _fencing() -> tuple[Fencing, list]:
    fencing = Fencing(2, transfer_timeout_s=10.0, peer_dead_s=5.0)
    out = fencing.register(Asked("t", "r", ((1, 2),), 32), {0: P0, 1: P1}, 0.0)
    for a in out:
        assert isinstance(a, SendRegister)
        a.incoming.register_sent(a.p_rank, None, None, 0, True, 0.0)
    return fencing, out


@pytest.mark.parametrize("sender", [EVIL, P1, UNKNOWN_SENDER])
@pytest.mark.parametrize("kind", ["completion", "failure"])
def test_only_the_registered_p_rank_completes_or_fails_its_part(sender: tuple[str, int], kind: str) -> None:
    fencing, _ = _fencing()
    done = protocol.Completion("t", "r", 0)
    fail = protocol.Failure("t", "r", 0, Stage.TRANSFER, Cause.OTHER, "forged")
    msg = done if kind == "completion" else fail
    act = (
        fencing.completion(msg, 1.0, sender=sender)
        if kind == "completion"
        else fencing.failure(msg, 1.0, sender=sender)
    )
    assert act == [Foreign("t", 0, sender)]
    assert fencing.counters[Count.FOREIGN_MESSAGES] == 1
    w = fencing.current["t"].writers[0]
    assert not w.final and w.covered is None, "nothing counted"
    # the registered P rank is heard
    assert fencing.completion(protocol.Completion("t", "r", 0), 1.1, sender=P0) == []
    [report] = fencing.completion(protocol.Completion("t", "r", 1), 1.2, sender=P1)
    assert isinstance(report, Report) and report.result.ok


def test_a_foreign_message_for_a_superseded_attempt_fences_nothing() -> None:
    fencing, _ = _fencing()
    fencing.register(Asked("t", "r", ((3, 4),), 32), {0: P0, 1: P1}, 1.0)  # attempt 1; attempt 0 superseded
    assert fencing.completion(protocol.Completion("t", "r", 0, attempt=1), 2.0, sender=EVIL) == [Foreign("t", 0, EVIL)]
    assert len(fencing.superseded) == 1, "a forged completion of the newer attempt fenced the older one"
    assert fencing.failure(protocol.Failure("t", "r", 0, Stage.TRANSFER, Cause.OTHER, "x"), 2.0, sender=EVIL) == [
        Foreign("t", 0, EVIL)
    ]


def test_unknown_transfers_stay_stale_whoever_sends() -> None:
    fencing, _ = _fencing()
    assert fencing.completion(protocol.Completion("nope", "r", 0), 1.0, sender=EVIL) == [Stale("nope", 0)]


# -- D: the allow-list ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "host", "port", "ok"),
    [
        ("10.0.0.0/8", "10.1.2.3", 5600, True),
        ("10.0.0.0/8", "11.0.0.1", 5600, False),
        ("10.0.0.0/8", "p.example", 5600, False),  # a name is not resolved to decide
        ("10.0.0.7", "10.0.0.7", 1, True),
        ("10.0.0.7:5600", "10.0.0.7", 5601, False),
        ("p.example:5600-5607", "P.example", 5607, True),
        ("p.example:5600-5607", "p.example", 5608, False),
        ("p.example", "q.example", 5600, False),
        ("[::1]:7000", "::1", 7000, True),
        ("[::1]:7000", "::1", 7001, False),
        ("fd00::/8", "fd00::5", 9, True),
        ("fd00::/8", "10.0.0.1", 9, False),
    ],
)
def test_allowed_entries(entry: str, host: str, port: int, ok: bool) -> None:
    why = Allowed.parse([entry]).why_not(host, port)
    assert (why == "") is ok
    if not ok:
        assert f"{host}:{port}" in why and "allowed_prefills" in why


def test_an_empty_allow_list_admits_any_p() -> None:
    assert Allowed().why_not("anything", 1) == ""


@pytest.mark.parametrize("bad", ["", "a:b", "p:0", "p:9-3", "p:70000", "10.0.0.0/99", "[::1", "a b"])
def test_bad_entries_are_refused_naming_them(bad: str) -> None:
    with pytest.raises(ConfigError, match="allowed_prefills entry"):
        parse_entry(bad)


def test_d_refuses_a_p_outside_its_allow_list_before_any_connection() -> None:
    fencing = Fencing(2, 10.0, 5.0, allowed=Allowed.parse(["10.0.0.0/8"]))
    out = fencing.register(Asked("t", "r", ((1, 2),), 32), {0: ("203.0.113.9", 5600)}, 0.0)
    assert not any(isinstance(a, (SendRegister, Cancel)) for a in out), "D would dial it"
    [report] = [a for a in out if isinstance(a, Report)]
    assert not report.result.ok and report.result.fenced and "allowed_prefills" in report.result.reason
    assert len(fencing) == 0, "nothing left pending"
    # a bystander outside the list fails it too; a cancel to such a P sends nothing
    out = fencing.register(Asked("u", "r", ((1,),), 16), {0: ("10.0.0.1", 5600)}, 0.0, {1: ("8.8.8.8", 5601)})
    assert not any(isinstance(a, (SendRegister, Cancel)) for a in out)
    why = Failed(Stage.TRANSFER, Cause.ABORTED, "x")
    assert fencing.cancel("v", "r", {0: ("8.8.8.8", 5600)}, why, 0.0) == []
    assert [type(a) for a in fencing.cancel("w", "r", {0: ("10.0.0.1", 5600)}, why, 0.0)] == [Cancel]
