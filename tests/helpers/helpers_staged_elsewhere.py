"""The host backend with its KV declared as device memory NIXL never sees, staged through host memory.

This is the shape of the CUDA backend's host staging (``staging=host``) on a host without a GPU:
the layout says VRAM, nothing of the KV is registered, the staging buffers are DRAM. A WRITE that
named the layout's memory kind for the staging descriptors would find no registration.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.backends.base import CacheSpec, Capabilities, MemRegistration
from kvpush.backends.host import HostBackend
from kvpush.core.layout import KVLayout, MemKind


class StagedElsewhereBackend(HostBackend):
    name = "staged-elsewhere"
    capabilities = Capabilities(direct=False)

    def describe(self, kv_caches: dict[str, Any], spec: CacheSpec) -> KVLayout:
        return msgspec.structs.replace(super().describe(kv_caches, spec), mem=MemKind.VRAM)

    def registrations(self, layout: KVLayout) -> list[MemRegistration]:
        return []
