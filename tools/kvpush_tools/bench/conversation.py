"""Pure parts of ``kvpush bench serve --profile multi-turn``: the conversations it sends and the order it runs them.

A conversation is a first prompt and one new user message per later turn. Turn
k+1's prompt is turn k's prompt, turn k's answer and turn k+1's message, joined
by single spaces (:func:`next_prompt`): the tiny model's tokenizer splits on
whitespace, so each word of a message is one token and turn k's prompt and
answer are exactly the start of turn k+1's, as in a chat client that resends
the history. Several conversations run at once, started a little apart
(:func:`start_offsets`), each sending its next turn when its previous answer
ended and a think time passed.

Every cell (mode, router) of one (iteration, point) sends the *same*
conversations (:func:`scripts`, seeded by iteration and point only). What
keeps one cell's KV from serving another's, on servers that two cells share
or across iterations, is vLLM's ``cache_salt``: a different salt per
(iteration, point, cell) (:func:`cache_salt`) roots the prefix cache's hash
chain elsewhere, and the router's held index keys on the salt too.

Nothing here starts a process or opens a socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Script:
    """One conversation's user side: the first prompt and the new message of each later turn (words)."""

    conversation: int
    first: str
    messages: tuple[str, ...]  # turn 2's message, turn 3's, ...

    @property
    def turns(self) -> int:
        return 1 + len(self.messages)


def scripts(
    conversations: int, turns: int, turn_tokens: int, seed: int, first_tokens: int | None = None
) -> list[Script]:
    """``conversations`` scripts of ``turns`` turns: a first prompt of ``first_tokens`` words (default
    ``turn_tokens``) and ``turns - 1`` messages of ``turn_tokens`` words, all seeded by ``seed`` (equal
    for every cell of a point, different between conversations and turns)."""
    if conversations < 1 or turns < 1 or turn_tokens < 1:
        raise ValueError(
            f"conversations, turns and turn_tokens must be >= 1, got {conversations}, {turns}, {turn_tokens}"
        )
    first_tokens = turn_tokens if first_tokens is None else first_tokens
    if first_tokens < 1:
        raise ValueError(f"first_tokens must be >= 1, got {first_tokens}")
    from kvpush_tools.demo.words import prompt_words

    out = []
    for c in range(conversations):
        base = (seed * 1009 + c) * 100
        first = prompt_words(first_tokens, seed=base)
        messages = tuple(prompt_words(turn_tokens, seed=base + k) for k in range(1, turns))
        out.append(Script(c, first, messages))
    return out


def next_prompt(prompt: str, answer: str, message: str) -> str:
    """Turn k+1's prompt: turn k's ``prompt``, its ``answer`` and the new ``message``, one space apart (an
    empty answer adds nothing)."""
    parts = [prompt.strip(), answer.strip(), message.strip()]
    return " ".join(p for p in parts if p)


def start_offsets(conversations: int, stagger_s: float) -> list[float]:
    """When each conversation sends its first turn (seconds from the run's start): ``stagger_s`` apart, so
    their turns interleave instead of marching in step."""
    if stagger_s < 0:
        raise ValueError(f"stagger_s must be >= 0, got {stagger_s}")
    return [c * stagger_s for c in range(conversations)]


def cache_salt(iteration: int, turn_tokens: int, cell_label: str) -> str:
    """The ``cache_salt`` of one (iteration, point, cell): distinct for each, so no cell reuses KV another
    left in a shared or long-lived server's prefix cache."""
    return f"mt-{iteration}-{turn_tokens}-{cell_label.replace(' ', '_')}"


def point_seed(base: int, iteration: int, turn_tokens: int) -> int:
    """The seed of one (iteration, point): equal for every cell, different between points and iterations."""
    return (base * 1_000_003 + iteration * 10_007 + turn_tokens * 101 + 77) % (2**31)


def rotations(cells: Sequence[object], points: Sequence[int], iterations: int) -> list[tuple[int, int, list[object]]]:
    """(iteration, turn_tokens, cell order) for every run group, in run order; the order rotates by one per
    group, so each cell runs first, second, ... equally often (drift of a shared host hits all alike)."""
    out = []
    k = 0
    for it in range(iterations):
        for tokens in points:
            r = k % len(cells)
            out.append((it, tokens, [*cells[r:], *cells[:r]]))
            k += 1
    return out
