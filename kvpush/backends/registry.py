"""Finding backends through the ``kvpush.backends`` entry-point group.

Installing ``backends/cuda`` or ``backends/neuron`` adds an entry; the core
imports no device library, so a missing backend is a clear error, not an
ImportError from deep inside torch.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from kvpush.backends.base import Backend
from kvpush.core.errors import ConfigError

GROUP = "kvpush.backends"


def available_backends() -> dict[str, Any]:
    """Entry points by name (not loaded)."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_backend(name: str, **options: Any) -> Backend:
    """Instantiate backend ``name`` with ``options``."""
    eps = available_backends()
    if name not in eps:
        raise ConfigError(
            f"kvpush backend {name!r} is not installed (found: {', '.join(sorted(eps)) or 'none'}); "
            f"install its distribution, e.g. pip install -e backends/{name}"
        )
    cls = eps[name].load()
    backend = cls(**options)
    if not isinstance(backend, Backend):
        raise ConfigError(f"entry point {name!r} gave {type(backend).__name__}, not a kvpush Backend")
    return backend
