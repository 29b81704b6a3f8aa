"""kvpush: push-based KV-cache transfer for prefill/decode disaggregation.

This module is the public surface: what a backend author or an integrator
imports, by name, from ``kvpush``. Everything else is reachable by its path
(``kvpush/README.md`` gives the layout and the reading path of one request),
but only these names are promised to keep their meaning across releases.

The names resolve on first use (PEP 562): importing ``kvpush`` for its
version, or importing one of its modules, loads neither the engine nor NIXL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC: dict[str, str] = {
    # the wire
    "PROTOCOL_VERSION": "kvpush.core.protocol",
    # configuration and errors
    "Config": "kvpush.config",
    "KVPushError": "kvpush.core.errors",
    "ConfigError": "kvpush.core.errors",
    "LayoutError": "kvpush.core.errors",
    "BackendError": "kvpush.core.errors",
    "ProtocolError": "kvpush.core.errors",
    # what a device backend implements and describes
    "Backend": "kvpush.backends.base",
    "Capabilities": "kvpush.backends.base",
    "CacheSpec": "kvpush.backends.base",
    "MemRegistration": "kvpush.backends.base",
    "StagingBuffer": "kvpush.backends.base",
    "KVLayout": "kvpush.core.layout",
    "MemKind": "kvpush.core.layout",
    "Region": "kvpush.core.layout",
    "load_backend": "kvpush.backends.registry",
    # what an integration drives and reads back
    "Sender": "kvpush.engine",
    "Receiver": "kvpush.engine",
    "PeerAddress": "kvpush.engine",
    "Result": "kvpush.core.outcome",
    "Cause": "kvpush.core.outcome",
    "Stage": "kvpush.core.outcome",
    "TransferStats": "kvpush.observability.metrics",
}

__all__ = [
    "PROTOCOL_VERSION",
    "Backend",
    "BackendError",
    "CacheSpec",
    "Capabilities",
    "Cause",
    "Config",
    "ConfigError",
    "KVLayout",
    "KVPushError",
    "LayoutError",
    "MemKind",
    "MemRegistration",
    "PeerAddress",
    "ProtocolError",
    "Receiver",
    "Region",
    "Result",
    "Sender",
    "Stage",
    "StagingBuffer",
    "TransferStats",
    "__version__",
    "load_backend",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpush' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from kvpush.backends.base import Backend, CacheSpec, Capabilities, MemRegistration, StagingBuffer
    from kvpush.backends.registry import load_backend
    from kvpush.config import Config
    from kvpush.core.errors import BackendError, ConfigError, KVPushError, LayoutError, ProtocolError
    from kvpush.core.layout import KVLayout, MemKind, Region
    from kvpush.core.outcome import Cause, Result, Stage
    from kvpush.core.protocol import PROTOCOL_VERSION
    from kvpush.engine import PeerAddress, Receiver, Sender
    from kvpush.observability.metrics import TransferStats
