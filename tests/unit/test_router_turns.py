"""The turn route (``kvpush.integrations.router.turns``): D alone, push back, or today's path, by cost."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.integrations.router.turns import TurnCosts, TurnRoute, choose_turn

rates = st.floats(min_value=0, max_value=1e-2, allow_nan=False)
fixed = st.floats(min_value=0, max_value=1.0, allow_nan=False)
interference = st.floats(min_value=0, max_value=10, allow_nan=False)
costs = st.builds(TurnCosts, rates, rates, fixed, rates, interference)


def test_nothing_held_is_todays_path() -> None:
    turn = choose_turn(4000, 0, TurnCosts(), push_back=True)
    assert turn.route is TurnRoute.TODAY
    assert (turn.d_alone_s, turn.push_back_s, turn.today_s) == (None, None, None)


def test_short_new_message_stays_on_d() -> None:
    turn = choose_turn(4100, 4000, TurnCosts())
    assert turn.route is TurnRoute.D_ALONE
    assert turn.suffix == 100


def test_long_new_message_goes_through_p() -> None:
    # P holds the previous prompt too: it computes only the answer and the new message, D would compute them
    # at twice their cost (interference 1).
    turn = choose_turn(8000, 4000, TurnCosts(), held_on_p=3500)
    assert turn.route is TurnRoute.TODAY


def test_push_back_when_the_prefix_is_long_and_p_holds_nothing() -> None:
    c = TurnCosts(prefill_p_s_per_token=1e-4, prefill_d_s_per_token=1e-4, transfer_s_per_token=1e-6)
    assert choose_turn(12000, 8000, c, push_back=True).route is TurnRoute.PUSH_BACK
    # Without the reverse push the rule falls back to the cheaper of the two others.
    assert choose_turn(12000, 8000, c, push_back=False).route in (TurnRoute.D_ALONE, TurnRoute.TODAY)


def test_ties_go_to_d_alone() -> None:
    c = TurnCosts(prefill_p_s_per_token=0, prefill_d_s_per_token=0, transfer_fixed_s=0, transfer_s_per_token=0)
    assert choose_turn(10, 5, c, push_back=True).route is TurnRoute.D_ALONE


def test_whole_prompt_held_still_computes_one_token() -> None:
    turn = choose_turn(100, 100, TurnCosts())
    assert turn.route is TurnRoute.D_ALONE
    assert turn.d_alone_s == pytest.approx(2 * 1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 0), "prompt_tokens must be >= 1"),
        ((-1, 0), "prompt_tokens must be an int >= 0"),
        ((10, -1), "held_on_d must be an int >= 0"),
        ((10, 11), "held_on_d (11) exceeds prompt_tokens (10)"),
        ((10.0, 1), "prompt_tokens must be an int"),
        ((True, 0), "prompt_tokens must be an int"),
    ],
)
def test_bad_counts_name_the_problem(args: tuple[object, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        choose_turn(*args, TurnCosts())  # type: ignore[arg-type]


def test_bad_held_on_p_names_it() -> None:
    with pytest.raises(ValueError, match=r"held_on_p \(11\) exceeds"):
        choose_turn(10, 1, TurnCosts(), held_on_p=11)


@pytest.mark.parametrize("name", ["prefill_p_s_per_token", "transfer_fixed_s", "interference"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, "1", None])
def test_bad_costs_name_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"turn cost {name} must be a finite number >= 0"):
        TurnCosts(**{name: value})  # type: ignore[arg-type]


def test_measured_costs_replace_defaults_only_where_known() -> None:
    base = TurnCosts(interference=3.0)
    assert base.with_measured(None, None, None) == base
    m = base.with_measured(2e-3, 0.5, 1e-6)
    assert (m.prefill_p_s_per_token, m.prefill_d_s_per_token) == (2e-3, 2e-3)
    assert (m.transfer_fixed_s, m.transfer_s_per_token, m.interference) == (0.5, 1e-6, 3.0)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 20000), st.data(), costs, st.booleans())
def test_more_held_never_makes_d_alone_less_likely(n: int, data: st.DataObject, c: TurnCosts, back: bool) -> None:
    hp = data.draw(st.integers(0, n), label="held_on_p")
    h1 = data.draw(st.integers(0, n), label="held")
    h2 = data.draw(st.integers(h1, n), label="more held")
    if choose_turn(n, h1, c, back, hp).route is TurnRoute.D_ALONE:
        assert choose_turn(n, h2, c, back, hp).route is TurnRoute.D_ALONE


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 20000), st.data(), costs, st.booleans())
def test_the_route_is_the_cheapest_weighed(n: int, data: st.DataObject, c: TurnCosts, back: bool) -> None:
    h = data.draw(st.integers(1, n), label="held")
    hp = data.draw(st.integers(0, n), label="held_on_p")
    turn = choose_turn(n, h, c, back, hp)
    weighed = {TurnRoute.D_ALONE: turn.d_alone_s, TurnRoute.TODAY: turn.today_s, TurnRoute.PUSH_BACK: turn.push_back_s}
    known = {r: s for r, s in weighed.items() if s is not None}
    assert (TurnRoute.PUSH_BACK in known) == back
    assert known[turn.route] == min(known.values())
    assert turn.route is not TurnRoute.PUSH_BACK or back


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000), costs, st.booleans(), st.integers(0, 20000))
def test_nothing_held_is_always_today(n: int, c: TurnCosts, back: bool, hp: int) -> None:
    assert choose_turn(n, 0, c, back, min(hp, n)).route is TurnRoute.TODAY
