"""Peer copies: the optional surface of a backend that writes a peer's KV itself, in one pass.

When P and D share a host (one node's GPUs, or two processes of a CPU
host), the device can move P's pieces straight into D's blocks: one
gather-scatter over the direct plan's pieces reads and writes each byte once,
with no per-descriptor price and no staging copies on either side. NIXL still
carries each part's completion notification, so D counts a peer-copied part
as it counts a WRITE (``kvpush.engine.peer_writes``).

The flow: D's backend ``export_peer`` s its KV regions (an opaque blob that
a process on its host can map: CUDA IPC handles, a process id); D sends it in
its ``Hello``; P's backend ``open_peer`` s it, or answers None when D is out
of its reach (another host, another device kind, a mapping refused), and
P then plans that D rank's pushes ``PlanKind.PEER`` instead of direct or
staged. Both sides allow it (``Config.peer_copy``, by default where the
backend says so: ``peer_copies_on``): the blob lets P's process write D's
memory, which only a D that offers it allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kvpush.core.layout import KVLayout

if TYPE_CHECKING:
    from kvpush.backends.base import Backend
    from kvpush.config import Config


def peer_copies_on(cfg: Config, backend: Backend) -> bool:
    """Whether this side allows peer copies: ``peer_copy`` true, or "auto" with a backend that offers them by
    default (``Capabilities.peer_by_default``)."""
    setting = cfg.staging.peer_copy
    return setting is True or (setting == "auto" and backend.capabilities.peer_by_default)


@runtime_checkable
class PeerCopy(Protocol):
    """A backend that can write the KV regions of a peer process on its host."""

    def export_peer(self, layout: KVLayout) -> bytes | None:
        """D: what lets a process on this host write ``layout``'s regions (opaque to the core), or None
        when this process cannot offer it (memory that cannot be shared, an unsupported platform)."""

    def open_peer(self, blob: bytes, layout: KVLayout) -> Any:
        """P: a handle through which ``start_peer_copy`` writes the regions of D's ``layout``, from D's
        ``export_peer`` blob; None when D is out of reach (another host, a mapping refused).

        Every region of ``layout`` must lie inside what the blob exports, or the answer is None: P writes
        only memory D offered. Out of reach is an answer, not an error; a malformed blob raises
        ``BackendError`` naming what is wrong.
        """

    def start_peer_copy(
        self, peer: Any, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray, after: Any = None
    ) -> Any:
        """Copy, for every ``r``, the pieces (``(n, 3)``: source offset, destination offset, length) from
        this process's region ``src_bases[r]`` to D's region ``dst_bases[r]`` (an address in D's process),
        through ``peer`` (``open_peer``'s handle).

        Returns a marker for ``poll_ready``/``wait_ready``, reached once every byte is in D's memory
        (None: already there). P sends the part's notification only then. ``after`` (passed only when
        ``capabilities.chained_ready``, as for ``AsyncCopy.start_pack``): a ``record_ready`` marker the copy
        must run after, so P posts a part as its KV is reported instead of once it sees it written.
        """

    def close_peer(self, peer: Any) -> None:
        """P: let go of ``peer``'s mapping; no copy through it is running (the engine waits for them)."""
