"""The engine's ports: what each collaborator of an engine thread may ask of its owner, and no more.

The sender's peer table and push runner are handed these (the owner,
``Sender``, or a machine it holds, is what stands behind them), plus the
explicit objects they work with (agent, sockets, staging). The receiver's
links ask D's fencing through ``kvpush.decode.link.Fences``, a pure
machine's view of another, so it lives with them. None imports its owner:
each can be read alone, and the import graph has no cycle (``python -m kvpush_tools.imports``, in CI).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvpush.core import protocol
from kvpush.core.counts import Count
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import Failed
from kvpush.prefill.push_job import DKey


class PeerMaps(Protocol):
    """What the peer table asks of the mappings for peer copies (``kvpush.engine.peer_writes.Writes``)."""

    def open(self, blob: bytes, layout: KVLayout) -> Any:
        """Map a D rank's KV from its hello's blob; None: that rank gets NIXL WRITEs."""
        ...

    def retire(self, mapped: Any) -> None:
        """The D rank was forgotten: let its mapping go once nothing writes through it."""
        ...


class PeerPort(Protocol):
    """What the peer table tells P's engine (``kvpush.engine.sender.Sender``) of the D ranks it hears, and asks
    it: its only way back to the engine."""

    def on_register(self, ident: bytes, reg: protocol.Register, now: float, owner: str, cap: int) -> None:
        """A registration the table accepted, by the D key ``owner`` (``cap``: block ids its rank may hold)."""
        ...

    def on_remote_abort(self, msg: protocol.Abort, by: DKey, writer: bool = True) -> None:
        """An abort from the key that registered the transfer."""
        ...

    def on_credit(self, key: DKey, msg: protocol.Credit) -> None:
        """D rank ``key`` credits parts of its push in rounds (``kvpush.core.rounds``)."""
        ...

    def drop_peer(self, key: DKey, reason: str, now: float) -> None:
        """Forget D rank ``key``'s transfers (the table forgets the rank)."""
        ...

    def fail(self, ident: bytes, reg: protocol.Register, failed: Failed) -> None:
        """Tell the D rank that this registration will not (all) be written."""
        ...

    def writing_to(self, key: DKey) -> bool:
        """A WRITE into D rank ``key`` is in flight."""
        ...

    def bump(self, what: Count, by: float = 1.0) -> None: ...


class PushPort(Protocol):
    """What the push jobs tell P's engine (``kvpush.engine.sender.Sender``): their only way back to it."""

    def push_ended(self, transfer_id: str, key: DKey, failed: Failed | None) -> None:
        """A push ended (``failed`` None: written): the rendezvous decides what follows."""
        ...

    def fail(self, ident: bytes, reg: protocol.Register, failed: Failed) -> None:
        """Tell the D rank that this registration will not (all) be written."""
        ...

    def tell_posting(self, reg: protocol.Register, peer: Any) -> None:
        """Tell the D rank that the push of this registration starts writing (``protocol.Posting``)."""
        ...

    def bump(self, what: Count, by: float = 1.0) -> None: ...


class PeerLookup(Protocol):
    """The D ranks that said hello (``kvpush.engine.peers.PeerTable``)."""

    def get(self, key: DKey) -> Any: ...

    def ident_of(self, key: DKey) -> bytes | None: ...


class Counter(Protocol):
    """An engine's counters (``EngineLoop.bump``): all that P's hand-over tells its engine."""

    def bump(self, what: Count, by: float = 1.0) -> None: ...
