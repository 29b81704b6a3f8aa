"""Backends: the host backend lives here; others are found by entry point."""

from kvpush.backends.base import Backend, CacheSpec, MemRegistration, StagingBuffer
from kvpush.backends.registry import available_backends, load_backend

__all__ = ["Backend", "CacheSpec", "MemRegistration", "StagingBuffer", "available_backends", "load_backend"]
