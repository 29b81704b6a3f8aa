"""The held index: how many of a prompt's tokens each instance already holds in its prefix cache, as the router saw.

The router has no tokenizer and does not reproduce vLLM's block hashes
(their seed is random per process on vLLM 0.24, and they hash a pickle:
docs/design.md, "Multi-turn"). It keys on what it sees of a request, its
**units**: the prompt's token ids when the prompt is token ids, else the
characters of the prompt, or of the chat messages in one canonical form
(each message's role and content), so that turn k's messages plus its
answer are the start of turn k+1's. The units are cut into chunks
(``chunk_tokens`` ids, ``chunk_chars`` characters); each chunk's key is a
BLAKE2b over its parent's key and its own units, rooted in the model and
the ``cache_salt`` (vLLM's prefix cache is per model and salt too), so one
key names one whole prefix.

Rule:

* ``record(instance, units, tokens)``: the instance holds these units, which
  are ``tokens`` tokens (token ids: one per unit; text: each chunk boundary
  its share of ``tokens`` by characters). What it learns from answers: an
  instance that prefilled, received or served a prompt holds it.
* ``held(instance, units)``: the tokens at the deepest chunk boundary the
  instance holds, walking from the start and stopping at the first chunk it
  does not (a prefix cache reuses a prefix only).
* ``correct(instance, units, cached, slack)``: the instance reused only
  ``cached`` tokens of these units: its boundaries past ``cached + slack``
  are dropped (it evicted them); returns how many, so the router counts its
  misses.
* ``forget(instance)``: all of an instance's entries go (it went down or
  came back: its cache is empty).
* At most ``capacity`` entries, one per (instance, chunk); the least
  recently recorded or matched goes first.

Reason: the index is a guess that only speeds requests up. D's prefix cache
decides what is really reused, so an entry that outlived D's block costs a
prefill D did not expect, never a wrong output; corrections go down, and the
memory is bounded whatever the clients send.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 65536
DEFAULT_CHUNK_TOKENS = 32
DEFAULT_CHUNK_CHARS = 128


@dataclass(frozen=True)
class Units:
    """What the router sees of a prompt: its token ids (``tuple``) or its characters (``str``), and the root
    that keys its chain (model, cache salt, which of the two kinds)."""

    root: bytes
    seq: str | tuple[int, ...]

    @property
    def token_ids(self) -> bool:
        return isinstance(self.seq, tuple)

    def __len__(self) -> int:
        return len(self.seq)

    def then(self, more: str | tuple[int, ...]) -> Units:
        """These units followed by ``more`` (of the same kind): a prompt and its answer."""
        if isinstance(self.seq, tuple) != isinstance(more, tuple):
            raise ValueError("units and what follows them must both be token ids or both text")
        return Units(self.root, self.seq + more)  # type: ignore[operator]


def _root(body: dict[str, Any], kind: str) -> bytes:
    salt = body.get("cache_salt")
    return hashlib.blake2b(
        json.dumps([kind, str(body.get("model", "")), salt if isinstance(salt, str) else ""]).encode(), digest_size=16
    ).digest()


def message_text(message: dict[str, Any]) -> str:
    """One chat message in the index's canonical form: its role and content (a list content as JSON)."""
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, separators=(",", ":"))
    return f"{message.get('role', '')}\x1f{text}\x1e"


def units_of(body: dict[str, Any]) -> Units | None:
    """The units of a completion or chat request (``None``: several prompts, or no prompt the index can key)."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        if not all(isinstance(m, dict) for m in messages):
            return None
        return Units(_root(body, "chat"), "".join(message_text(m) for m in messages))
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return Units(_root(body, "text"), prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Units(_root(body, "ids"), tuple(prompt))
    return None


def answer_units(body: dict[str, Any], answer: dict[str, Any]) -> str | None:
    """What a one-choice answer adds to its prompt's units as the next turn sends it back (``None``: unknown)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict) or body.get("echo"):
        return None
    if isinstance(body.get("messages"), list):
        message = choices[0].get("message")
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return None
        return message_text({"role": message.get("role") or "assistant", "content": message["content"]})
    text = choices[0].get("text")
    return text if isinstance(text, str) and isinstance(body.get("prompt"), str) else None


@dataclass(frozen=True)
class Held:
    """What an instance holds of a prompt: ``tokens`` at the deepest chunk boundary it holds, ``units`` up to
    there (0 and 0: nothing)."""

    tokens: int
    units: int

    def prompt_tokens(self, units: Units) -> int | None:
        """The whole prompt's tokens: exact for token ids, else scaled from this match's tokens per unit."""
        if units.token_ids:
            return len(units)
        if self.units <= 0:
            return None
        return max(self.tokens, round(self.tokens * len(units) / self.units))


NOTHING = Held(0, 0)


class HeldIndex:
    """The module's rule over a bounded LRU of (instance, chunk key) -> tokens at that chunk's end."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
    ) -> None:
        for name, value in (("capacity", capacity), ("chunk_tokens", chunk_tokens), ("chunk_chars", chunk_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"held index {name} must be an int >= 1, got {value!r}")
        self.capacity = capacity
        self.chunk_tokens = chunk_tokens
        self.chunk_chars = chunk_chars
        self._entries: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._count: dict[str, int] = {}  # entries per instance
        self.evicted = 0  # entries dropped for capacity
        self.corrected = 0  # entries dropped because an instance reused less than they said

    def __len__(self) -> int:
        return len(self._entries)

    def entries_of(self, instance: str) -> int:
        return self._count.get(instance, 0)

    def _chunk(self, units: Units) -> int:
        return self.chunk_tokens if units.token_ids else self.chunk_chars

    def _keys(self, units: Units) -> Iterator[tuple[bytes, int]]:
        """Each whole chunk's key and the units up to its end, from the start."""
        size, seq = self._chunk(units), units.seq
        key = units.root
        for end in range(size, len(seq) + 1, size):
            part = seq[end - size : end]
            data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else repr(part).encode()
            key = hashlib.blake2b(key + data, digest_size=16).digest()
            yield key, end

    def held(self, instance: str, units: Units) -> Held:
        """What ``instance`` holds of ``units`` (the rule's walk; matched entries become recent)."""
        found = NOTHING
        for key, end in self._keys(units):
            tokens = self._entries.get((instance, key))
            if tokens is None:
                break
            self._entries.move_to_end((instance, key))
            found = Held(tokens, end)
        return found

    def record(self, instance: str, units: Units, tokens: int) -> None:
        """``instance`` holds ``units``, which are ``tokens`` tokens (ignored for token ids: one per unit)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        total = len(units)
        for key, end in self._keys(units):
            at = end if units.token_ids else tokens * end // total
            entry = (instance, key)
            if entry not in self._entries:
                self._count[instance] = self._count.get(instance, 0) + 1
            self._entries[entry] = at
            self._entries.move_to_end(entry)
        while len(self._entries) > self.capacity:
            (gone, _), _ = self._entries.popitem(last=False)
            self._drop_count(gone)
            self.evicted += 1

    def correct(self, instance: str, units: Units, cached: int, slack: int = 0) -> int:
        """``instance`` reused only ``cached`` tokens of ``units``: drop its entries past ``cached + slack``
        (``slack``: what an estimate and D's whole blocks may differ by); how many."""
        for name, value in (("cached", cached), ("slack", slack)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        dropped = 0
        for key, _ in self._keys(units):
            tokens = self._entries.get((instance, key))
            if tokens is None:
                break
            if tokens > cached + slack:
                del self._entries[(instance, key)]
                self._drop_count(instance)
                dropped += 1
        self.corrected += dropped
        return dropped

    def forget(self, instance: str) -> int:
        """Drop every entry of ``instance``; how many."""
        keys = [e for e in self._entries if e[0] == instance]
        for e in keys:
            del self._entries[e]
        self._count.pop(instance, None)
        return len(keys)

    def _drop_count(self, instance: str) -> None:
        left = self._count[instance] - 1
        if left:
            self._count[instance] = left
        else:
            del self._count[instance]
