"""Selective disaggregation: serve a prompt on D alone when moving its KV costs more than computing it there.

Disaggregation takes a prompt's prefill off D (its decode batch is not
stalled by it) at the price of the transfer: P's answer, the push, D's extra
scheduler step. For a short prompt the transfer costs more than D's own
prefill would; such prompts are sent to D alone, without kv_transfer_params.

Both costs are learned, never constants:

* **prefill cost per token** from the engines' own metrics: vLLM's
  ``request_prefill_time_seconds`` against the prompt tokens it computed
  (``prompt_tokens_by_source_total{source="local_compute"}``), read from P's
  ``/metrics`` as deltas between scrapes (P and D run the same model);
* **transfer cost** ``fixed + per_token * tokens``: ``per_token`` from
  kvpush's own transfer stats on P (push seconds per byte, times the KV
  bytes of a token); ``fixed`` from the router's own timings of
  disaggregated requests, from P's answer to D's first byte (what the push
  path adds to the time to first token: D's registration round, its extra
  scheduler step), less the bytes' share, as the lower quartile over the
  last ``window`` requests: what the path costs, not what a busy D makes
  every request wait, a local prefill included. The slope is not fitted
  from the router's timings: under load long prompts come with a busier D,
  and a fitted slope learns the load, not the transfer. Without push stats yet, the timings are
  fitted as a line instead;
* **tokens per character** of the prompts, from P's answers (``usage``), so
  a text prompt's length is known before the choice.

Rule: serve on D alone when ``prefill(n) < transfer(n)``, where ``n`` is the
prompt's estimated length. Until both costs are measured every request is
disaggregated; afterwards one request in ``explore_every`` that would stay on
D is disaggregated anyway, so the transfer model follows the load.

This class is pure (numbers in, a choice out); the router feeds it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Route(StrEnum):
    DISAGGREGATE = "disaggregate"
    LOCAL = "local"
    EXPLORE = "explore"  # would be local; disaggregated to keep the transfer model current


@dataclass(frozen=True)
class Choice:
    route: Route
    tokens: int
    prefill_s: float | None
    transfer_s: float | None

    @property
    def local(self) -> bool:
        return self.route is Route.LOCAL


@dataclass(frozen=True)
class Fit:
    """``fixed + per_token * tokens`` seconds, least squares over the window."""

    fixed: float
    per_token: float

    def at(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


def fit_line(samples: list[tuple[int, float]]) -> Fit | None:
    """Least-squares line through ``(tokens, seconds)``; ``None`` without two distinct lengths.

    Slopes and intercepts are kept non-negative: a transfer never gets cheaper with more tokens.
    """
    if len(samples) < 2:
        return None
    xs = [float(x) for x, _ in samples]
    ys = [y for _, y in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
    return Fit(max(0.0, my - slope * mx), slope)


class Selector:
    """Learns both costs and chooses a route per request."""

    def __init__(self, window: int = 64, explore_every: int = 10, min_samples: int = 8) -> None:
        self.window = window
        self.explore_every = explore_every
        self.min_samples = min_samples
        self._transfers: deque[tuple[int, float]] = deque(maxlen=window)
        self._prefill_s_per_token: float | None = None
        self._push_s_per_token: float | None = None
        self._chars: deque[tuple[int, int]] = deque(maxlen=window)  # (characters, tokens) of text prompts
        self._would_be_local = 0
        self.counts: dict[str, int] = {r.value: 0 for r in Route}

    # -- what the router learns -------------------------------------------- #
    def observe_transfer(self, tokens: int, seconds: float) -> None:
        """A disaggregated request: ``seconds`` from P's answer to D's first byte, for ``tokens`` moved."""
        if tokens > 0 and math.isfinite(seconds):
            self._transfers.append((tokens, max(0.0, seconds)))

    def observe_prefill(self, seconds: float, tokens: float) -> None:
        """Prefill seconds an engine spent on ``tokens`` computed prompt tokens (a delta between two scrapes)."""
        if tokens > 0 and seconds > 0:
            self._prefill_s_per_token = seconds / tokens

    def observe_push(self, seconds: float, nbytes: float, bytes_per_token: float) -> None:
        """kvpush's push time for ``nbytes`` (a delta between two scrapes of P's transfer stats)."""
        if seconds > 0 and nbytes > 0 and bytes_per_token > 0:
            self._push_s_per_token = seconds / nbytes * bytes_per_token

    def transfer_samples(self) -> list[tuple[int, float]]:
        """The transfer timings kept (the last ``window``), oldest first: ``(tokens, seconds)`` each."""
        return list(self._transfers)

    def transfer_model(self) -> Fit | None:
        """The transfer cost as learned so far (``None`` until ``min_samples`` timings)."""
        samples = self.transfer_samples()
        if len(samples) < self.min_samples:
            return None
        slope = self._push_s_per_token
        if slope is None:
            return fit_line(samples)
        rest = sorted(seconds - slope * n for n, seconds in samples)
        return Fit(max(0.0, rest[len(rest) // 4]), slope)

    def observe_prompt(self, chars: int, tokens: int) -> None:
        """A text prompt's length in characters and in tokens (P's ``usage.prompt_tokens``)."""
        if chars > 0 and tokens > 0:
            self._chars.append((chars, tokens))

    # -- the choice ------------------------------------------------------------ #
    def tokens_of(self, body: dict[str, Any]) -> int | None:
        """The prompt's length in tokens: exact for token ids, estimated for text; ``None`` if unknown."""
        prompt = body.get("prompt")
        if prompt is None and isinstance(body.get("messages"), list):
            prompt = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, list):
            return None  # several prompts: one choice for all is not made
        if not isinstance(prompt, str) or not self._chars:
            return None
        chars = sum(c for c, _ in self._chars)
        tokens = sum(t for _, t in self._chars)
        return max(1, round(len(prompt) * tokens / chars))

    def choose(self, body: dict[str, Any]) -> Choice:
        n = self.tokens_of(body)
        fit = self.transfer_model()
        rate = self._prefill_s_per_token
        if n is None or fit is None or rate is None:
            return self._count(Choice(Route.DISAGGREGATE, n or 0, None, None))
        prefill, transfer = rate * n, fit.at(n)
        if prefill >= transfer:
            return self._count(Choice(Route.DISAGGREGATE, n, prefill, transfer))
        self._would_be_local += 1
        route = Route.EXPLORE if self._would_be_local % self.explore_every == 0 else Route.LOCAL
        return self._count(Choice(route, n, prefill, transfer))

    def _count(self, c: Choice) -> Choice:
        self.counts[c.route.value] += 1
        return c

    def state(self) -> dict[str, Any]:
        """What the router shows on ``/kvpush/pending``: the learned costs and the choices so far."""
        fit = self.transfer_model()
        return {
            "prefill_s_per_token": self._prefill_s_per_token,
            "push_s_per_token": self._push_s_per_token,
            "transfer_fixed_s": fit.fixed if fit else None,
            "transfer_s_per_token": fit.per_token if fit else None,
            "transfer_samples": len(self._transfers),
            "choices": dict(self.counts),
        }
