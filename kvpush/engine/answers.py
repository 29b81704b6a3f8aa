"""P's answers to D's registrations besides the WRITEs: ``Failure`` and ``Ack`` (side channel I/O only).

A ``Failure`` is logged; those a D can cause at will (a bad registration,
one over its limits, a refusal) once per interval per D rank and cause,
with a count: a flood of them must not flood the log.
"""

from __future__ import annotations

import logging
import time

from kvpush.core import protocol
from kvpush.core.counts import Count
from kvpush.core.limits import Throttle
from kvpush.core.outcome import Cause, Failed, PrefillState
from kvpush.engine.ports import Counter, PeerLookup
from kvpush.transport.auth import LOG_EVERY_S
from kvpush.transport.side_channel import Server

log = logging.getLogger(__name__)

PEER_CAUSED = frozenset({Cause.OVER_LIMIT, Cause.BAD_REGISTRATION, Cause.REFUSED})
"""Refusals a D can cause at will: logged once per interval per D rank and cause (``Answers.fail``)."""


class Answers:
    """What one P rank sends D ranks about their registrations, through its side channel ``server``."""

    def __init__(self, name: str, rank: int, server: Server, peers: PeerLookup, port: Counter) -> None:
        self.name = name
        self.rank = rank
        self.server = server
        self.peers = peers
        self.port = port
        self._fail_log = Throttle(LOG_EVERY_S)

    def fail(self, ident: bytes, reg: protocol.Register, failed: Failed) -> None:
        """Tell a D rank that this registration will not (all) be written."""
        self.port.bump(Count.FAILURES_SENT)
        held: int | None = 0
        if failed.cause in PEER_CAUSED:
            held = self._fail_log.note((reg.engine_id, reg.rank, failed.cause), time.monotonic())
        if held is not None:
            log.warning(
                "%s: transfer %s from D %s rank %d failed at %s: %s%s",
                self.name,
                reg.transfer_id,
                reg.engine_id,
                reg.rank,
                failed.stage,
                failed.reason,
                f" ({held} more like it since the last line)" if held else "",
            )
        msg = protocol.Failure(
            reg.transfer_id, reg.request_id, self.rank, failed.stage, failed.cause, failed.reason, attempt=reg.attempt
        )
        self.server.send(ident, msg)

    def refuse(self, reg: protocol.Register, failed: Failed) -> None:
        """``fail``, to the D rank that registered, if P still knows it."""
        ident = self.peers.ident_of((reg.engine_id, reg.rank))
        if ident is not None:
            self.fail(ident, reg, failed)

    def ack(self, reg: protocol.Register, state: PrefillState, tokens_ahead: int) -> None:
        """Tell the D rank that registered where P's scheduler holds the prefill (``protocol.Ack``)."""
        ident = self.peers.ident_of((reg.engine_id, reg.rank))
        if ident is not None:
            self.server.send(ident, protocol.Ack(reg.transfer_id, self.rank, state, reg.attempt, tokens_ahead))
