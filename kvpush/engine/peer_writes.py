"""P's WRITEs whichever way a part's bytes travel: a NIXL WRITE, or a peer copy and a NIXL notification.

A *peer write* is the part of a ``PlanKind.PEER`` push: P's backend copies the
part's pieces into the same-host D rank's blocks (``PeerCopy.start_peer_copy``),
and once the copy's marker is reached P sends the part's completion as a
NIXL notification, the message a WRITE would have carried. D cannot tell the
two apart and needs no second path: a notification still means "these bytes
are in place". The push runner posts, polls and gives back both kinds through
``Writes``, so the push job's rules (nothing reported while a part flies)
hold for peer writes unchanged.

A D rank's mapping (``open_peer``) is let go only when no peer write through
it is running: a device copy into memory that is no longer mapped would fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.backends.base import Backend
from kvpush.backends.peer import PeerCopy
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import XferState
from kvpush.transport.nixl_agent import Agent

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PeerWrite:
    """One part of a peer push: its copies (source bases, D's bases, pieces), the D agent to notify and what
    to tell it; ``marker`` once posted."""

    mapped: Any
    copies: list[tuple[list[int], list[int], np.ndarray]]
    agent: str
    notif: bytes
    marker: Any = None
    state: XferState | None = field(default=None)
    """None until posted; PROC while the copy runs; DONE once D was notified, ERR when either failed."""


class Writes:
    """Post, poll and give back P's WRITEs: NIXL's through the agent, peer writes through the backend.

    Also the mappings' owner: ``open`` maps a D rank's KV for peer writes (None when the backend cannot or D
    is out of its reach) and ``retire`` lets a mapping go once no peer write through it runs.
    """

    def __init__(self, name: str, agent: Agent, backend: Backend, enabled: bool) -> None:
        self.name, self.agent, self.backend = name, agent, backend
        self.peer: PeerCopy | None = backend if enabled and isinstance(backend, PeerCopy) else None
        self._running: dict[int, int] = {}  # peer writes in flight, by id of their mapping
        self._retiring: dict[int, Any] = {}  # mappings let go of once nothing runs through them
        if enabled and self.peer is None and not backend.capabilities.peer_by_default:
            log.warning("%s: peer_copy is set but backend %s cannot write a peer's KV", name, backend.name)

    # -- mappings ------------------------------------------------------------
    def open(self, blob: bytes, layout: KVLayout) -> Any:
        """The backend's handle on a D rank's KV from its hello's blob, or None (no blob, not enabled, out of
        reach, or refused: that D rank then gets NIXL WRITEs)."""
        if not blob or self.peer is None:
            return None
        try:
            mapped = self.peer.open_peer(blob, layout)
        except Exception as exc:
            log.warning("%s: cannot map a D rank's KV for peer copies (NIXL WRITEs instead): %s", self.name, exc)
            return None
        return mapped

    def retire(self, mapped: Any) -> None:
        """A D rank was forgotten: let its mapping go now, or once its last peer write ends."""
        if mapped is None or self.peer is None:
            return
        if self._running.get(id(mapped), 0):
            self._retiring[id(mapped)] = mapped
        else:
            self._close(mapped)

    def _close(self, mapped: Any) -> None:
        assert self.peer is not None
        try:
            self.peer.close_peer(mapped)
        except Exception:
            log.exception("%s: close_peer failed", self.name)

    # -- writes ----------------------------------------------------------------
    def peer_write(
        self,
        mapped: Any,
        copies: list[tuple[list[int], list[int], np.ndarray]],
        agent: str,
        notif: bytes,
        prepare: bool = True,
    ) -> PeerWrite:
        """An unposted peer write; with ``prepare`` (a part built at pairing, before its KV is ready) a backend
        with the ``prepare_peer_copy`` hint uploads its tables now, a failing hint only leaves that to the
        post. A part built as it is posted skips the hint: the copy does the same work in one step."""
        hint = getattr(self.peer, "prepare_peer_copy", None) if prepare else None
        if hint is not None:
            try:
                for src, dst, pieces in copies:
                    hint(mapped, src, dst, pieces)
            except Exception:
                log.exception("%s: prepare_peer_copy failed (the copy will do it)", self.name)
        return PeerWrite(mapped, copies, agent, notif)

    def post(self, handle: Any, after: Any = None) -> XferState:
        """Post a NIXL WRITE, or start a peer write's copies (its state then says when D was told); ``after``:
        the KV marker the copies queue behind (a backend that chains), never given for a NIXL WRITE."""
        if not isinstance(handle, PeerWrite):
            if after is not None:
                raise ValueError("a NIXL WRITE cannot queue behind a device marker")
            return self.agent.post(handle)
        assert self.peer is not None and handle.state is None
        marker = None
        for src, dst, pieces in handle.copies:  # one stream: the last ends last
            if after is None:
                marker = self.peer.start_peer_copy(handle.mapped, src, dst, pieces)
            else:
                marker = self.peer.start_peer_copy(handle.mapped, src, dst, pieces, after=after)
        handle.marker = marker
        handle.state = XferState.PROC
        self._running[id(handle.mapped)] = self._running.get(id(handle.mapped), 0) + 1
        return self.state(handle)

    def state(self, handle: Any) -> XferState:
        """A NIXL WRITE's state; a peer write's: PROC until its copy is reached, then D is notified (DONE),
        ERR when the copy or the notification failed."""
        if not isinstance(handle, PeerWrite):
            return self.agent.state(handle)
        if handle.state is not XferState.PROC:
            return handle.state or XferState.ERR
        try:
            if handle.marker is not None and not self.backend.poll_ready(handle.marker):
                return XferState.PROC
            self.agent.send_notif(handle.agent, handle.notif)
            handle.state = XferState.DONE
        except Exception as exc:
            log.warning("%s: peer write failed: %s", self.name, exc)
            handle.state = XferState.ERR
        self._ended(handle.mapped)
        return handle.state

    def release(self, handle: Any) -> None:
        """Give back a WRITE; a peer write still copying (shutdown) is waited for first (it reads P's blocks and
        writes D's), and D is not told."""
        if not isinstance(handle, PeerWrite):
            self.agent.release(handle)
            return
        if handle.state is XferState.PROC:
            try:
                if handle.marker is not None:
                    self.backend.wait_ready(handle.marker)
            finally:
                handle.state = XferState.ERR
                self._ended(handle.mapped)

    def _ended(self, mapped: Any) -> None:
        left = self._running.get(id(mapped), 1) - 1
        if left > 0:
            self._running[id(mapped)] = left
            return
        self._running.pop(id(mapped), None)
        if (retired := self._retiring.pop(id(mapped), None)) is not None:
            self._close(retired)
