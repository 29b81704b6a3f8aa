"""P's rules on whom it hears (``kvpush.prefill.hello``), without NIXL: a D rank's name belongs to the key that
said hello with it, one connection says hello under one name, a hello of the same key replaces, a hello while
an earlier session's WRITEs fly waits; registrations are refused before a hello under their name, when bad,
and when over their key's budget, with the cause named. Driven by hypothesis over every interleaving of
hellos, forgotten ranks and WRITEs in flight, as the shell (``kvpush.engine.peers``) applies the verdicts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.outcome import Cause, Stage
from kvpush.core.protocol import Hello, Register
from kvpush.prefill.admission import Admission, KeyLimits, holding_cost, name_cost, names_cap
from kvpush.prefill.hello import (
    UNKNOWN_PEER_BLOCKS,
    HelloOk,
    HelloRefused,
    Local,
    Peer,
    Refusal,
    block_cap,
    frame_fits,
    judge_hello,
    judge_register,
    most_blocks,
)

LAYOUT = KVLayout(
    block_size=16,
    num_blocks=128,
    block_stride=4096,
    head_bytes=256,
    num_heads=8,
    head_start=0,
    local_heads=1,
    order=TokenOrder.HND,
    mem=MemKind.DRAM,
    dtype="bfloat16",
    regions=(Region(base=1 << 30, size=128 * 4096), Region(base=(1 << 30) + (1 << 20), size=128 * 4096)),
)
LOCAL = Local("the-model", LAYOUT, "1.5.1", ("UCX",), peer_dead_s=7.0)
KEYS = ("key-A", "key-B", "")  # "": auth none
NAMES = (("dA", 0), ("dA", 1), ("dB", 0))
IDENTS = (b"c0", b"c1", b"c2", b"c3")
META = b"opaque NIXL metadata"  # another NIXL's form: only its size is bounded


def hello(name: tuple[str, int], model: str = "the-model", meta: bytes = META) -> Hello:
    return Hello(name[0], name[1], 1, f"{name[0]}-{name[1]}", meta, LAYOUT, model)


def judge(
    msg: Hello,
    key: str,
    held_by: str | None = None,
    said_as: tuple[str, int] | None = None,
    writing: bool = False,
    admission: Admission | None = None,
    declared: int | None = None,
) -> HelloOk | HelloRefused:
    adm = admission or Admission(KeyLimits())
    return judge_hello(
        LOCAL,
        msg,
        key,
        held_by=held_by,
        said_as=said_as,
        writing=writing,
        admission=adm,
        declared=declared,
        holdings=(),
    )


def test_a_hello_under_a_name_another_key_holds_is_refused_naming_why() -> None:
    v = judge(hello(("dA", 0)), "key-X", held_by="key-A")
    assert isinstance(v, HelloRefused) and v.refusal is Refusal.NAME
    assert "D dA rank 0 is connected under another D key" in v.reason and "peer_dead_s (7 s)" in v.reason


def test_a_hello_again_of_the_same_key_replaces() -> None:
    assert judge(hello(("dA", 0)), "key-A", held_by="key-A", said_as=("dA", 0)) == HelloOk(replaces=True)
    assert judge(hello(("dA", 0)), "key-A") == HelloOk(replaces=False)
    assert judge(hello(("dA", 0)), "", held_by="") == HelloOk(replaces=True)  # auth none: one key, ""


def test_one_connection_says_hello_under_one_name() -> None:
    v = judge(hello(("dA", 1)), "key-A", said_as=("dA", 0))
    assert isinstance(v, HelloRefused) and v.refusal is Refusal.NAME
    assert "this connection said hello as D dA rank 0 already" in v.reason


def test_what_a_hello_declares_is_checked_first() -> None:
    v = judge(hello(("dA", 0), model="another"), "key-X", held_by="key-A", writing=True)
    assert v == HelloRefused("model differs: P serves 'the-model', D serves 'another'", Refusal.INCOMPATIBLE)
    assert judge(hello(("dA", 0), model=""), "key-A") == HelloOk(replaces=False)  # D names no model: any
    v = judge(hello(("dA", 0), meta=b"x" * (1 << 20)), "key-A")
    assert isinstance(v, HelloRefused) and v.refusal is Refusal.INCOMPATIBLE and "NIXL metadata" in v.reason
    narrow = Hello("dA", 0, 1, "a", META, KVLayout(**{**_fields(LAYOUT), "head_bytes": 128}), "the-model")
    v = judge(narrow, "key-A")
    assert isinstance(v, HelloRefused) and v.refusal is Refusal.INCOMPATIBLE and "head_bytes" in v.reason


def test_a_hello_while_an_earlier_sessions_writes_fly_waits() -> None:
    v = judge(hello(("dA", 0)), "key-A", held_by="key-A", writing=True)
    assert isinstance(v, HelloRefused) and v.refusal is Refusal.BUSY and "WRITEs in flight" in v.reason
    # a name refusal comes before: the busy answer tells nothing to a key the name is not its
    assert judge(hello(("dA", 0)), "key-X", held_by="key-A", writing=True).refusal is Refusal.NAME  # type: ignore[union-attr]


def test_a_key_at_its_names_cap_is_refused_with_the_cap_named() -> None:
    adm = Admission(KeyLimits(1 << 40, 2))
    adm.add("key-A", ("dA", 0), 10)
    adm.add("key-A", ("dA", 1), 10)
    v = judge(hello(("dB", 0)), "key-A", admission=adm)
    assert isinstance(v, HelloRefused) and v.refusal is Refusal.NAME and "peer_max_ranks" in v.reason
    assert judge(hello(("dA", 1)), "key-A", held_by="key-A", admission=adm) == HelloOk(replaces=True)
    assert judge(hello(("dB", 0)), "", admission=adm) == HelloOk(replaces=False)  # auth none: no key budget


def _fields(layout: KVLayout) -> dict:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}


class HelloMachine(RuleBasedStateMachine):
    """Hellos of any key on any connection under any name, ranks forgotten (silent, or their connection
    closed), WRITEs into a name starting and ending; the verdicts applied as the shell applies them."""

    def __init__(self) -> None:
        super().__init__()
        self.limits = KeyLimits(3 * name_cost(len(META)), 2)
        self.admission = Admission(self.limits)
        self.names: dict[tuple[str, int], tuple[str, bytes]] = {}  # name -> (key, connection)
        self.writing: set[tuple[str, int]] = set()
        self.taken: dict[tuple[str, int], str] = {}  # name -> the key that took it, until it is forgotten

    @rule(key=st.sampled_from(KEYS), ident=st.sampled_from(IDENTS), name=st.sampled_from(NAMES))
    def say_hello(self, key: str, ident: bytes, name: tuple[str, int]) -> None:
        held = self.names.get(name)
        said = next((n for n, (_, i) in self.names.items() if i == ident), None)
        v = judge_hello(
            LOCAL,
            hello(name),
            key,
            held_by=held[0] if held else None,
            said_as=said,
            writing=name in self.writing,
            admission=self.admission,
            declared=None,
            holdings=(),
        )
        if held is not None and held[0] != key:
            assert isinstance(v, HelloRefused) and v.refusal is Refusal.NAME, "took another key's name"
        if said is not None and said != name:
            assert isinstance(v, HelloRefused) and v.refusal is Refusal.NAME, "two names on one connection"
        if isinstance(v, HelloRefused):
            if v.refusal is Refusal.BUSY:
                assert name in self.writing
            return
        assert name not in self.writing, "an ok hello while a WRITE of the earlier session flies"
        assert v.replaces == (held is not None)
        if v.replaces:
            self._forget(name)
        self.admission.add(key, name, len(META))
        self.names[name] = (key, ident)
        self.taken[name] = key

    @rule(name=st.sampled_from(NAMES))
    def forgotten(self, name: tuple[str, int]) -> None:
        if name in self.names:
            self._forget(name)
            del self.taken[name]

    @rule(name=st.sampled_from(NAMES), on=st.booleans())
    def write(self, name: tuple[str, int], on: bool) -> None:
        (self.writing.add if on else self.writing.discard)(name)

    def _forget(self, name: tuple[str, int]) -> None:
        key, _ = self.names.pop(name)
        self.admission.remove(key, name)

    @invariant()
    def a_name_stays_with_its_key_and_a_connection_has_one(self) -> None:
        for name, (key, _) in self.names.items():
            assert self.taken[name] == key
        idents = [i for _, i in self.names.values()]
        assert len(idents) == len(set(idents))

    @invariant()
    def each_key_within_its_caps(self) -> None:
        for key in KEYS[:2]:
            assert self.admission.names(key) <= names_cap(self.limits, None)
            assert self.admission.held(key, ()) <= self.limits.max_bytes


HelloMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_hello_state_machine = HelloMachine.TestCase


# -- registrations -------------------------------------------------------------------


def peer(name: tuple[str, int] = ("dA", 0), key: str = "key-A") -> Peer:
    return Peer(b"c0", key, name[0], name[1], 1, "agent", LAYOUT, None, 0.0)


def register(name: tuple[str, int] = ("dA", 0), nblocks: int = 2, groups: int = 1) -> Register:
    ids = tuple(range(nblocks))
    return Register("t", "r", name[0], name[1], (ids,) * groups, 16 * nblocks, lease_ms=4000)


def test_a_registration_before_a_hello_under_its_name_is_refused() -> None:
    adm = Admission(KeyLimits())
    for who in (None, peer(("dA", 1))):
        failed = judge_register(LAYOUT, 1, who, register(), adm, ())
        # a handshake failure: D says hello again and registers once more
        assert failed is not None and (failed.stage, failed.cause) == (Stage.HANDSHAKE, Cause.REFUSED)
        assert "before a successful hello" in failed.reason
    assert judge_register(LAYOUT, 1, peer(), register(), adm, ()) is None


def test_a_bad_registration_is_refused_naming_what_is_wrong() -> None:
    adm = Admission(KeyLimits())
    failed = judge_register(LAYOUT, 1, peer(), register(groups=2), adm, ())
    assert failed is not None and failed.cause is Cause.BAD_REGISTRATION and "2 block groups" in failed.reason
    long = Register("t", "r", "dA", 0, (tuple(range(120)),), 16, lease_ms=4000)
    small_p = KVLayout(**{**_fields(LAYOUT), "num_blocks": 4})
    failed = judge_register(small_p, 1, peer(), long, adm, ())
    assert failed is not None and failed.cause is Cause.BAD_REGISTRATION
    assert "lists 120 block ids; a prompt this P can prefill needs at most 5" in failed.reason


@given(
    budget_regs=st.integers(0, 6),
    budget_ids=st.integers(0, 400),
    held=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 100)), max_size=4),
    nblocks=st.integers(1, 128),
    key=st.sampled_from(["key-A", ""]),
)
@settings(max_examples=300, deadline=None)
def test_a_registration_over_its_keys_budget_is_refused_with_the_cause_named(
    budget_regs: int, budget_ids: int, held: list[tuple[int, int]], nblocks: int, key: str
) -> None:
    """Refused OVER_LIMIT, naming the key and ``peer_key_bytes``, exactly when one more registration of
    ``nblocks`` ids would put the key's names and holdings over its bytes; a key of auth none has none."""
    limits = KeyLimits(name_cost(len(META)) + holding_cost(budget_regs, budget_ids), 16)
    adm = Admission(limits)
    adm.add(key, ("dA", 0), len(META))
    failed = judge_register(LAYOUT, 1, peer(key=key), register(nblocks=nblocks), adm, held)
    total = adm.held(key, held) + holding_cost(1, nblocks)
    if key and total > limits.max_bytes:
        assert failed is not None and (failed.stage, failed.cause) == (Stage.REGISTER, Cause.OVER_LIMIT)
        assert f"peer_key_bytes {limits.max_bytes}" in failed.reason and "key-A" in failed.reason
    else:
        assert failed is None


def test_what_a_registration_may_list_is_ps_view_capped_by_ds_blocks() -> None:
    small_d = KVLayout(**{**_fields(LAYOUT), "num_blocks": 10})
    assert most_blocks(LAYOUT, LAYOUT) == 128 and most_blocks(LAYOUT, small_d) == 10
    half = KVLayout(**{**_fields(LAYOUT), "block_size": 32, "num_blocks": 1000})
    assert most_blocks(LAYOUT, half) == 65  # P's 128 blocks of 16 tokens, in D's blocks of 32, plus one
    assert block_cap(2, small_d) == 40
    assert frame_fits([10, 10], 2, 10) and not frame_fits([10, 11], 2, 10) and not frame_fits([1, 1, 1], 2, 10)
    assert frame_fits([], 1, 0) and frame_fits([UNKNOWN_PEER_BLOCKS], 1, UNKNOWN_PEER_BLOCKS)
