"""Lazy access to torch with CUDA, so that importing the backend stays cheap and fork-safe."""

from __future__ import annotations

import os
from types import ModuleType

from kvpush.core.errors import BackendError


def import_torch() -> ModuleType:
    """torch, or a ``BackendError`` saying how to get it."""
    try:
        import torch
    except ImportError as exc:
        raise BackendError(
            f"kvpush CUDA backend needs PyTorch built with CUDA, and torch is not importable ({exc})"
        ) from None
    return torch


def cuda_torch() -> ModuleType:
    """torch with at least one visible CUDA device, or a ``BackendError`` naming why not.

    ``torch.cuda.is_available`` does not create a CUDA context, so this is
    safe before vLLM forks its workers.
    """
    torch = import_torch()
    if not torch.cuda.is_available():
        raise BackendError(
            "kvpush CUDA backend: no CUDA device is usable "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "use backend 'host' on machines without an NVIDIA GPU"
        )
    return torch
