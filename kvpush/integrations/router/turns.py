"""The turn route: serve a request whose prompt's start a D already holds in the cheapest of three ways.

In a conversation turn k+1's prompt starts with turn k's prompt and answer,
whose KV the D that served turn k holds in its prefix cache. Given how many
of the prompt's tokens a D holds (``held_on_d``) and what P holds
(``held_on_p``), with ``suffix = prompt_tokens - held_on_d``:

* ``D_ALONE``: D computes the suffix, the prefix from its cache; D's prefill
  stalls its decodes, so its seconds count ``1 + interference`` times:
  ``(1 + interference) * prefill_d * suffix``;
* ``PUSH_BACK``: D pushes the prefix to P, P computes the suffix and pushes
  it to D (two transfers' fixed costs, every token moved once):
  ``2 * fixed + per_token * prompt_tokens + prefill_p * suffix``; only where
  the reverse push exists (``push_back``), else never chosen;
* ``TODAY``: P computes all it does not hold itself and pushes the prompt:
  ``fixed + per_token * prompt_tokens + prefill_p * (prompt_tokens - held_on_p)``.

Rule: nothing held on D -> ``TODAY`` (the selective rule, where on, then
decides as before); otherwise the cheapest, ``D_ALONE`` on a tie, then
``TODAY`` before ``PUSH_BACK``. For a fixed prompt, ``D_ALONE``'s cost falls
by ``(1 + interference) * prefill_d`` per held token, ``TODAY``'s does not
move and ``PUSH_BACK``'s falls by ``prefill_p``; ``D_ALONE`` beats
``PUSH_BACK`` iff ``((1 + interference) * prefill_d - prefill_p) * suffix <=
2 * fixed + per_token * prompt_tokens``, whose left side never grows as the
suffix shrinks. So more held tokens never make ``D_ALONE`` less likely.
Reason: the three paths cost what they compute and move, and a D that holds
the conversation should not recompute it on P nor receive it again.

Pure: numbers in, a typed ``Turn`` out; bad input raises ``ValueError``
naming it. The router feeds it (``pairing``) from the held index (``held``)
and the selective rule's measured costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class TurnRoute(StrEnum):
    D_ALONE = "d_alone"  # D prefills the suffix; its prefix cache serves the rest
    PUSH_BACK = "push_back"  # P computes the suffix, the prefix pushed to it from D
    TODAY = "today"  # P prefills and pushes, as without the index


# Defaults until the router measured its own (seconds): a GPU's order of magnitude, only their ratios matter.
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4
DEFAULT_TRANSFER_FIXED_S = 0.01
DEFAULT_TRANSFER_S_PER_TOKEN = 1e-5
DEFAULT_INTERFERENCE = 1.0


@dataclass(frozen=True)
class TurnCosts:
    """What each path costs, in seconds (per token where named so); ``interference``: how many more times
    D's prefill seconds count, for the decodes it stalls."""

    prefill_p_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    prefill_d_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    transfer_fixed_s: float = DEFAULT_TRANSFER_FIXED_S
    transfer_s_per_token: float = DEFAULT_TRANSFER_S_PER_TOKEN
    interference: float = DEFAULT_INTERFERENCE

    def __post_init__(self) -> None:
        for name in (
            "prefill_p_s_per_token",
            "prefill_d_s_per_token",
            "transfer_fixed_s",
            "transfer_s_per_token",
            "interference",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"turn cost {name} must be a finite number >= 0, got {value!r}")

    def with_measured(
        self, prefill_s_per_token: float | None, fixed_s: float | None, per_token_s: float | None
    ) -> TurnCosts:
        """These costs with the router's measurements where it has them (P and D run the same model, so P's
        prefill rate stands for D's too); ``None`` keeps the default."""
        prefill = self.prefill_p_s_per_token if prefill_s_per_token is None else prefill_s_per_token
        return TurnCosts(
            prefill_p_s_per_token=prefill,
            prefill_d_s_per_token=self.prefill_d_s_per_token if prefill_s_per_token is None else prefill,
            transfer_fixed_s=self.transfer_fixed_s if fixed_s is None else fixed_s,
            transfer_s_per_token=self.transfer_s_per_token if per_token_s is None else per_token_s,
            interference=self.interference,
        )


@dataclass(frozen=True)
class Turn:
    """The route chosen, and what it was chosen from (``None``: that path was not weighed)."""

    route: TurnRoute
    prompt_tokens: int
    held_on_d: int
    d_alone_s: float | None
    push_back_s: float | None
    today_s: float | None

    @property
    def suffix(self) -> int:
        """The prompt tokens D does not hold."""
        return self.prompt_tokens - self.held_on_d


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def choose_turn(
    prompt_tokens: int, held_on_d: int, costs: TurnCosts, push_back: bool = False, held_on_p: int = 0
) -> Turn:
    """The turn route for a prompt of ``prompt_tokens`` of which D holds ``held_on_d`` and P ``held_on_p``
    (the module's rule)."""
    n = _count("prompt_tokens", prompt_tokens)
    h = _count("held_on_d", held_on_d)
    hp = _count("held_on_p", held_on_p)
    if n < 1:
        raise ValueError("prompt_tokens must be >= 1: a request without a prompt has no route")
    if h > n or hp > n:
        which, value = ("held_on_d", h) if h > n else ("held_on_p", hp)
        raise ValueError(f"{which} ({value}) exceeds prompt_tokens ({n}): an index never holds more than the prompt")
    if h == 0:
        return Turn(TurnRoute.TODAY, n, 0, None, None, None)
    c = costs
    suffix = max(1, n - h)  # vLLM computes at least the prompt's last token
    d_alone = (1 + c.interference) * c.prefill_d_s_per_token * suffix
    today = c.transfer_fixed_s + c.transfer_s_per_token * n + c.prefill_p_s_per_token * max(1, n - hp)
    back = 2 * c.transfer_fixed_s + c.transfer_s_per_token * n + c.prefill_p_s_per_token * suffix if push_back else None
    if d_alone <= today and (back is None or d_alone <= back):
        route = TurnRoute.D_ALONE
    elif back is None or today <= back:
        route = TurnRoute.TODAY
    else:
        route = TurnRoute.PUSH_BACK
    return Turn(route, n, h, d_alone, back, today)
