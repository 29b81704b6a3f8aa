"""What P's rendezvous decides: the typed actions it returns and the transfer states it reports.

The rendezvous is sans-I/O, so each decision is a plain frozen record that the
Sender shell carries out; keeping them apart lets the shell and tests name an
action without importing the pairing rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.core.outcome import Cause, Failed, PrefillState, Stage
from kvpush.core.protocol import Register
from kvpush.prefill.transfer import Transfer


class TransferState(enum.StrEnum):
    """Where a transfer stands on P (``Rendezvous.stage``); one P no longer knows has none."""

    WAITING_FOR_PREFILL = "waiting_for_prefill"
    WAITING_FOR_REGISTRATION = "waiting_for_registration"
    TRANSFERRING = "transferring"


@dataclass(frozen=True)
class Prefill:
    """P's finished prefill: its blocks (per group) and how many tokens they hold."""

    transfer_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


@dataclass(frozen=True)
class Push:
    """Write ``prefill``'s KV into the blocks of ``reg`` now."""

    prefill: Prefill
    reg: Register


@dataclass(frozen=True)
class Release:
    """P may free the prefill's blocks: every expected push finished, or none will come.

    ``cause`` is None for "pushed" (then the pushes' own outcome, in
    ``record.failed``, decides success) and says why otherwise; ``record`` is
    the transfer's record as it stood (stats and times for the Result).
    Equality is on what happened: the prefill and the reason.
    """

    prefill: Prefill
    reason: str
    cause: Cause | None = field(default=None, compare=False)
    record: Transfer | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Refuse:
    """Tell D's rank that this registration will not be written."""

    reg: Register
    reason: str
    cause: Cause = field(default=Cause.OTHER, compare=False)

    @property
    def failed(self) -> Failed:
        return Failed(Stage.RENDEZVOUS, self.cause, self.reason)


@dataclass(frozen=True)
class Hold:
    """A new attempt of a registration waits for the WRITE into the previous attempt's blocks to end."""

    reg: Register


@dataclass(frozen=True)
class Acknowledge:
    """Tell D's rank where this registration's prefill stands (``protocol.Ack``)."""

    reg: Register
    state: PrefillState
    tokens_ahead: int = 0


Decision = Push | Release | Refuse | Hold | Acknowledge
