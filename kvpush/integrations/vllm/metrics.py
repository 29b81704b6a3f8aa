"""kvpush metrics through vLLM's KV-connector stats hooks.

vLLM collects ``get_kv_connector_stats()`` from every worker each step, adds
them with ``aggregate``, ships the ``to_dict()`` payload to the API server
process, and there hands it to ``build_kv_connector_stats`` (for its periodic
log line) and to the connector's ``build_prom_metrics`` object (for
``/metrics``). These two classes adapt ``kvpush.observability.metrics`` and
``kvpush.observability.prometheus`` to that: all logic stays in the pure modules, here is
only vLLM's class surface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvpush.observability.metrics import TransferStats
from kvpush.observability.prometheus import METRIC_BY_NAME, METRICS, PromFeed


@dataclass
class KVPushConnectorStats(KVConnectorStats):
    """vLLM's stats container over ``TransferStats``'s payload (``data`` stays a plain dict)."""

    def __post_init__(self) -> None:
        self.data = TransferStats(self.data).data  # normalise (and copy) whatever vLLM handed in

    def _stats(self) -> TransferStats:
        return TransferStats.wrap(self.data)

    def reset(self) -> None:
        self.data = TransferStats().data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self._stats().aggregate(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return self._stats().reduce()

    def is_empty(self) -> bool:
        return self._stats().is_empty()


class KVPushPromMetrics(KVConnectorPromMetrics):
    """Registers every metric of ``kvpush.observability.prometheus.METRICS`` with vLLM's Prometheus classes,
    under each of its exported names (``vllm:kvpush_*`` and the ``kvpush_*`` alias).

    vLLM's own labels (model name, engine index) come first; kvpush's (side,
    stage, …) follow. One ``PromFeed`` per engine index keeps gauges per rank.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, list[Any]] = {}
        for spec in METRICS:
            self._metrics[spec.name] = [self._make(spec, name, labelnames) for name in spec.names]
        self._feeds: dict[int, PromFeed] = {}

    def _make(self, spec: Any, name: str, labelnames: list[str]) -> Any:
        kw: dict[str, Any] = {"name": name, "documentation": spec.help, "labelnames": [*labelnames, *spec.labels]}
        if spec.kind == "histogram":
            return self._histogram_cls(buckets=list(spec.buckets), **kw)
        if spec.kind == "counter":
            return self._counter_cls(**kw)
        return self._gauge_cls(multiprocess_mode="mostrecent", **kw)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = list(self.per_engine_labelvalues.get(engine_idx, []))
        feed = self._feeds.setdefault(engine_idx, PromFeed())
        for kind, name, labels, value in feed.updates(transfer_stats_data):
            spec = METRIC_BY_NAME[name]
            for metric in self._metrics[name]:
                child = metric.labels(*base, *(labels[k] for k in spec.labels))
                if kind == "observe":
                    for v in value:
                        child.observe(float(v))
                elif kind == "inc":
                    child.inc(float(value))
                else:
                    child.set(float(value))
