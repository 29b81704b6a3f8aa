"""Asynchronous pack and unpack: the optional copy surface of a backend.

A device backend whose copies run on the device (a CUDA stream) implements
``AsyncCopy``: ``start_pack``/``start_unpack`` return a marker instead of
waiting, so the engine threads keep progressing NIXL while the device copies,
and the ``prepare_*`` hints upload piece tables off the critical path. The
engine never asks which kind it has: it calls ``copier(backend)``, a
``Copier`` that uses the backend's asynchronous copies and hints where it has
them, else packs and unpacks synchronously through the core contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvpush.backends.base import Backend

Parts = Sequence[tuple[int, int, int]]


@runtime_checkable
class AsyncCopy(Protocol):
    """Packs and unpacks that may return before the bytes are in place.

    A backend implementing it may also offer the hints ``prepare_pack`` and
    ``prepare_unpack`` (same signatures as on ``Copier``); without them the
    engine's calls to the hints do nothing.
    """

    def start_pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int, after: Any = None) -> Any:
        """``pack``, returning a marker for ``poll_ready``/``wait_ready`` that is reached once the bytes are in place.

        The push thread posts the WRITE only once the marker is reached.
        ``after`` (passed only when ``capabilities.chained_ready``): a
        ``record_ready`` marker the pack must run after.
        """

    def start_unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> Any:
        """``unpack`` that may return early; D reports the regions only once the marker is reached.

        Until then the staging bytes and the destination blocks stay D's (the
        slot is not granted again, the blocks are not handed back).
        """


class Copier:
    """What the engine calls for packs and unpacks: the backend's asynchronous copies and hints where it has
    them, else synchronous copies through the core contract (markers ``None``: reached) and no-op hints."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.asynchronous = isinstance(backend, AsyncCopy)

    def start_pack(self, regions: list[int], pieces: np.ndarray, staging_addr: int, after: Any = None) -> Any:
        if self.asynchronous:
            if after is None:
                return self.backend.start_pack(regions, pieces, staging_addr)  # type: ignore[attr-defined]
            return self.backend.start_pack(regions, pieces, staging_addr, after=after)  # type: ignore[attr-defined]
        if after is not None:
            self.backend.wait_ready(after)
        self.backend.pack(regions, pieces, staging_addr)
        return None

    def start_unpack(self, regions: list[int], pieces: np.ndarray, staging_addr: int) -> Any:
        if self.asynchronous:
            return self.backend.start_unpack(regions, pieces, staging_addr)  # type: ignore[attr-defined]
        self.backend.unpack(regions, pieces, staging_addr)
        return None

    def prepare_pack(self, regions: list[int], pieces: np.ndarray, parts: Parts = ()) -> None:
        """Hint: a pack of these pieces is coming (P calls it when it plans, before the KV is ready).

        ``parts``: the ``start_pack(regions[r0:r1], pieces, staging_addr)``
        calls P expects to make, as ``(r0, r1, staging_addr)``.
        """
        hint = getattr(self.backend, "prepare_pack", None)
        if hint is not None:
            hint(regions, pieces, parts=parts)

    def prepare_unpack(self, regions: list[int], pieces: np.ndarray, parts: Parts = ()) -> None:
        """Hint: an unpack of these pieces is coming (D calls it when it registers); ``parts`` is D's guess
        at P's cut."""
        hint = getattr(self.backend, "prepare_unpack", None)
        if hint is not None:
            hint(regions, pieces, parts=parts)


def copier(backend: Backend) -> Copier:
    """The engine's view of the backend's packs and unpacks (see ``Copier``)."""
    return Copier(backend)
