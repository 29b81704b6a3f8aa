"""Prometheus names for kvpush's metrics, declared once, and the two ways they are exported.

``METRICS`` is the one table: each metric's kind, help, labels, buckets, the
``TransferStats`` keys that feed it, and the names it is exported under.
Names follow vLLM's scheme, ``vllm:kvpush_<name>``, so vLLM's dashboards find
them next to vLLM's own; the bare ``kvpush_<name>`` is exported too, as an
alias kept for one release, for dashboards built on it.

``PromFeed`` turns a stream of ``TransferStats`` payloads into updates
(observe a histogram, increment a counter, set a gauge). The vLLM connector
feeds vLLM's own Prometheus classes with them
(``kvpush.integrations.vllm.metrics``); the router and the tests use
``TextExposition``, a dependency-free renderer of the same names. Nothing
here imports vLLM or prometheus_client.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.observability.metrics import CAUSES

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = tuple(float(4**k * 1024) for k in range(12))  # 1 KiB .. 4 GiB
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0, 65536.0)
VLLM_PREFIX = "vllm:"
"""vLLM's metric namespace: kvpush's metrics are exported as ``vllm:<name>`` (and ``<name>``, the alias)."""


@dataclass(frozen=True)
class Feed:
    """Where a metric's values come from in a ``TransferStats`` payload.

    ``section``: ``obs``, ``counts`` or ``gauges``; ``key``: the stats key,
    or a prefix ending in ``:`` whose rest is the value of label ``label``;
    ``labels``: fixed labels this key adds (``outcome="ok"``).
    """

    section: str
    key: str
    label: str = ""
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MetricSpec:
    """One Prometheus metric: kind, help text, labels beyond vLLM's own, buckets, what feeds it, its names.

    ``name`` identifies it (updates and tests use it); ``export`` lists the
    names it is exported under (default: ``name`` alone).
    """

    name: str
    kind: str  # "histogram" | "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ("side",)
    buckets: tuple[float, ...] = ()
    feeds: tuple[Feed, ...] = ()
    export: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.export or (self.name,)


def _kv(name: str, kind: str, help: str, *feeds: Feed, **kw: Any) -> MetricSpec:
    """An engine metric: exported as ``vllm:<name>`` and, for one release, as ``<name>``."""
    return MetricSpec(name, kind, help, feeds=feeds, export=(VLLM_PREFIX + name, name), **kw)


def _obs(key: str, label: str = "") -> Feed:
    return Feed("obs", key, label)


def _count(key: str, label: str = "", **labels: str) -> Feed:
    return Feed("counts", key, label, tuple(labels.items()))


def _gauge(key: str) -> Feed:
    return Feed("gauges", key)


METRICS: tuple[MetricSpec, ...] = (
    _kv(
        "kvpush_transfer_latency_seconds",
        "histogram",
        "Transfer latency of successful transfers: P, first push started to last WRITE done; "
        "D, blocks registered to KV arrived.",
        _obs("latency"),
        buckets=LATENCY_BUCKETS,
    ),
    _kv(
        "kvpush_transfer_stage_seconds",
        "histogram",
        "Time per transfer stage: P registration_wait, rendezvous_wait, plan, ready_wait, pack, post, completion; "
        "D handshake, transfer, unpack.",
        _obs("stage:", "stage"),
        labels=("side", "stage"),
        buckets=LATENCY_BUCKETS,
    ),
    _kv(
        "kvpush_transfer_size_bytes", "histogram", "Bytes per successful transfer.", _obs("bytes"), buckets=SIZE_BUCKETS
    ),
    _kv(
        "kvpush_transfer_descriptors",
        "histogram",
        "NIXL descriptors per successful transfer (after coalescing).",
        _obs("descriptors"),
        buckets=DESCRIPTOR_BUCKETS,
    ),
    _kv(
        "kvpush_transfers_total",
        "counter",
        "Transfers ended, by outcome (ok, failed).",
        _count("transfers_ok", outcome="ok"),
        _count("transfers_failed", outcome="failed"),
        labels=("side", "outcome"),
    ),
    _kv("kvpush_transfer_bytes_total", "counter", "Bytes moved by successful transfers.", _count("bytes")),
    _kv(
        "kvpush_transfer_parts_total",
        "counter",
        "WRITEs posted (P) or received (D); a layer-wise or pipelined push is several per transfer.",
        _count("parts"),
    ),
    _kv(
        "kvpush_transfer_plans_total",
        "counter",
        "Successful transfers by the plan chosen (direct, staged, empty).",
        _count("plan:", "plan"),
        labels=("side", "plan"),
    ),
    _kv(
        "kvpush_transfer_failures_total",
        "counter",
        "Failed transfers by cause (" + ", ".join(CAUSES) + ").",
        _count("cause:", "cause"),
        labels=("side", "cause"),
    ),
    _kv(
        "kvpush_layerwise_prefills_total",
        "counter",
        "P: prefills announced for layer-wise push (their final chunk ran with the layerwise option).",
        _count("layerwise_prefills"),
    ),
    _kv(
        "kvpush_layer_reports_total",
        "counter",
        "P: 'layers written' reports from the forward (one per layer per step when vLLM calls save_kv_layer; "
        "one per step when only the end-of-forward fallback ran).",
        _count("layer_reports"),
    ),
    _kv(
        "kvpush_registrations_total",
        "counter",
        "Registrations received (P) or made (D).",
        _count("registrations"),
    ),
    _kv(
        "kvpush_expirations_total",
        "counter",
        "Expirations: P, a parked prefill's lease or a registration ran out; D, no KV within transfer_timeout_s.",
        _count("expirations"),
    ),
    _kv(
        "kvpush_prefills_released_at_lease_total",
        "counter",
        "P: finished prefills that held their blocks for the whole prefill_lease_s because no D registered "
        "(a router that sent P but never D; a D that cancels tells P at once instead).",
        _count("prefills_released_at_lease"),
    ),
    _kv(
        "kvpush_aborts_total",
        "counter",
        "Transfers aborted by either side (expirations not included).",
        _count("aborts"),
    ),
    _kv(
        "kvpush_dead_peers_total", "counter", "Peers declared dead after peer_dead_s of silence.", _count("dead_peers")
    ),
    _kv(
        "kvpush_stalls_total",
        "counter",
        "P: its own stalls (process stopped, thread blocked, no core) longer than half of peer_dead_s, seen "
        "between two looks at its D ranks; their silence is counted from the stall's end.",
        _count("stalls"),
    ),
    _kv(
        "kvpush_staging_too_small_total",
        "counter",
        "D: pushes it wanted staged (many descriptors direct) that are larger than its whole staging region, "
        "so they went direct; staging_bytes is below the largest request.",
        _count("staging_too_small"),
    ),
    _kv(
        "kvpush_engine_loop_iterations_total",
        "counter",
        "Engine thread loop iterations (idle polling shows as a steady rate).",
        _count("loop_iterations"),
    ),
    _kv(
        "kvpush_engine_wakeups_total",
        "counter",
        "Engine thread wake-ups by a command from vLLM.",
        _count("wakeups"),
    ),
    _kv(
        "kvpush_engine_loop_iterations_per_second",
        "gauge",
        "Engine loop iterations per second over the last reporting interval (idle: about 1/idle_poll_max_s).",
        _gauge("loop_rate"),
    ),
    _kv(
        "kvpush_pending_registrations",
        "gauge",
        "P: registrations waiting for their prefill; D: registrations waiting for their KV.",
        _gauge("pending_registrations"),
    ),
    _kv(
        "kvpush_parked_prefills",
        "gauge",
        "P: finished prefills holding blocks while waiting for D.",
        _gauge("parked_prefills"),
    ),
    _kv(
        "kvpush_parked_staging_slots",
        "gauge",
        "P: staging slots held by parked prefills, packed at hand-over before D registered.",
        _gauge("parked_staging_slots"),
    ),
    _kv(
        "kvpush_quarantines_total",
        "counter",
        "D: transfers failed while a writer declared dead may still write their blocks (withheld until fenced).",
        _count("quarantines"),
    ),
    _kv(
        "kvpush_quarantines_overdue_total",
        "counter",
        "D: quarantined writers still unfenced quarantine_s after they were given up on (their blocks stay "
        "withheld: never released on a timer).",
        _count("quarantines_overdue"),
    ),
    _kv(
        "kvpush_quarantined_blocks",
        "gauge",
        "D: blocks withheld from vLLM because a writer declared dead may still write them.",
        _gauge("quarantined_blocks"),
    ),
    _kv("kvpush_transfers_in_flight", "gauge", "P: WRITEs posted and not yet complete.", _gauge("in_flight")),
    _kv(
        "kvpush_kv_bytes_per_token",
        "gauge",
        "KV bytes of one token on this engine (all layers, this rank's heads).",
        _gauge("kv_bytes_per_token"),
    ),
    _kv(
        "kvpush_kv_bytes_per_block",
        "gauge",
        "KV bytes of one block on this engine (all layers).",
        _gauge("kv_bytes_per_block"),
    ),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}

_EXACT = {(f.section, f.key): (m.name, dict(f.labels)) for m in METRICS for f in m.feeds if not f.label}
_PREFIX = {(f.section, f.key): (m.name, f.label) for m in METRICS for f in m.feeds if f.label}

Update = tuple[str, str, dict[str, str], Any]
"""(kind, metric name, kvpush labels, value): kind "observe" (value: list of floats), "inc" or "set"."""


def _target(section: str, key: str) -> tuple[str, dict[str, str]] | None:
    """The metric a stats key feeds and the labels it adds, or None."""
    if (section, key) in _EXACT:
        name, labels = _EXACT[section, key]
        return name, dict(labels)
    head, sep, rest = key.partition(":")
    if sep and (section, head + ":") in _PREFIX:
        name, label = _PREFIX[section, head + ":"]
        return name, {label: rest}
    return None


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
        for section, kind in (("obs", "observe"), ("counts", "inc")):
            for side, named in (data.get(section) or {}).items():
                for key, v in named.items():
                    t = _target(section, key)
                    if t is not None and (v if kind == "observe" else v > 0):
                        out.append((kind, t[0], {"side": side, **t[1]}, v))
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
                t = _target("gauges", k)
                if t is not None:
                    out.append(("set", t[0], {"side": side}, v))
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
        """The page: each metric under each of its exported names (an alias repeats the same samples)."""
        lines: list[str] = []
        for spec_name, spec in self.specs.items():
            for name in spec.names:
                lines += _render(name, spec, self._values[spec_name])
        return "\n".join(lines) + "\n"


def _render(name: str, spec: MetricSpec, values: dict[tuple[tuple[str, str], ...], Any]) -> list[str]:
    lines = [f"# HELP {name} {spec.help}", f"# TYPE {name} {spec.kind}"]
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
    return lines
