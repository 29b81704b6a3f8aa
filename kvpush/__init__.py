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
    "CacheSpec": "kvpush.core.layout",
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

__all__ = ["__version__", *_PUBLIC]


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
    from kvpush.backends.base import Backend as Backend
    from kvpush.backends.base import Capabilities as Capabilities
    from kvpush.backends.base import MemRegistration as MemRegistration
    from kvpush.backends.base import StagingBuffer as StagingBuffer
    from kvpush.backends.registry import load_backend as load_backend
    from kvpush.config import Config as Config
    from kvpush.core.errors import BackendError as BackendError
    from kvpush.core.errors import ConfigError as ConfigError
    from kvpush.core.errors import KVPushError as KVPushError
    from kvpush.core.errors import LayoutError as LayoutError
    from kvpush.core.errors import ProtocolError as ProtocolError
    from kvpush.core.layout import CacheSpec as CacheSpec
    from kvpush.core.layout import KVLayout as KVLayout
    from kvpush.core.layout import MemKind as MemKind
    from kvpush.core.layout import Region as Region
    from kvpush.core.outcome import Cause as Cause
    from kvpush.core.outcome import Result as Result
    from kvpush.core.outcome import Stage as Stage
    from kvpush.core.protocol import PROTOCOL_VERSION as PROTOCOL_VERSION
    from kvpush.engine import PeerAddress as PeerAddress
    from kvpush.engine import Receiver as Receiver
    from kvpush.engine import Sender as Sender
    from kvpush.observability.metrics import TransferStats as TransferStats
