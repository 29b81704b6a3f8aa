"""The held index (``router.held``): what each instance holds of a prompt, bounded, corrected down."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpush.integrations.router.held import NOTHING, Held, HeldIndex, Units, answer_units, message_text, units_of


def text(prompt: str, model: str = "m") -> Units:
    u = units_of({"model": model, "prompt": prompt})
    assert u is not None
    return u


def test_units_of_each_kind() -> None:
    assert text("hello").seq == "hello"
    ids = units_of({"model": "m", "prompt": [1, 2, 3]})
    assert ids is not None and ids.token_ids and ids.seq == (1, 2, 3)
    chat = units_of({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat is not None and chat.seq == "user\x1fhi\x1e"
    for body in ({"prompt": ["a", "b"]}, {"prompt": [1, True]}, {"prompt": ""}, {"messages": ["x"]}, {}):
        assert units_of(body) is None


def test_the_root_separates_models_salts_and_kinds() -> None:
    roots = {
        text("x", "a").root,
        text("x", "b").root,
        units_of({"model": "a", "prompt": "x", "cache_salt": "s"}).root,  # type: ignore[union-attr]
        units_of({"model": "a", "messages": [{"role": "user", "content": "x"}]}).root,  # type: ignore[union-attr]
        units_of({"model": "a", "prompt": [1]}).root,  # type: ignore[union-attr]
    }
    assert len(roots) == 5


def test_answer_units_follow_the_next_turns_form() -> None:
    body = {"model": "m", "prompt": "Q:"}
    assert answer_units(body, {"choices": [{"text": " A."}]}) == " A."
    assert answer_units({**body, "echo": True}, {"choices": [{"text": "Q: A."}]}) is None
    assert answer_units(body, {"choices": [{"text": "a"}, {"text": "b"}]}) is None
    assert answer_units({"prompt": [1, 2]}, {"choices": [{"text": "a"}]}) is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    said = answer_units(chat, {"choices": [{"message": {"role": "assistant", "content": "yo"}}]})
    assert said == message_text({"role": "assistant", "content": "yo"})
    nxt = units_of({**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "yo"}]})
    assert nxt is not None and nxt.seq == units_of(chat).seq + said  # type: ignore[union-attr]


def test_a_turn_matches_the_previous_turn_and_its_answer() -> None:
    idx = HeldIndex(chunk_chars=4)
    turn1 = text("abcdefghij")  # 10 characters: chunks end at 4 and 8
    idx.record("d1", turn1.then("KLMN"), 140)  # 14 characters, 140 tokens
    turn2 = text("abcdefghijKLMNopq")
    held = idx.held("d1", turn2)
    assert held == Held(120, 12)
    assert held.prompt_tokens(turn2) == 170
    assert idx.held("d2", turn2) is NOTHING
    assert idx.held("d1", text("abcdXfghij")) == Held(40, 4)  # a prefix only
    assert idx.held("d1", text("abcdefghij", model="other")) is NOTHING


def test_token_ids_count_one_token_per_unit() -> None:
    idx = HeldIndex(chunk_tokens=2)
    ids = units_of({"model": "m", "prompt": [1, 2, 3, 4, 5]})
    assert ids is not None
    idx.record("d", ids, 999)
    held = idx.held("d", units_of({"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7]}))  # type: ignore[arg-type]
    assert held == Held(4, 4)


def test_correct_drops_boundaries_past_what_was_reused() -> None:
    idx = HeldIndex(chunk_chars=2)
    u = text("abcdefgh")  # boundaries at 2, 4, 6, 8 characters: 20, 40, 60, 80 tokens
    idx.record("d", u, 80)
    assert idx.correct("d", u, 45) == 2
    assert idx.held("d", u) == Held(40, 4)
    assert idx.correct("d", u, 30, slack=10) == 0
    assert idx.corrected == 2 and len(idx) == 2


def test_forget_drops_one_instance_only() -> None:
    idx = HeldIndex(chunk_chars=2)
    idx.record("d1", text("abcd"), 4)
    idx.record("d2", text("abcd"), 4)
    assert idx.forget("d1") == 2
    assert idx.held("d1", text("abcd")) is NOTHING
    assert idx.held("d2", text("abcd")) == Held(4, 4)
    assert idx.entries_of("d1") == 0 and idx.entries_of("d2") == 2


def test_capacity_drops_the_least_recent() -> None:
    idx = HeldIndex(capacity=3, chunk_chars=1)
    idx.record("d", text("ab"), 2)
    idx.record("d", text("xy"), 2)  # 4 entries: "a" goes
    assert len(idx) == 3 and idx.evicted == 1
    assert idx.held("d", text("ab")) is NOTHING  # the walk stops at the first chunk it lacks


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"capacity": 0}, "capacity must be an int >= 1"),
        ({"chunk_chars": -1}, "chunk_chars must be an int >= 1"),
        ({"chunk_tokens": True}, "chunk_tokens must be an int >= 1"),
    ],
)
def test_bad_settings_name_the_problem(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HeldIndex(**kw)  # type: ignore[arg-type]


def test_bad_counts_name_the_problem() -> None:
    idx = HeldIndex()
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        idx.record("d", text("a"), -1)
    with pytest.raises(ValueError, match="cached must be an int >= 0"):
        idx.correct("d", text("a"), -1)
    with pytest.raises(ValueError, match="slack must be an int >= 0"):
        idx.correct("d", text("a"), 0, slack=-2)
    with pytest.raises(ValueError, match="both be token ids or both text"):
        text("a").then((1,))


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=200), st.text(max_size=200), st.integers(1, 5000), st.integers(1, 16))
def test_held_never_exceeds_what_was_recorded(prompt: str, more: str, tokens: int, chunk: int) -> None:
    idx = HeldIndex(chunk_chars=chunk)
    idx.record("d", text(prompt), tokens)
    held = idx.held("d", text(prompt + more))
    assert held.tokens <= tokens and held.units <= len(prompt)
    assert held.units == len(prompt) // chunk * chunk


instances = st.sampled_from(["p", "d1", "d2"])
prompts = st.text(alphabet="ab", min_size=1, max_size=12)


class IndexMachine(RuleBasedStateMachine):
    """Against a model without capacity: what the index says is held was recorded and not dropped since."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = HeldIndex(capacity=24, chunk_chars=2)
        self.model: dict[str, set[str]] = {}  # instance -> prefixes (whole chunks) recorded and not dropped

    @rule(inst=instances, prompt=prompts)
    def record(self, inst: str, prompt: str) -> None:
        self.idx.record(inst, text(prompt), len(prompt))
        ends = range(2, len(prompt) + 1, 2)
        self.model.setdefault(inst, set()).update(prompt[:e] for e in ends)

    @rule(inst=instances, prompt=prompts)
    def held(self, inst: str, prompt: str) -> None:
        held = self.idx.held(inst, text(prompt))
        assert held.units % 2 == 0 and held.units <= len(prompt)
        if held.units:
            assert prompt[: held.units] in self.model.get(inst, set())  # never more than was recorded
            assert held.tokens == held.units  # one token per character here

    @rule(inst=instances, prompt=prompts, cached=st.integers(0, 12))
    def correct(self, inst: str, prompt: str, cached: int) -> None:
        self.idx.correct(inst, text(prompt), cached)
        assert self.idx.held(inst, text(prompt)).tokens <= cached
        self.model.get(inst, set()).difference_update(prompt[:e] for e in range(2, len(prompt) + 1) if e > cached)

    @rule(inst=instances)
    def forget(self, inst: str) -> None:
        self.idx.forget(inst)
        self.model.pop(inst, None)
        assert self.idx.entries_of(inst) == 0

    @invariant()
    def bounded_and_counted(self) -> None:
        assert len(self.idx) <= self.idx.capacity
        assert sum(self.idx.entries_of(i) for i in ("p", "d1", "d2")) == len(self.idx)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
