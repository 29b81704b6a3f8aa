"""Reading the engines' own Prometheus metrics: what the selective router learns the prefill cost from."""

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


def prefill_totals(text: str) -> tuple[float, float]:
    """(prefill seconds, prompt tokens computed) summed over an engine's ``/metrics`` samples."""
    seconds = tokens = 0.0
    for line in text.splitlines():
        if line.startswith(PREFILL_SECONDS):
            seconds += float(line.rsplit(" ", 1)[1])
        elif line.startswith(COMPUTED_TOKENS + "{") and 'source="local_compute"' in line:
            tokens += float(line.rsplit(" ", 1)[1])
    return seconds, tokens


class PrefillRate:
    """Every ``interval`` s, each P's prefill seconds per computed token since the last read, into the selector."""

    def __init__(self, selector: Selector, session: Callable[[], aiohttp.ClientSession], interval: float = 2.0) -> None:
        self.selector = selector
        self._session = session
        self.interval = interval
        self._last: dict[str, tuple[float, float]] = {}

    async def read(self, insts: list[Instance]) -> None:
        seconds = tokens = 0.0
        for inst in insts:
            try:
                timeout = aiohttp.ClientTimeout(total=5)
                async with self._session().get(inst.url + "/metrics", timeout=timeout) as r:
                    now = prefill_totals(await r.text())
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, IndexError) as e:
                log.debug("selective: %s/metrics: %s", inst.url, e)
                continue
            before = self._last.get(inst.url)
            self._last[inst.url] = now
            if before is not None and now[1] >= before[1]:
                seconds += now[0] - before[0]
                tokens += now[1] - before[1]
        self.selector.observe_prefill(seconds, tokens)

    async def loop(self, insts: list[Instance]) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.read(insts)
            await asyncio.sleep(self.interval)
