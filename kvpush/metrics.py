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

``PromFeed`` turns a stream of ``TransferStats`` payloads into Prometheus
updates (observe a histogram, increment a counter, set a gauge) under the
names of ``METRICS``. The vLLM connector feeds vLLM's own Prometheus classes
with it (``kvpush.integrations.vllm.metrics``), the router and the tests use
``TextExposition``, a dependency-free renderer of the same names. Nothing here
imports vLLM, NIXL or prometheus_client.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine imports this module; Result is only read here
    from kvpush.engine.types import Result

SIDES = ("prefill", "decode")

P_STAGES = ("registration_wait", "rendezvous_wait", "plan", "ready_wait", "pack", "post", "completion")
"""P's stages, in order. ``registration_wait``: the finished prefill waited for D's registration (D late);
``rendezvous_wait``: D's registration waited for P's prefill and a free push thread (P late); ``plan``: pieces
mapped and the plan chosen (at pairing); ``ready_wait``: from then until the KV-written marker (device backends;
in layer-wise mode the rest of the forward); ``pack``: gathered into staging; ``post``: WRITEs handed to NIXL;
``completion``: the last WRITE's post to NIXL reporting it done."""

D_STAGES = ("handshake", "transfer", "unpack")
"""D's stages. ``handshake``: registration to the Register leaving (a first request to a P pays the hello);
``transfer``: Register sent to the last P rank's completion notification; ``unpack``: scatter from staging."""

CAUSES = (
    "expired",
    "dead_peer",
    "refused",
    "superseded",
    "aborted",
    "write_error",
    "post_error",
    "bad_registration",
    "side_channel",
    "other",
)
"""Failure causes, a small fixed set so that a label never explodes into one series per message."""

# Ordered: the first pattern found in a failure reason names its cause. Reasons
# come from kvpush.engine (sender/receiver); tests/test_metrics.py holds one real
# reason per cause, so a reworded reason that lands in "other" fails a test.
_CAUSE_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("expired", ("lease expired", "registration expired", "no KV from P within")),
    ("dead_peer", ("declared dead", "is gone", "said hello again", "did not answer the abort")),
    ("refused", ("refused the handshake", "before a successful hello")),
    ("superseded", ("superseded", "replaced by attempt", "re-issued")),
    ("aborted", ("aborted",)),
    ("write_error", ("WRITE", "failed at write")),
    ("post_error", ("post failed", "failed at post")),
    (
        "bad_registration",
        ("failed at register", "bad registration", "block groups", "out of range", "staging grant", "asks for"),
    ),
    ("side_channel", ("side channel",)),
)


def failure_cause(reason: str) -> str:
    """The cause label (one of ``CAUSES``) of a failed transfer's reason text."""
    for cause, needles in _CAUSE_PATTERNS:
        if any(n in reason for n in needles):
            return cause
    return "other"


def _span(times: Mapping[str, float], a: str, b: str) -> float | None:
    """``times[b] - times[a]`` clipped at 0, or None when either is missing."""
    if a in times and b in times:
        return max(0.0, times[b] - times[a])
    return None


def stage_durations(side: str, result: Result) -> dict[str, float]:
    """Seconds per stage of one transfer on one side (stages that did not happen are left out)."""
    st, tt = result.stats, result.times
    out: dict[str, float] = {}
    if side == "prefill":
        if "registered" in tt and "prefill_done" in tt:
            out["registration_wait"] = max(0.0, tt["registered"] - tt["prefill_done"])
            if "push_start" in tt:
                out["rendezvous_wait"] = max(0.0, tt["push_start"] - tt["registered"])
        for stage, key in (
            ("plan", "plan_s"),
            ("ready_wait", "wait_ready_s"),
            ("pack", "pack_s"),
            ("post", "post_s"),
            ("completion", "complete_s"),
        ):
            if key in st:
                out[stage] = float(st[key])
    else:
        for stage, (a, b) in (("handshake", ("registered", "sent")), ("transfer", ("sent", "completed"))):
            v = _span(tt, a, b)
            if v is not None:
                out[stage] = v
        if "unpack_s" in st:
            out["unpack"] = float(st["unpack_s"])
    return out


def transfer_latency(side: str, result: Result) -> float | None:
    """P: first push started to last WRITE done; D: registration to result. None if it never got there."""
    if side == "prefill":
        return _span(result.times, "push_start", "completed")
    if "latency_s" in result.stats:
        return float(result.stats["latency_s"])
    return _span(result.times, "registered", "result")


def plan_of(result: Result) -> str:
    """The transfer plan a Result reports (``direct``, ``staged``, ``empty``), or ``""``."""
    for key in result.stats:
        if key.startswith("plan_") and not key.endswith("_s"):
            return key[5:]
    return ""


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
            nbytes = float(result.stats.get("bytes", 0.0))
            inc("bytes", nbytes)
            obs.setdefault("bytes", []).append(nbytes)
            obs.setdefault("descriptors", []).append(float(result.stats.get("descriptors", 0.0)))
            lat = transfer_latency(side, result)
            if lat is not None:
                obs.setdefault("latency", []).append(lat)
            plan = plan_of(result)
            if plan:
                inc(f"plan:{plan}")
        else:
            inc("transfers_failed")
            inc(f"cause:{failure_cause(result.reason)}")
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

# Engine counter -> stats count name, per side. Counters not listed stay internal.
_P_COUNTERS = {
    "registrations_total": "registrations",
    "aborts_total": "aborts",
    "dead_peers_total": "dead_peers",
    "expired_prefills_total": "expirations",
    "expired_registrations_total": "expirations",
    "parts_total": "parts",
    "layerwise_prefills_total": "layerwise_prefills",
    "layer_reports_total": "layer_reports",
}
_D_COUNTERS = {
    "registrations_total": "registrations",
    "dead_peers_total": "dead_peers",
    "expired_total": "expirations",
    # D turns an expiry into an abort (it tells P to stop): counted once, as an expiration.
    "aborts_total": "aborts",
    "stale_notifications_total": "stale_notifications",
    "rejected_messages_total": "rejected_messages",
    "parts_total": "parts",
}


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
        mapping = _P_COUNTERS if self.side == "prefill" else _D_COUNTERS
        current = {k: float(v) for k, v in counters.items()}
        current["loop_iterations"] = float(loops)
        current["wakeups"] = float(wakeups)
        deltas: dict[str, float] = {}
        for k, v in current.items():
            d = v - self._last_counts.get(k, 0.0)
            if not d:
                continue
            name = mapping.get(k, k if k in ("loop_iterations", "wakeups") else "")
            if name:
                deltas[name] = deltas.get(name, 0.0) + d
        if self.side == "prefill":
            # Also on their own: prefills that held their blocks for a whole lease because no D came.
            leased = current.get("expired_prefills_total", 0.0) - self._last_counts.get("expired_prefills_total", 0.0)
            if leased:
                deltas["prefills_released_at_lease"] = leased
        if self.side == "decode":
            # An expiry also bumped aborts_total on D; do not count it twice.
            exp = current.get("expired_total", 0.0) - self._last_counts.get("expired_total", 0.0)
            if exp:
                deltas["aborts"] = deltas.get("aborts", 0.0) - exp
                if not deltas["aborts"]:
                    del deltas["aborts"]
        out.add_counts(self.side, deltas)
        g: dict[str, float] = {}
        if self.side == "prefill":
            g["pending_registrations"] = float(gauges.get("waiting_registrations", 0.0))
            g["parked_prefills"] = float(gauges.get("parked_prefills", 0.0))
            g["in_flight"] = float(gauges.get("in_flight", 0.0))
        else:
            g["pending_registrations"] = float(gauges.get("pending_registrations", 0.0))
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


# --------------------------------------------------------------------------- #
# Prometheus names and the feed that maps stats onto them.
# --------------------------------------------------------------------------- #

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = tuple(float(4**k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0, 65536.0)


@dataclass(frozen=True)
class MetricSpec:
    """One Prometheus metric kvpush exports: kind, help text, labels beyond vLLM's own, buckets."""

    name: str
    kind: str  # "histogram" | "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ("side",)
    buckets: tuple[float, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "kvpush_transfer_latency_seconds",
        "histogram",
        "Transfer latency of successful transfers: P, first push started to last WRITE done; "
        "D, blocks registered to KV arrived.",
        buckets=LATENCY_BUCKETS,
    ),
    MetricSpec(
        "kvpush_transfer_stage_seconds",
        "histogram",
        "Time per transfer stage: P registration_wait, rendezvous_wait, plan, ready_wait, pack, post, completion; "
        "D handshake, transfer, unpack.",
        ("side", "stage"),
        LATENCY_BUCKETS,
    ),
    MetricSpec("kvpush_transfer_size_bytes", "histogram", "Bytes per successful transfer.", buckets=SIZE_BUCKETS),
    MetricSpec(
        "kvpush_transfer_descriptors",
        "histogram",
        "NIXL descriptors per successful transfer (after coalescing).",
        buckets=DESCRIPTOR_BUCKETS,
    ),
    MetricSpec("kvpush_transfers_total", "counter", "Transfers ended, by outcome (ok, failed).", ("side", "outcome")),
    MetricSpec("kvpush_transfer_bytes_total", "counter", "Bytes moved by successful transfers."),
    MetricSpec(
        "kvpush_transfer_parts_total",
        "counter",
        "WRITEs posted (P) or received (D); a layer-wise or pipelined push is several per transfer.",
    ),
    MetricSpec(
        "kvpush_transfer_plans_total",
        "counter",
        "Successful transfers by the plan chosen (direct, staged, empty).",
        ("side", "plan"),
    ),
    MetricSpec(
        "kvpush_transfer_failures_total",
        "counter",
        "Failed transfers by cause (" + ", ".join(CAUSES) + ").",
        ("side", "cause"),
    ),
    MetricSpec(
        "kvpush_layerwise_prefills_total",
        "counter",
        "P: prefills announced for layer-wise push (their final chunk ran with the layerwise option).",
    ),
    MetricSpec(
        "kvpush_layer_reports_total",
        "counter",
        "P: 'layers written' reports from the forward (one per layer per step when vLLM calls save_kv_layer; "
        "one per step when only the end-of-forward fallback ran).",
    ),
    MetricSpec("kvpush_registrations_total", "counter", "Registrations received (P) or made (D)."),
    MetricSpec(
        "kvpush_expirations_total",
        "counter",
        "Expirations: P, a parked prefill's lease or a registration ran out; D, no KV within transfer_timeout_s.",
    ),
    MetricSpec(
        "kvpush_prefills_released_at_lease_total",
        "counter",
        "P: finished prefills that held their blocks for the whole prefill_lease_s because no D registered "
        "(a router that sent P but never D; a D that cancels tells P at once instead).",
    ),
    MetricSpec("kvpush_aborts_total", "counter", "Transfers aborted by either side (expirations not included)."),
    MetricSpec("kvpush_dead_peers_total", "counter", "Peers declared dead after peer_dead_s of silence."),
    MetricSpec(
        "kvpush_engine_loop_iterations_total",
        "counter",
        "Engine thread loop iterations (idle polling shows as a steady rate).",
    ),
    MetricSpec("kvpush_engine_wakeups_total", "counter", "Engine thread wake-ups by a command from vLLM."),
    MetricSpec(
        "kvpush_engine_loop_iterations_per_second",
        "gauge",
        "Engine loop iterations per second over the last reporting interval (idle: about 1/idle_poll_max_s).",
    ),
    MetricSpec(
        "kvpush_pending_registrations",
        "gauge",
        "P: registrations waiting for their prefill; D: registrations waiting for their KV.",
    ),
    MetricSpec("kvpush_parked_prefills", "gauge", "P: finished prefills holding blocks while waiting for D."),
    MetricSpec("kvpush_transfers_in_flight", "gauge", "P: WRITEs posted and not yet complete."),
    MetricSpec(
        "kvpush_kv_bytes_per_token", "gauge", "KV bytes of one token on this engine (all layers, this rank's heads)."
    ),
    MetricSpec("kvpush_kv_bytes_per_block", "gauge", "KV bytes of one block on this engine (all layers)."),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}

_COUNT_TO_METRIC: dict[str, tuple[str, dict[str, str]]] = {
    "transfers_ok": ("kvpush_transfers_total", {"outcome": "ok"}),
    "transfers_failed": ("kvpush_transfers_total", {"outcome": "failed"}),
    "bytes": ("kvpush_transfer_bytes_total", {}),
    "parts": ("kvpush_transfer_parts_total", {}),
    "layerwise_prefills": ("kvpush_layerwise_prefills_total", {}),
    "layer_reports": ("kvpush_layer_reports_total", {}),
    "registrations": ("kvpush_registrations_total", {}),
    "expirations": ("kvpush_expirations_total", {}),
    "prefills_released_at_lease": ("kvpush_prefills_released_at_lease_total", {}),
    "aborts": ("kvpush_aborts_total", {}),
    "dead_peers": ("kvpush_dead_peers_total", {}),
    "loop_iterations": ("kvpush_engine_loop_iterations_total", {}),
    "wakeups": ("kvpush_engine_wakeups_total", {}),
}
_GAUGE_TO_METRIC = {
    "loop_rate": "kvpush_engine_loop_iterations_per_second",
    "pending_registrations": "kvpush_pending_registrations",
    "parked_prefills": "kvpush_parked_prefills",
    "in_flight": "kvpush_transfers_in_flight",
    "kv_bytes_per_token": "kvpush_kv_bytes_per_token",
    "kv_bytes_per_block": "kvpush_kv_bytes_per_block",
}
_OBS_TO_METRIC = {
    "latency": "kvpush_transfer_latency_seconds",
    "bytes": "kvpush_transfer_size_bytes",
    "descriptors": "kvpush_transfer_descriptors",
}

Update = tuple[str, str, dict[str, str], Any]
"""(kind, metric name, kvpush labels, value): kind "observe" (value: list of floats), "inc" or "set"."""


class PromFeed:
    """Turns ``TransferStats`` payloads into Prometheus updates.

    Gauges are remembered per source and exported as their sum over sources
    (all TP ranks of one engine), so a payload carrying only some ranks does
    not make the gauge jump to a partial sum.
    """

    def __init__(self) -> None:
        self._gauges: dict[str, dict[str, float]] = {}

    def updates(self, data: Mapping[str, Any]) -> list[Update]:
        out: list[Update] = []
        for side, named in (data.get("obs") or {}).items():
            for key, vals in named.items():
                if not vals:
                    continue
                if key.startswith("stage:"):
                    out.append(("observe", "kvpush_transfer_stage_seconds", {"side": side, "stage": key[6:]}, vals))
                elif key in _OBS_TO_METRIC:
                    out.append(("observe", _OBS_TO_METRIC[key], {"side": side}, vals))
        for side, named in (data.get("counts") or {}).items():
            for key, v in named.items():
                if v <= 0:
                    continue
                if key.startswith("plan:"):
                    out.append(("inc", "kvpush_transfer_plans_total", {"side": side, "plan": key[5:]}, v))
                elif key.startswith("cause:"):
                    out.append(("inc", "kvpush_transfer_failures_total", {"side": side, "cause": key[6:]}, v))
                elif key in _COUNT_TO_METRIC:
                    name, labels = _COUNT_TO_METRIC[key]
                    out.append(("inc", name, {"side": side, **labels}, v))
        touched: set[str] = set()
        for source, values in (data.get("gauges") or {}).items():
            self._gauges[source] = dict(values)
            touched.add(source.split(":", 1)[0])
        for side in sorted(touched):
            sums: dict[str, float] = {}
            for source, values in self._gauges.items():
                if source.split(":", 1)[0] != side:
                    continue
                for k, v in values.items():
                    sums[k] = sums.get(k, 0.0) + v
            for k, v in sums.items():
                if k in _GAUGE_TO_METRIC:
                    out.append(("set", _GAUGE_TO_METRIC[k], {"side": side}, v))
        return out


# --------------------------------------------------------------------------- #
# A dependency-free Prometheus text renderer (router, tests, doctor).
# --------------------------------------------------------------------------- #


def _fmt(v: float) -> str:
    v = float(v)
    if v == math.inf:
        return "+Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = [f'{k}="{_escape(v)}"' for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class TextExposition:
    """Counters, gauges and histograms rendered in the Prometheus text format (version 0.0.4).

    Small on purpose: the router has no prometheus_client dependency and its
    metrics live in one process, so a dict per metric is all it needs.
    """

    def __init__(self, specs: Iterable[MetricSpec] = METRICS) -> None:
        self.specs = {s.name: s for s in specs}
        self._values: dict[str, dict[tuple[tuple[str, str], ...], Any]] = {n: {} for n in self.specs}

    def _key(self, name: str, labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        spec = self.specs[name]
        extra = set(labels) - set(spec.labels)
        if extra:
            raise ValueError(f"{name}: unknown labels {sorted(extra)} (declared: {spec.labels})")
        return tuple((k, str(labels[k])) for k in spec.labels if k in labels)

    def inc(self, name: str, by: float = 1.0, **labels: str) -> None:
        key = self._key(name, labels)
        self._values[name][key] = self._values[name].get(key, 0.0) + by

    def set(self, name: str, value: float, **labels: str) -> None:
        self._values[name][self._key(name, labels)] = float(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        spec = self.specs[name]
        key = self._key(name, labels)
        h = self._values[name].get(key)
        if h is None:
            h = self._values[name][key] = [[0] * (len(spec.buckets) + 1), 0.0]
        h[0][bisect.bisect_left(spec.buckets, value)] += 1
        h[1] += value

    def apply(self, updates: Iterable[Update]) -> None:
        for kind, name, labels, value in updates:
            if kind == "observe":
                for v in value:
                    self.observe(name, float(v), **labels)
            elif kind == "inc":
                self.inc(name, float(value), **labels)
            else:
                self.set(name, float(value), **labels)

    def render(self) -> str:
        lines: list[str] = []
        for name, spec in self.specs.items():
            values = self._values[name]
            lines.append(f"# HELP {name} {spec.help}")
            lines.append(f"# TYPE {name} {spec.kind}")
            for key, v in sorted(values.items()):
                if spec.kind != "histogram":
                    lines.append(f"{name}{_labels(key)} {_fmt(v)}")
                    continue
                counts, total = v
                acc = 0
                for le, c in zip([*spec.buckets, math.inf], counts, strict=True):
                    acc += c
                    lines.append(f"{name}_bucket{_labels([*key, ('le', _fmt(le))])} {acc}")
                lines.append(f"{name}_sum{_labels(key)} {_fmt(total)}")
                lines.append(f"{name}_count{_labels(key)} {acc}")
        return "\n".join(lines) + "\n"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text page as (name, labels, value); comments skipped."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (e.g. over vLLM's engine labels)."""
    return sum(
        v for n, lab, v in parse_samples(text) if n == name and all(lab.get(k) == val for k, val in labels.items())
    )
