"""P's hand-over: a prefill's pack list built as it is handed over, and the pack of a parked one into a slot.

The sender's engine thread calls ``prepare`` for every prefill handed over
or announced; the rule of which parked prefill gets a staging slot is
``kvpush.prefill.slots.StagingSlots``'. Here is only I/O: build the pack
list, hand it to the backend, start the pack, watch its marker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, StagingBuffer
from kvpush.backends.copy import Copier
from kvpush.config import Config
from kvpush.core.counts import Count
from kvpush.core.layout import KVLayout
from kvpush.core.payload import pack_pieces
from kvpush.engine.ports import Counter
from kvpush.prefill.decisions import Prefill
from kvpush.prefill.prepack import Prepack
from kvpush.prefill.slots import PackParked, StagingSlots
from kvpush.prefill.transfer import PackAhead, Transfer

log = logging.getLogger(__name__)


@dataclass
class HandOver:
    """The I/O half of one P rank's hand-overs, made with the engine's staging region (``Sender.setup``).

    ``staging``: P's staging region; ``slots``: the rule of its slots; ``port``: the engine's counters;
    ``peer_copies_only``: whether every D rank P knows takes peer copies (then no push is staged, and a
    pack list or a pack at hand-over would be work for nothing).
    """

    name: str
    cfg: Config
    layout: KVLayout
    backend: Backend
    copy: Copier
    staging: StagingBuffer | None
    slots: StagingSlots
    port: Counter
    peer_copies_only: Callable[[], bool] = lambda: False

    @property
    def region_bases(self) -> list[int]:
        """Base address of each region, in order (what pack takes)."""
        return [r.base for r in self.layout.regions]

    def prepare(self, prefill: Prefill, rec: Transfer, ready: Any = None, parked: bool = False) -> None:
        """Build a prefill's pack list as it is handed over, and give it to the backend (``prepare_pack``).

        The staged payload needs only P's own block ids, so a registration
        that arrives later (behind a sequential router it always does) finds
        its pack list made: P's planning leaves the path from D's
        registration to the first WRITE. Built for the whole prompt and P's
        own heads; a registration asking for fewer gets its list at pairing.
        A finished prefill ``parked`` (no registration waiting) is also packed
        now where that pays whatever D's blocks are (``_pack_at_hand_over``, when ``slots`` says so).
        """
        rec.pack_ahead = None
        if (
            self.staging is None
            or self.cfg.staging.plan == "direct"
            or self.peer_copies_only()
            or prefill.num_tokens <= 0
            or not prefill.block_ids
        ):
            return
        heads = (self.layout.head_start, self.layout.head_end)
        try:
            blocks = np.asarray(prefill.block_ids[self.layout.token_group], dtype=np.int64)
            pack = pack_pieces(self.layout, heads, blocks, prefill.num_tokens, 0)
        except Exception as exc:  # the registration's planning will say what is wrong
            log.debug("%s: no pack list ahead for %s: %s", self.name, prefill.transfer_id, exc)
            return
        rec.pack_ahead = PackAhead(prefill, heads, prefill.num_tokens, 0, pack, blocks)
        self.port.bump(Count.PACKS_AHEAD)
        try:
            self.copy.prepare_pack(self.region_bases, pack)
        except Exception:
            log.exception("%s: prepare_pack failed (pack will do it)", self.name)
        if parked:
            self._pack_at_hand_over(prefill, rec, rec.pack_ahead, ready)

    def _pack_at_hand_over(self, prefill: Prefill, rec: Transfer, pa: PackAhead, ready: Any) -> None:
        """Pack a finished prefill into a staging slot now, when the slot rule says so (``slots.StagingSlots``).

        Only when the pack can be ordered after the KV: a chaining backend
        queues it behind the ready marker on the device; another packs only
        KV already written (else the push packs at pairing, as without this).
        """
        if self.staging is None:
            return
        if not self.slots.wants_pack(pa.pack, pa.blocks, pa.num_tokens, self.backend.pack_bandwidth()):
            return
        chain = self.backend.capabilities.chained_ready
        if ready is not None and not chain and not self.backend.poll_ready(ready):
            return
        size = int(pa.pack[:, 1].sum()) * len(self.region_bases)
        for a in self.slots.park(prefill.transfer_id, size):
            self._pack_parked(rec, pa, a, ready if chain else None)

    def _pack_parked(self, rec: Transfer, pa: PackAhead, a: PackParked, after: Any) -> None:
        assert self.staging is not None
        t0 = time.monotonic()
        try:
            marker = self.copy.start_pack(self.region_bases, pa.pack, self.staging.addr + a.offset, after=after)
        except Exception:
            log.exception("%s: pack at hand-over of %s failed (the push packs)", self.name, a.transfer_id)
            self.slots.park_failed(a.offset)
            return
        self.slots.parked_packed(a.transfer_id, Prepack(a.offset, a.size, pa.pack, after, marker))
        self.port.bump(Count.PACKS_AT_HAND_OVER)
        rec.times.first("ready", t0)
        if marker is None:
            rec.times.first("packed", time.monotonic())

    def packs_ended(self, record: Callable[[str], Transfer | None]) -> None:
        """Note packs at hand-over that have ended (their stage time); slots set aside behind them are freed."""
        ended = self.slots.poll(self.backend.poll_ready)
        t = time.monotonic()
        for a in ended:
            rec = record(a.transfer_id)
            if rec is not None:
                rec.times.first("packed", t)

    def close(self) -> None:
        """Shutdown: every pack into staging ends before the staging goes, then every parked slot comes back."""
        for marker in self.slots.markers():
            try:
                self.backend.wait_ready(marker)
            except Exception:
                log.exception("%s: waiting for a pack at hand-over failed", self.name)
        self.slots.close()
