"""The router's multi-turn shell: the held index and the turn route asked per request, the index taught by answers.

It owns no rule: what an instance holds is ``held``'s, the route is
``turns``'s. It feeds them: per request the units (``held.units_of``), what
each healthy D and P holds of them, the costs (the selective rule's
measurements where it has them, ``turns``' defaults otherwise); after it,
what the answers say (docs/design.md, "Multi-turn"):

* P answered (today's path): P holds the prompt, and so does D once the
  pairing succeeded (it received it), both ``usage.prompt_tokens`` tokens;
* D answered, not streamed: D holds the prompt and its answer
  (``prompt_tokens + completion_tokens``); a D-alone answer's
  ``prompt_tokens_details.cached_tokens`` (vLLM's
  ``--enable-prompt-tokens-details``) first corrects the index down where D
  reused less than it said;
* D answered a stream: D holds the prompt, at the tokens P counted or the
  index's estimate.

An instance found unhealthy is forgotten (a D that comes back has an empty
cache). Instances are keyed by name (URL and data-parallel rank).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from kvpush.integrations.router.held import Held, HeldIndex, Units, answer_units, units_of
from kvpush.integrations.router.pool import Instance, Pool
from kvpush.integrations.router.selective import Selector
from kvpush.integrations.router.turns import Turn, TurnCosts, TurnRoute, choose_turn

log = logging.getLogger("kvpush.router")

# What an estimate of the tokens at a chunk boundary and D's whole blocks may differ by before a D-alone answer
# that reused fewer tokens counts as a miss (vLLM's default block size, twice).
CORRECTION_SLACK = 32


@dataclass
class TurnPlan:
    """One request's turn: its units, the route, the D and P holding the most of it (``None``: none holds any)."""

    units: Units
    turn: Turn
    d: Instance | None
    p: Instance | None = None
    prompt_tokens: int | None = None  # P's count, once P answered

    @property
    def held(self) -> bool:
        return self.turn.held_on_d > 0


@dataclass
class MultiTurn:
    """The shell around ``HeldIndex`` and ``choose_turn`` (the module's docstring)."""

    index: HeldIndex = field(default_factory=HeldIndex)
    costs: TurnCosts = field(default_factory=TurnCosts)
    push_back: bool = False  # the reverse push does not exist yet (docs/design.md)
    counts: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in TurnRoute} | {"unheld": 0, "misses": 0})

    def _holder(self, pool: Pool, units: Units, failed: list[Instance]) -> tuple[Instance | None, Held]:
        best: tuple[Instance | None, Held] = (None, Held(0, 0))
        excluded = {id(i) for i in failed}
        for inst in pool.instances:
            if not inst.healthy:
                if self.index.entries_of(inst.name):  # once: forgetting walks the whole index
                    self.index.forget(inst.name)
                continue
            if id(inst) in excluded:
                continue
            held = self.index.held(inst.name, units)
            if held.tokens > best[1].tokens:
                best = (inst, held)
        return best

    def plan(
        self, body: dict[str, Any], prefill: Pool, decode: Pool, failed: list[Instance], selector: Selector | None
    ) -> TurnPlan | None:
        """The request's turn (``None``: the index cannot key it, e.g. several prompts)."""
        units = units_of(body)
        if units is None:
            return None
        d, on_d = self._holder(decode, units, failed)
        p, on_p = self._holder(prefill, units, failed)
        if d is None:
            self.counts["unheld"] += 1
            return TurnPlan(units, Turn(TurnRoute.TODAY, 0, 0, None, None, None), None, p)
        n = on_d.prompt_tokens(units) or on_d.tokens
        costs = self.costs
        if selector is not None:
            fit = selector.transfer_model()
            rate = selector.state()["prefill_s_per_token"]
            costs = costs.with_measured(rate, fit.fixed if fit else None, fit.per_token if fit else None)
        turn = choose_turn(n, min(on_d.tokens, n), costs, self.push_back, min(on_p.tokens, n))
        self.counts[turn.route.value] += 1
        return TurnPlan(units, turn, d, p)

    # -- what the answers teach ------------------------------------------------ #

    def prefilled(self, p: Instance, plan: TurnPlan, p_json: dict[str, Any]) -> None:
        """P answered: it holds the prompt."""
        tokens = (p_json.get("usage") or {}).get("prompt_tokens")
        if isinstance(tokens, int) and tokens > 0:
            plan.prompt_tokens = tokens
            self.index.record(p.name, plan.units, tokens)

    def served(self, d: Instance, plan: TurnPlan, body: dict[str, Any], data: bytes | None) -> None:
        """D served the request (``data``: its whole answer, not streamed; ``None``: a stream)."""
        answer = _json(data) if data is not None else None
        usage = (answer or {}).get("usage") or {}
        prompt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        prompt = prompt or plan.prompt_tokens or (plan.turn.prompt_tokens if plan.held else None)
        if not prompt:
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        d_alone = plan.turn.route is TurnRoute.D_ALONE and isinstance(cached, int) and cached >= 0
        if d_alone and self.index.correct(d.name, plan.units, cached, CORRECTION_SLACK):
            self.counts["misses"] += 1
            log.debug("%s reused %s prompt tokens, fewer than the index said (%d)", d.name, cached, plan.turn.held_on_d)
        more = answer_units(body, answer) if answer is not None else None
        completion = usage.get("completion_tokens")
        if more and isinstance(completion, int) and completion >= 0:
            self.index.record(d.name, plan.units.then(more), prompt + completion)
        else:
            self.index.record(d.name, plan.units, prompt)

    def state(self) -> dict[str, Any]:
        """What ``/kvpush/pending`` shows: the routes chosen, the misses, the index's size."""
        idx = self.index
        return {
            "routes": dict(self.counts),
            "entries": len(idx),
            "capacity": idx.capacity,
            "evicted": idx.evicted,
            "corrected": idx.corrected,
            "push_back": self.push_back,
        }


def _json(data: bytes) -> dict[str, Any] | None:
    try:
        out = json.loads(data)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None
