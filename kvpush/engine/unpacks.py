"""D's staged writes, the I/O half: staging grants, and the backend unpacks of the parts P wrote into them.

When D's fragmentation wants P to stage, D grants the writer a slot of its
staging region with the registration; P writes each part into it and D
scatters it into the KV blocks (an *unpack*). The rules (when a part is
unpacked, when a writer's unpacks are waited for, when the slot goes back)
are D's fencing's (``kvpush.decode.fencing``); ``UnpackRunner`` carries out
its ``StartUnpack``, ``AwaitUnpacks`` and ``WaitUnpacks`` actions on the
backend and feeds the answers back to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kvpush.backends.base import Backend, StagingBuffer
from kvpush.backends.copy import Copier
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.layout import KVLayout
from kvpush.core.limits import Throttle
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.parts import costs_of
from kvpush.core.plan import staged_bytes
from kvpush.core.rounds import RING_MIN_PART_BYTES
from kvpush.core.staging import SlotAllocator
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import AwaitUnpacks, StartUnpack, WaitUnpacks
from kvpush.decode.incoming import Action, Asked
from kvpush.decode.registration import guess_parts, staging_grant
from kvpush.observability.metrics import Count
from kvpush.transport.auth import LOG_EVERY_S

log = logging.getLogger(__name__)


class UnpackRunner:
    """The unpacks of one D rank.

    ``name``: the engine's, for logs; ``layout``: D's; ``backend``, ``copy``: where and how to unpack;
    ``staging``, ``slots``: D's staging region (None: it has none) and its allocator; ``fencing``: fed the
    answers; ``bump``: count an event.
    """

    def __init__(
        self,
        name: str,
        cfg: Config,
        layout: KVLayout,
        backend: Backend,
        copy: Copier,
        staging: StagingBuffer | None,
        slots: SlotAllocator,
        fencing: Fencing,
        bump: Callable[[Count], None],
    ) -> None:
        self.name, self.cfg, self.layout, self.backend, self.copy = name, cfg, layout, backend, copy
        self.staging, self.slots, self.fencing, self.bump = staging, slots, fencing, bump
        self.region_bases = [r.base for r in layout.regions]
        self._throttle = Throttle(LOG_EVERY_S)

    def grant(self, p_layout: KVLayout, ask: Asked, want: bool, rounds: bool = False) -> protocol.StagingGrant | None:
        """A slot (or a ring, for a P rank that takes ``rounds``) of D's staging region for this writer, when
        D's own fragmentation wants one (``registration.staging_grant``)."""
        size = staged_bytes(p_layout, self.layout, ask.num_tokens, ask.start_token)
        if size <= 0 or self.staging is None or not want:
            return None
        grant = staging_grant(self.cfg, self.slots, size, rounds)
        if grant is None:
            self.bump(Count.STAGING_FULL)
            if not self.slots.holds(size) and not (rounds and self.slots.holds(2 * RING_MIN_PART_BYTES)):
                self._too_small(size)
            return None
        self.bump(Count.STAGING_GRANTS)
        return grant

    def _too_small(self, size: int) -> None:
        """A push D wants staged is larger than D's whole staging region: it goes direct, paying the transport's
        price per descriptor (what that costs a long prompt: docs/benchmarks-log.md section 11). Counted, and said in
        a warning at most once per interval: it is configuration, not load."""
        self.bump(Count.STAGING_TOO_SMALL)
        held = self._throttle.note("too_small", time.monotonic())
        if held is None:
            return
        more = f" ({held} more since the last line)" if held else ""
        log.warning(
            "%s: a push of %d bytes wants staging (its direct plan has many descriptors) but D's staging region "
            "holds %d bytes (staging_bytes) and its P rank takes no rounds (an older kvpush), so it goes direct%s; "
            "upgrade P, or set staging_bytes above the largest request on both P and D",
            self.name,
            size,
            self.slots.capacity,
            more,
        )

    def prepare(self, pieces: np.ndarray, grant: protocol.StagingGrant) -> None:
        """Hand the backend the unpack list (and the parts P will most likely cut into a slot for the whole
        payload) after the registration left: the first part needs P's pack and a WRITE first, so the upload
        is off the critical path. A ring's parts are cut by the ring (``kvpush.core.rounds``), not guessed."""
        assert self.staging is not None
        parts: list[tuple[int, int, int]] = []
        if not grant.ring:
            costs = costs_of(self.cfg, self.backend.pack_bandwidth(), self.copy.asynchronous)
            parts = guess_parts(self.cfg, len(self.layout.regions), pieces, self.staging.addr + grant.offset, costs)
        try:
            self.copy.prepare_unpack(self.region_bases, pieces, parts=parts)
        except Exception:
            log.exception("%s: prepare_unpack failed (unpack will do it)", self.name)

    def start(self, a: StartUnpack) -> list[Action]:
        assert self.staging is not None
        t0 = time.monotonic()
        staging = self.staging.addr + a.at
        try:
            marker = self.copy.start_unpack(self.region_bases[a.r0 : a.r1], a.unpack, staging)
        except Exception as exc:
            why = Failed(Stage.UNPACK, Cause.OTHER, f"unpack failed: {exc}")
            return self.fencing.writer_failed(a.incoming, a.p_rank, why, time.monotonic())
        t1 = time.monotonic()
        return self.fencing.unpack_started(a, marker, t1 - t0, t1)

    def await_(self, a: AwaitUnpacks) -> list[Action]:
        """Feed the writer's finished unpacks in order (a synchronous backend's are done at once)."""
        if a.block:
            for marker in a.markers:
                try:
                    self.backend.wait_ready(marker)
                except Exception:
                    break  # the poll below reports the failure
        out: list[Action] = []
        for marker in a.markers:
            try:
                done = self.backend.poll_ready(marker)
            except Exception as exc:
                why = Failed(Stage.UNPACK, Cause.OTHER, f"unpack failed: {exc}")
                return out + self.fencing.writer_failed(a.incoming, a.p_rank, why, time.monotonic())
            if not done:
                break
            out += self.fencing.unpacked(a.incoming, a.p_rank, marker, time.monotonic())
        return out

    def wait(self, a: WaitUnpacks) -> None:
        """A writer ended while these unpacks still write into its blocks: wait for them."""
        for marker in a.markers:
            try:
                self.backend.wait_ready(marker)
            except Exception:
                log.exception("%s: waiting for an unpack failed", self.name)
