"""The instances a router sends to, and how it picks one (pure: no HTTP).

Selection: the least-loaded healthy instance, ties broken round-robin, so
equal loads rotate rather than always landing on the first. An instance's
load is the larger of this router's requests in flight to it and the
requests the instance itself reports waiting or running (``reported``: its
own queue, which other routers' requests fill too).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class Instance:
    """One vLLM server the router sends to, with its live load and health.

    ``kv_host``/``kv_port`` are P's KV side channel (kvpush: the connector's
    ``side_channel_port``; vllm-push: ``VLLM_NIXL_SIDE_CHANNEL_PORT``); D
    needs them to register with P. Unused for D instances.

    ``dp_rank``: one engine of a data-parallel server, addressed with vLLM's
    ``X-data-parallel-rank`` header (``dp``); ``None`` lets vLLM pick.
    """

    url: str
    role: str  # "prefill" | "decode"
    kv_host: str | None = None
    kv_port: int | None = None
    tp_size: int = 1
    engine_id: str | None = None
    dp_rank: int | None = None
    in_flight: int = 0
    healthy: bool = True
    last_error: str = ""
    served: int = 0
    failures: int = 0
    # /health checks in a row that timed out (see the module's health rule).
    health_timeouts: int = 0
    reported: int = 0  # requests waiting or running, as the instance's own /metrics last said

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    @property
    def name(self) -> str:
        return f"{self.role} {self.url}" + ("" if self.dp_rank is None else f" (DP rank {self.dp_rank})")

    def as_json(self) -> dict[str, Any]:
        """Load and health as ``/health`` and ``/pending`` show them."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "reported": self.reported,
            "served": self.served,
            "failures": self.failures,
            "health_timeouts": self.health_timeouts,
            "last_error": self.last_error,
        }


class Pool:
    """Instances of one role; picks the least-loaded healthy one.

    Ties are broken round-robin over the pool's order: a cursor remembers
    where the last pick was, so equal loads rotate rather than always
    landing on the first instance.
    """

    def __init__(self, instances: Iterable[Instance]) -> None:
        self.instances = list(instances)
        self._cursor = 0

    def pick(self, exclude: Iterable[Instance] = ()) -> Instance | None:
        """The healthy instance (not in ``exclude``) with the fewest in-flight
        requests, or ``None`` when there is none."""
        excluded = {id(i) for i in exclude}
        n = len(self.instances)
        best: Instance | None = None
        best_pos = 0
        for k in range(n):
            pos = (self._cursor + k) % n
            inst = self.instances[pos]
            if not inst.healthy or id(inst) in excluded:
                continue
            if best is None or inst.load < best.load:
                best, best_pos = inst, pos
        if best is not None:
            self._cursor = (best_pos + 1) % n
        return best

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances)
