"""Backends: the contract (``base``), optional asynchronous copies (``copy``) and test support
(``testing``); the host backend lives here, others are found by entry point."""

from kvpush.backends.base import Backend, CacheSpec, Capabilities, MemRegistration, StagingBuffer
from kvpush.backends.registry import available_backends, load_backend

__all__ = [
    "Backend",
    "CacheSpec",
    "Capabilities",
    "MemRegistration",
    "StagingBuffer",
    "available_backends",
    "load_backend",
]
