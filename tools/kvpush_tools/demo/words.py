"""The tiny models' words: a vocabulary of ordinary and made-up words, prompts of exactly ``n`` tokens, the chat
template and a ``tokenizers`` WordLevel tokenizer split on whitespace.

Every word of :func:`prompt_words` is exactly one token and no BOS is added, so a prompt of ``n`` words is a
prompt of ``n`` tokens: tests and benchmarks ask for a prompt length and get it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

UNK = "<unk>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (UNK, EOS, IM_START, IM_END)


# Ordinary words first, so prompts and chat messages look a little like text.
_COMMON_WORDS = (Path(__file__).with_name("words.txt")).read_text().split()
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "ch",
    "sh",
    "th",
    "st",
    "tr",
    "pl",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
MIN_VOCAB_SIZE = 512


# prompt_words draws from this many leading ordinary words; they exist in
# every vocabulary this module builds (vocab_size >= MIN_VOCAB_SIZE).
_PROMPT_POOL = 480


def vocabulary(vocab_size: int) -> list[str]:
    """The first ``vocab_size`` tokens: specials, common words, then synthetic
    syllable words. Prefix-stable: a larger vocabulary extends a smaller one,
    so :func:`prompt_words` works for every size."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    words: list[str] = list(SPECIAL_TOKENS)
    seen = set(words)
    for w in _COMMON_WORDS:
        if w not in seen:
            seen.add(w)
            words.append(w)
    syllables = [o + v for o in _ONSETS for v in _VOWELS]
    # The syllable words run out (a few tens of thousands); real-model vocabularies go on with numbered words.
    spelled = len(syllables) ** 2 * 2
    i = 0
    while len(words) < vocab_size:
        # Deterministic two- and three-syllable words.
        a, b, c = syllables[i % len(syllables)], syllables[(i * 7 + 3) % len(syllables)], i // len(syllables)
        w = a + b if c == 0 else a + b + syllables[(c * 13) % len(syllables)]
        if i >= spelled:
            w = f"w{i}"
        i += 1
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words[:vocab_size]


def prompt_words(n: int, seed: int = 0) -> str:
    """A prompt of exactly ``n`` tokens for the tiny model's tokenizer
    (``n`` whitespace-separated in-vocabulary words, no BOS added).

    Deterministic in ``seed`` so tests can build prompts of known lengths and
    distinct contents (distinct seeds give distinct prefixes, which keeps
    prefix caching from hiding transfers)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    pool = vocabulary(MIN_VOCAB_SIZE)[len(SPECIAL_TOKENS) : _PROMPT_POOL]
    rng = random.Random(seed)
    return " ".join(rng.choice(pool) for _ in range(n))


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def word_tokenizer(vocab: dict[str, int], fast_cls: Any) -> Any:
    """WordLevel tokenizer: lowercase, split on whitespace, words joined back
    with single spaces on decode (so streamed text is readable)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece's decoder puts a space between words (no "##" pieces here).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return fast_cls(
        tokenizer_object=tok,
        unk_token=UNK,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
