"""Test support: what the conformance suite needs from a backend, apart from the core contract.

``kvpush.conformance`` knows nothing of the device, so a backend that wants
to be checked by it also derives from ``TestSupport``: allocate KV caches the
way an engine would, move their bytes in and out, and name memory it must
refuse. Engines never call any of this; a backend without it still works in
kvpush, it just cannot be checked by ``kvpush conformance``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.backends.base import CacheSpec


class TestSupport:
    """Mixin for backends the conformance suite can check (``class MyBackend(TestSupport, Backend)``)."""

    __test__ = False  # not a pytest test class
    name: str = "abstract"

    @classmethod
    def conformance_setup(cls, workdir: Path) -> AbstractContextManager[dict[str, str]]:
        """Prepare this host for the conformance suite, before any instance exists.

        Entered once per suite run; yields environment variables the suite
        sets for itself and the P/D worker processes it spawns (the Neuron
        backend builds its stand-in runtime into ``workdir`` here and names it
        in ``KVPUSH_NRT_LIB``). The default prepares nothing.
        """
        return nullcontext({})

    def make_test_cache(self, spec: CacheSpec, num_layers: int, num_blocks: int, device: int = 0) -> dict[str, Any]:
        """Allocate KV tensors the way an engine on ``device`` would, one per layer, in layer order.

        Each tensor is dense, its dimensions named by ``spec.axes`` (``B`` of
        size ``num_blocks``, ``H`` the rank's local heads, ``N`` the block
        size, ``C`` the head dim, ``K`` 2), in ``spec.dtype``;
        ``describe(result, spec)`` must accept it. Contents are undefined.
        """
        raise NotImplementedError(self._no_test_support("make_test_cache"))

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """Overwrite ``tensor`` with ``data``: uint8, the tensor's bytes in logical C order.

        Behaves like the engine's producer: the write may still be running on
        the device when this returns, and a marker from a later
        ``record_ready()`` covers it. That is what lets the suite check the
        ordering guarantee.
        """
        raise NotImplementedError(self._no_test_support("write_bytes"))

    def read_bytes(self, tensor: Any) -> np.ndarray:
        """The tensor's bytes in logical C order (1-D uint8), after all device work issued before the call."""
        raise NotImplementedError(self._no_test_support("read_bytes"))

    def free_test_cache(self, kv_caches: dict[str, Any]) -> None:
        """Release a cache from ``make_test_cache`` or ``foreign_test_tensors``.

        Default: nothing (dropping the references frees it).
        """

    def foreign_test_tensors(self, spec: CacheSpec, num_blocks: int, device: int = 0) -> dict[str, dict[str, Any]]:
        """Caches of the right shape that ``describe`` must refuse with ``BackendError``, by label.

        E.g. host memory for a device backend, or another device type. The
        suite adds generic cases of its own (non-tensor objects, wrong
        geometry). Default: none.
        """
        return {}

    def _no_test_support(self, what: str) -> str:
        return (
            f"backend {self.name!r} ({type(self).__module__}.{type(self).__qualname__}) does not implement "
            f"{what}, part of the optional test-support surface the conformance suite needs "
            "(see docs/backends.md, 'Test support')"
        )


def cache_shape(spec: CacheSpec, num_blocks: int) -> tuple[int, ...]:
    """The logical shape of one test tensor for ``spec``: its ``axes`` with their sizes."""
    sizes = {"B": num_blocks, "H": spec.local_heads, "N": spec.block_size, "C": spec.head_dim, "K": 2}
    return tuple(sizes[a] for a in spec.axes)
