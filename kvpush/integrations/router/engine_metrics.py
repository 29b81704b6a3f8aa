"""Reading the engines' own Prometheus metrics: what the selective router learns the prefill and push costs from.

vLLM's ``request_prefill_time_seconds`` and ``prompt_tokens_by_source_total``
give the prefill cost; kvpush's transfer stats on P (push latency, bytes
moved, KV bytes per token) the push's cost per token. kvpush's names are
matched with or without vLLM's ``vllm:`` prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from kvpush.integrations.router.pool import Instance
from kvpush.integrations.router.selective import Selector

log = logging.getLogger("kvpush.router")

PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
COMPUTED_TOKENS = "vllm:prompt_tokens_by_source_total"


PUSH_SECONDS = "kvpush_transfer_latency_seconds_sum"
PUSH_BYTES = "kvpush_transfer_bytes_total"
BYTES_PER_TOKEN = "kvpush_kv_bytes_per_token"


def _value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def push_totals(text: str) -> tuple[float, float, float]:
    """(push seconds, bytes pushed, KV bytes per token) from P's ``/metrics`` (kvpush's transfer stats)."""
    seconds = nbytes = per_token = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("vllm:")
        if name == PUSH_SECONDS:
            seconds += _value(line)
        elif name == PUSH_BYTES:
            nbytes += _value(line)
        elif name == BYTES_PER_TOKEN:
            per_token = max(per_token, _value(line))
    return seconds, nbytes, per_token


def prefill_totals(text: str) -> tuple[float, float]:
    """(prefill seconds, prompt tokens computed) summed over an engine's ``/metrics`` samples."""
    seconds = tokens = 0.0
    for line in text.splitlines():
        if line.startswith(PREFILL_SECONDS):
            seconds += float(line.rsplit(" ", 1)[1])
        elif line.startswith(COMPUTED_TOKENS + "{") and 'source="local_compute"' in line:
            tokens += float(line.rsplit(" ", 1)[1])
    return seconds, tokens


WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"


def queue_depth(text: str, engine: int | None = None) -> int:
    """Requests a server reports waiting or running (vLLM's gauges, summed over its engines); ``engine``: only
    that data-parallel engine's (vLLM labels each engine's gauges ``engine="<DP rank>"``)."""
    total = 0.0
    label = None if engine is None else f'engine="{engine}"'
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (WAITING, RUNNING) and (label is None or label in line.split("}", 1)[0]):
            total += _value(line)
    return int(total)


async def queue_loop(insts: list[Instance], session: Callable[[], aiohttp.ClientSession], interval: float) -> None:
    """Every ``interval`` s, each P's own queue depth into ``Instance.reported`` (the router's load measure)."""
    while True:
        await read_queues(insts, session)
        await asyncio.sleep(interval)


async def read_queues(insts: list[Instance], session: Callable[[], aiohttp.ClientSession]) -> None:
    """One read of every P server's ``/metrics`` (once per server: its DP ranks share it), each instance
    getting its own engine's depth."""
    by_url: dict[str, list[Instance]] = {}
    for inst in insts:
        by_url.setdefault(inst.url, []).append(inst)
    for url, ranks in by_url.items():
        try:
            async with session().get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = await r.text()
            for inst in ranks:
                inst.reported = queue_depth(text, inst.dp_rank)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, IndexError) as e:
            log.debug("queue depth: %s/metrics: %s", url, e)


class PrefillRate:
    """Every ``interval`` s, each P's prefill seconds per computed token since the last read, into the selector."""

    def __init__(self, selector: Selector, session: Callable[[], aiohttp.ClientSession], interval: float = 2.0) -> None:
        self.selector = selector
        self._session = session
        self.interval = interval
        self._last: dict[str, tuple[float, float, float, float]] = {}

    async def read(self, insts: list[Instance]) -> None:
        """One scrape of every P server (a data-parallel one once for all its DP ranks, whose metrics its one
        API server reports); the deltas since the previous one go to the selector."""
        seconds = tokens = push_s = push_bytes = per_token = 0.0
        for inst in {i.url: i for i in insts}.values():
            try:
                timeout = aiohttp.ClientTimeout(total=5)
                async with self._session().get(inst.url + "/metrics", timeout=timeout) as r:
                    text = await r.text()
                now = (*prefill_totals(text), *push_totals(text)[:2])
                per_token = max(per_token, push_totals(text)[2])
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, IndexError) as e:
                log.debug("selective: %s/metrics: %s", inst.url, e)
                continue
            before = self._last.get(inst.url)
            self._last[inst.url] = now
            if before is not None and all(a >= b for a, b in zip(now, before, strict=True)):
                seconds, tokens = seconds + now[0] - before[0], tokens + now[1] - before[1]
                push_s, push_bytes = push_s + now[2] - before[2], push_bytes + now[3] - before[3]
        self.selector.observe_prefill(seconds, tokens)
        self.selector.observe_push(push_s, push_bytes, per_token)

    async def loop(self, insts: list[Instance]) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.read(insts)
            await asyncio.sleep(self.interval)
