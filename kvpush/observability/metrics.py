"""Transfer metrics: what every P and D rank measured, as mergeable plain data.

Why a plain-data object: vLLM moves connector stats from each worker to the
scheduler and on to the API server process (serialised), adds the stats of
all TP workers of a step together, and adds consecutive steps together until
it logs or exports them. ``TransferStats`` is built for exactly that:

- ``data`` holds only dicts, lists and floats (msgpack/pickle safe);
- ``aggregate`` is associative: per-transfer observations are concatenated,
  counter deltas summed, and gauges are kept *per source* (``"prefill:0"``
  = the P engine of TP rank 0), latest value winning, so merging workers sums
  them while merging steps does not double count them.

``Recorder`` sits on one engine (``Sender``/``Receiver``): the engine thread
feeds it every ``Result``; whoever exports metrics calls ``take`` now and
then and gets the interval's ``TransferStats``: the Results since the last
call, the engine counters' increments and the engine's current gauges.

Engines count events by ``Count`` member and report failures by
``kvpush.core.outcome.Cause``; nothing here reads a reason's text. The Prometheus
names these stats are exported under are ``kvpush.observability.prometheus``'s. Nothing
here imports vLLM, NIXL or prometheus_client.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.core.outcome import Cause, PlanKind, PushStats, PushTimes, ReceiveStats, ReceiveTimes, Result

SIDES = ("prefill", "decode")


class Count(enum.StrEnum):
    """An engine's event counters (``Sender.counters``/``Receiver.counters``, ``stats()``), bumped by member.

    ``COUNT_STAT`` says which of them are exported and under which stats name.
    """

    REGISTRATIONS = "registrations_total"
    ABORTS = "aborts_total"
    DEAD_PEERS = "dead_peers_total"
    STALLS = "stalls_total"  # P: looks at its D ranks after a gap past the stall bar (its own stall)
    EXPIRED_PREFILLS = "expired_prefills_total"  # P: a parked prefill's lease ran out
    EXPIRED_REGISTRATIONS = "expired_registrations_total"  # P: a registration's lease ran out
    EXPIRED = "expired_total"  # D: no KV within transfer_timeout_s
    PARTS = "parts_total"
    LAYERWISE_PREFILLS = "layerwise_prefills_total"
    LAYER_REPORTS = "layer_reports_total"
    STALE_NOTIFICATIONS = "stale_notifications_total"
    REJECTED_MESSAGES = "rejected_messages_total"
    FAILURES_SENT = "failures_total"  # P: Failure messages sent to D
    RELEASED = "released_total"
    DEFERRED_REGISTRATIONS = "deferred_registrations_total"
    PARTS_PREBUILT = "parts_prebuilt_total"
    PACKS_AHEAD = "packs_ahead_total"  # P: pack lists built when a prefill was handed over
    PACKS_AHEAD_USED = "packs_ahead_used_total"  # P: staged plans that took such a list instead of building one
    PACKS_AT_HAND_OVER = "packs_at_hand_over_total"  # P: parked prefills packed into a slot before D registered
    PACKS_AT_HAND_OVER_USED = "packs_at_hand_over_used_total"  # P: pushes that posted such a slot without packing
    PACKS_AT_HAND_OVER_EVICTED = "packs_at_hand_over_evicted_total"  # P: such slots taken back for a registered push
    BYTES = "bytes_total"
    DESCRIPTORS = "descriptors_total"
    PLAN_DIRECT = "plan_direct_total"
    PLAN_STAGED = "plan_staged_total"
    PLAN_EMPTY = "plan_empty_total"
    PLAN_PEER = "plan_peer_total"  # P: pushes its device copied into a same-host D's blocks itself
    PLAN_ROUNDS = "plan_rounds_total"  # P: pushes staged through a ring of D's region, part by part
    STAGING_FULL = "staging_full_total"
    STAGING_TOO_SMALL = "staging_too_small_total"  # D: pushes it wanted staged, larger than its staging region
    STAGING_GRANTS = "staging_grants_total"  # D: registrations sent with a slot of D's staging region
    POSTINGS = "postings_total"
    COMPLETED = "completed_total"
    FAILED = "failed_total"
    CANCELS = "cancels_total"  # D: transfers given up before they were registered
    ABORTS_IGNORED = "aborts_ignored_total"  # P: aborts from a D that did not register the transfer (or of none)
    FOREIGN_MESSAGES = "foreign_messages_total"  # D: completions/failures from a P rank it did not register with
    SEALED_NOTIFICATIONS = "sealed_notifications_total"  # D: NIXL notifications acted on, their seal verified
    UNVERIFIED_NOTIFICATIONS = "unverified_notifications_total"  # D: NIXL notifications not acted on: no valid seal
    ACKS = "acks_total"  # D: P's acknowledgements of a registration (queued, running)
    QUARANTINES = "quarantines_total"  # D: transfers failed with a writer that may still write (blocks withheld)
    QUARANTINES_FENCED = "quarantines_fenced_total"  # D: quarantined writers released by fencing or P's answer
    QUARANTINES_OVERDUE = "quarantines_overdue_total"  # D: quarantined writers still unfenced after quarantine_s

    @classmethod
    def plan(cls, kind: PlanKind) -> Count:
        return cls(f"plan_{kind.value}_total")


COUNT_STAT: dict[Count, tuple[str, ...]] = {
    Count.REGISTRATIONS: ("registrations",),
    Count.ABORTS: ("aborts",),
    Count.DEAD_PEERS: ("dead_peers",),
    Count.STALLS: ("stalls",),
    Count.STAGING_TOO_SMALL: ("staging_too_small",),
    # Also on their own: prefills that held their blocks for a whole lease because no D came.
    Count.EXPIRED_PREFILLS: ("expirations", "prefills_released_at_lease"),
    Count.EXPIRED_REGISTRATIONS: ("expirations",),
    Count.EXPIRED: ("expirations",),
    Count.PARTS: ("parts",),
    Count.LAYERWISE_PREFILLS: ("layerwise_prefills",),
    Count.LAYER_REPORTS: ("layer_reports",),
    Count.STALE_NOTIFICATIONS: ("stale_notifications",),
    Count.REJECTED_MESSAGES: ("rejected_messages",),
    Count.QUARANTINES: ("quarantines",),
    Count.QUARANTINES_OVERDUE: ("quarantines_overdue",),
}
"""Engine counters exported (as increments, under these stats names); the others stay internal."""
_STATS_OF = {c.value: names for c, names in COUNT_STAT.items()} | {
    "loop_iterations": ("loop_iterations",),
    "wakeups": ("wakeups",),
}

P_STAGES = ("registration_wait", "rendezvous_wait", "plan", "ready_wait", "pack", "post", "completion")
"""P's stages, in order. ``registration_wait``: the finished prefill waited for D's registration (D late);
``rendezvous_wait``: D's registration waited for P's prefill and a free push thread (P late); ``plan``: pieces
mapped and the plan chosen (at pairing); ``ready_wait``: from then until the KV-written marker (device backends;
in layer-wise mode the rest of the forward); ``pack``: gathered into staging; ``post``: WRITEs handed to NIXL;
``completion``: the last WRITE's post to NIXL reporting it done."""

D_STAGES = ("handshake", "transfer", "unpack")
"""D's stages. ``handshake``: registration to the Register leaving (a first request to a P pays the hello);
``transfer``: Register sent to the last P rank's completion notification; ``unpack``: scatter from staging."""

CAUSES = tuple(c.value for c in Cause)
"""Failure causes (``kvpush.core.outcome.Cause``), a small fixed set so that a label never explodes into one series."""


def stage_durations(side: str, result: Result) -> dict[str, float]:
    """Seconds per stage of one transfer on one side (stages that did not happen are left out)."""
    out: dict[str, float] = {}
    st, tt = result.stats, result.times
    if isinstance(st, PushStats) and isinstance(tt, PushTimes):
        if tt.registered is not None and tt.prefill_done is not None:
            out["registration_wait"] = max(0.0, tt.registered - tt.prefill_done)
            if tt.push_start is not None:
                out["rendezvous_wait"] = max(0.0, tt.push_start - tt.registered)
        for stage, v in (
            ("plan", st.plan_s),
            ("ready_wait", st.wait_ready_s),
            ("pack", st.pack_s),
            ("post", st.post_s),
            ("completion", st.complete_s),
        ):
            if v is not None:
                out[stage] = float(v)
    elif isinstance(st, ReceiveStats) and isinstance(tt, ReceiveTimes):
        for stage, a, b in (("handshake", tt.registered, tt.sent), ("transfer", tt.sent, tt.completed)):
            if a is not None and b is not None:
                out[stage] = max(0.0, b - a)
        if st.unpack_s is not None:
            out["unpack"] = float(st.unpack_s)
    return out


def transfer_latency(side: str, result: Result) -> float | None:
    """P: first push started to last WRITE done; D: registration to result. None if it never got there."""
    tt = result.times
    if isinstance(tt, PushTimes):
        a, b = tt.push_start, tt.completed
    else:
        if isinstance(result.stats, ReceiveStats) and result.stats.latency_s is not None:
            return float(result.stats.latency_s)
        a, b = tt.registered, tt.result
    return max(0.0, b - a) if a is not None and b is not None else None


def plan_of(result: Result) -> str:
    """The transfer plan a Result reports (``direct``, ``staged``, ``empty``), or ``""``."""
    return result.stats.plan.value if result.stats.plan is not None else ""


# --------------------------------------------------------------------------- #
# The mergeable stats object.
# --------------------------------------------------------------------------- #


def _empty_data() -> dict[str, Any]:
    return {"obs": {}, "counts": {}, "gauges": {}}


class TransferStats:
    """One interval's measurements from one or more engines; see the module docstring.

    ``data["obs"][side][name]``: per-transfer values (``latency``, ``bytes``,
    ``descriptors``, ``stage:<stage>``); ``data["counts"][side][name]``:
    increments (``transfers_ok``, ``transfers_failed``, ``bytes``,
    ``plan:<plan>``, ``cause:<cause>``, ``aborts``, ``expirations``,
    ``dead_peers``, ``registrations``, ``loop_iterations``, ``wakeups``);
    ``data["gauges"]["<side>:<rank>"][name]``: current values.
    """

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = _empty_data()
        if data:
            self.aggregate_data(data)

    @classmethod
    def wrap(cls, data: dict[str, Any]) -> TransferStats:
        """A view that reads and updates ``data`` in place (no copy); missing sections are added."""
        out = cls.__new__(cls)
        for k, v in _empty_data().items():
            data.setdefault(k, v)
        out.data = data
        return out

    # -- recording ---------------------------------------------------------
    def add_result(self, side: str, result: Result) -> None:
        """Account one ended transfer."""
        obs = self.data["obs"].setdefault(side, {})
        cnt = self.data["counts"].setdefault(side, {})

        def inc(name: str, by: float = 1.0) -> None:
            cnt[name] = cnt.get(name, 0.0) + by

        if result.ok:
            inc("transfers_ok")
            nbytes = float(result.stats.bytes)
            inc("bytes", nbytes)
            obs.setdefault("bytes", []).append(nbytes)
            obs.setdefault("descriptors", []).append(float(result.stats.descriptors))
            lat = transfer_latency(side, result)
            if lat is not None:
                obs.setdefault("latency", []).append(lat)
            plan = plan_of(result)
            if plan:
                inc(f"plan:{plan}")
        else:
            inc("transfers_failed")
            inc(f"cause:{(result.cause or Cause.OTHER).value}")
        for stage, secs in stage_durations(side, result).items():
            obs.setdefault(f"stage:{stage}", []).append(secs)

    def add_counts(self, side: str, deltas: Mapping[str, float]) -> None:
        cnt = self.data["counts"].setdefault(side, {})
        for k, v in deltas.items():
            if v:
                cnt[k] = cnt.get(k, 0.0) + float(v)

    def set_gauges(self, source: str, values: Mapping[str, float]) -> None:
        self.data["gauges"][source] = {k: float(v) for k, v in values.items()}

    # -- vLLM's KVConnectorStats surface -------------------------------------
    def aggregate_data(self, other: Mapping[str, Any]) -> None:
        for side, named in (other.get("obs") or {}).items():
            mine = self.data["obs"].setdefault(side, {})
            for k, vals in named.items():
                mine.setdefault(k, []).extend(float(v) for v in vals)
        for side, named in (other.get("counts") or {}).items():
            self.add_counts(side, named)
        for source, values in (other.get("gauges") or {}).items():
            self.set_gauges(source, values)

    def aggregate(self, other: Any) -> TransferStats:
        """Add ``other`` (a TransferStats or its ``data``) into this one; returns self."""
        self.aggregate_data(other.data if hasattr(other, "data") else other)
        return self

    def reset(self) -> None:
        self.data = _empty_data()

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def is_empty(self) -> bool:
        """True when nothing *happened*: no transfer ended and no event counter moved.

        Gauges and the engine's loop counters always change; they alone do not
        make an interval worth a log line.
        """
        if any(any(v for v in named.values()) for named in self.data["obs"].values()):
            return False
        quiet = {"loop_iterations", "wakeups"}
        return not any(v for named in self.data["counts"].values() for k, v in named.items() if k not in quiet)

    def reduce(self) -> dict[str, int | float]:
        """A short summary for vLLM's periodic log line (per side: count, latency, MB, plans, failures)."""
        out: dict[str, int | float] = {}
        for side in SIDES:
            cnt = self.data["counts"].get(side, {})
            obs = self.data["obs"].get(side, {})
            ok, failed = int(cnt.get("transfers_ok", 0)), int(cnt.get("transfers_failed", 0))
            if not ok and not failed:
                continue
            tag = "P" if side == "prefill" else "D"
            out[f"{tag} transfers ok"] = ok
            out[f"{tag} failed"] = failed
            lat = sorted(obs.get("latency", []))
            if lat:
                out[f"{tag} median latency (ms)"] = round(quantile(lat, 0.5) * 1e3, 3)
                out[f"{tag} p90 latency (ms)"] = round(quantile(lat, 0.9) * 1e3, 3)
            out[f"{tag} MB"] = round(cnt.get("bytes", 0.0) / 2**20, 3)
            for k, v in sorted(cnt.items()):
                if k.startswith(("plan:", "cause:")):
                    out[f"{tag} {k}"] = int(v)
        return out


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values (numpy's default method)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# --------------------------------------------------------------------------- #
# One engine's recorder.
# --------------------------------------------------------------------------- #


class Recorder:
    """Collects one engine's Results (engine thread) and hands out interval stats (any thread).

    Thread-safety: ``observe`` and ``take`` share one lock; ``take`` reads the
    engine's counters with ``dict(...)``, an atomic copy under the GIL.
    """

    def __init__(self, side: str) -> None:
        self.side = side
        self._lock = threading.Lock()
        self._pending = TransferStats()
        self._results = 0
        self._last_counts: dict[str, float] = {}
        self._last_take: float | None = None

    def observe(self, result: Result) -> None:
        with self._lock:
            self._pending.add_result(self.side, result)
            self._results += 1

    @property
    def results_pending(self) -> int:
        """Results observed since the last ``take``."""
        return self._results

    def take(
        self,
        counters: Mapping[str, float],
        loops: int,
        wakeups: int,
        gauges: Mapping[str, float],
        source: str,
        extra_gauges: Mapping[str, float] | None = None,
        now: float | None = None,
    ) -> TransferStats:
        """The interval since the last call: Results, counter increments, gauges, loop rate."""
        now = time.monotonic() if now is None else now
        with self._lock:
            out, self._pending, self._results = self._pending, TransferStats(), 0
        current = {str(k): float(v) for k, v in counters.items()}
        current["loop_iterations"] = float(loops)
        current["wakeups"] = float(wakeups)
        deltas: dict[str, float] = {}
        for k, v in current.items():
            d = v - self._last_counts.get(k, 0.0)
            for name in _STATS_OF.get(k, ()) if d else ():
                deltas[name] = deltas.get(name, 0.0) + d
        out.add_counts(self.side, deltas)
        g: dict[str, float] = {}
        if self.side == "prefill":
            g["pending_registrations"] = float(gauges.get("waiting_registrations", 0.0))
            g["parked_prefills"] = float(gauges.get("parked_prefills", 0.0))
            g["parked_staging_slots"] = float(gauges.get("parked_staging_slots", 0.0))
            g["in_flight"] = float(gauges.get("in_flight", 0.0))
        else:
            g["pending_registrations"] = float(gauges.get("pending_registrations", 0.0))
            g["quarantined_blocks"] = float(gauges.get("quarantined_blocks", 0.0))
        if self._last_take is not None and now > self._last_take:
            g["loop_rate"] = (current["loop_iterations"] - self._last_counts.get("loop_iterations", 0.0)) / (
                now - self._last_take
            )
        g.update(extra_gauges or {})
        out.set_gauges(source, g)
        self._last_counts = current
        self._last_take = now
        return out


def take_engine(engine: Any, rank: int, extra_gauges: Mapping[str, float] | None = None) -> TransferStats:
    """``Recorder.take`` for a ``Sender``/``Receiver`` (reads its counters, loop count and gauges)."""
    rec: Recorder = engine.recorder
    return rec.take(
        dict(engine.counters),
        engine.loops,
        engine.wakeups,
        engine.gauges,
        f"{rec.side}:{rank}",
        extra_gauges,
    )


def layout_gauges(layout: Any) -> dict[str, float]:
    """Bytes one token and one block occupy on this rank, over all its regions (for checking volumes)."""
    n = len(layout.regions)
    return {"kv_bytes_per_token": float(layout.token_bytes * n), "kv_bytes_per_block": float(layout.block_bytes * n)}
