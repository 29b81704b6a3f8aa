"""Which backend the suite checks, and how every process of the suite builds it.

A target is plain, picklable data (backend name, constructor options,
devices, NIXL plugins), so the P and D worker processes rebuild exactly the
backend the test process was asked about. The backend is named either by its
entry point in ``kvpush.backends`` or as ``module:Class``, so a backend under
development (or the ``examples/minimal_backend`` one) runs the suite without
being installed.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

from kvpush.backends.base import Backend
from kvpush.backends.registry import available_backends
from kvpush.backends.testing import TestSupport
from kvpush.core.errors import ConfigError


def resolve_backend_class(spec: str) -> type[Backend]:
    """The Backend subclass named by an entry-point name or ``module:Class``."""
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"backend {spec!r}: cannot import module {module!r}: {exc}") from None
        cls = getattr(mod, attr, None)
        if cls is None:
            raise ConfigError(f"backend {spec!r}: module {module!r} has no attribute {attr!r}")
    else:
        eps = available_backends()
        if spec not in eps:
            raise ConfigError(
                f"kvpush backend {spec!r} is not installed (entry points in kvpush.backends: "
                f"{', '.join(sorted(eps)) or 'none'}); install its distribution or pass module:Class"
            )
        cls = eps[spec].load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"backend {spec!r} is {cls!r}, not a subclass of kvpush.backends.base.Backend")
    return cls


def parse_options(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """``key=value`` strings as constructor keyword arguments; values are JSON when they parse, else strings."""
    out: list[tuple[str, Any]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"backend option {item!r} is not KEY=VALUE (KEY a Python identifier)")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out.append((key, value))
    return tuple(out)


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``: P uses the first device, D the last."""
    try:
        devices = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"devices {text!r} are not comma-separated integers") from None
    if not devices or any(d < 0 for d in devices):
        raise ConfigError(f"devices {text!r}: give one or two device indices, e.g. 0 or 0,1")
    return devices


@dataclass(frozen=True)
class Target:
    """The backend under test and how to run it."""

    backend: str
    options: tuple[tuple[str, Any], ...] = ()
    devices: tuple[int, ...] = (0,)
    nixl_backends: tuple[str, ...] = ("UCX",)

    @property
    def p_device(self) -> int:
        return self.devices[0]

    @property
    def d_device(self) -> int:
        return self.devices[-1]

    def backend_class(self) -> type[Backend]:
        return resolve_backend_class(self.backend)

    def make(self) -> Backend:
        """A fresh backend instance, as an engine rank would create it, bound to the calling thread.

        The suite calls the backend's test support from the thread that made
        it, so that thread gets the backend's thread hook as kvpush's own
        threads do.
        """
        cls = self.backend_class()
        backend = cls(**dict(self.options))
        if not isinstance(backend, Backend):  # pragma: no cover - a __new__ that returns something else
            raise ConfigError(f"{cls!r}() gave {type(backend).__name__}, not a Backend")
        if not isinstance(backend, TestSupport):
            raise ConfigError(
                f"{cls!r} does not derive from kvpush.backends.testing.TestSupport: the conformance suite needs "
                "its test support (see docs/backends.md, 'Test support')"
            )
        backend.bind_thread()
        return backend

    def describe(self) -> str:
        opts = " ".join(f"{k}={v!r}" for k, v in self.options)
        where = f"devices={list(self.devices)} nixl={list(self.nixl_backends)}"
        return f"{self.backend}{' ' + opts if opts else ''} {where}"
