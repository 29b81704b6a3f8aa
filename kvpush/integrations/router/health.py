"""Active and passive health of the instances.

Health rule (``--health-timeout``, ``--health-timeout-strikes``): a
``/health`` check that gets an answer other than 200, or cannot reach the
instance at all (connection refused or reset), marks it unhealthy at once:
that is a definite answer. A check that merely *times out* is only a strike:
an instance busy with prefills or decodes can be slow to answer its health
endpoint while still serving, and taking the only D out of rotation turns
a slow request into an HTTP 503 (docs/benchmarks-log.md, "Caveats, all
together": router health checks). Only ``health_timeout_strikes`` timeouts in a
row (default 3) mark it unhealthy; any answered check resets the count. A
hung instance is thus taken out after about ``strikes * (interval +
timeout)`` seconds (30 s with the defaults); meanwhile its growing in-flight
count already steers least-loaded selection away from it. A connection
error while proxying takes an instance out at once (``mark_down``); the
periodic check brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from kvpush.integrations.router.config import RouterConfig
from kvpush.integrations.router.pool import Instance

log = logging.getLogger("kvpush.router")


class HealthChecker:
    """Periodic ``GET /health`` of every instance under the health rule."""

    def __init__(self, cfg: RouterConfig, session: Callable[[], aiohttp.ClientSession]) -> None:
        self.cfg = cfg
        self._session = session

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session()

    async def check(self, insts: list[Instance]) -> None:
        """One round of ``GET /health`` on every instance, concurrently."""
        await asyncio.gather(*(self._check_one(i) for i in insts))

    async def _check_one(self, inst: Instance) -> None:
        """Check one instance and apply the health rule (the module docstring):
        a wrong answer or an unreachable instance counts at once, a timeout
        only when it is the ``health_timeout_strikes``-th in a row."""
        timed_out = False
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout)
            async with self.session.get(inst.url + "/health", timeout=timeout) as r:
                ok = r.status == 200
                detail = f"/health returned HTTP {r.status}"
        except TimeoutError:
            ok, timed_out = False, True
            inst.health_timeouts += 1
            detail = f"/health: no answer within {self.cfg.health_timeout:g} s ({inst.health_timeouts} in a row)"
        except (aiohttp.ClientError, OSError) as e:
            ok, detail = False, f"/health: {type(e).__name__}: {e}"
        if not timed_out:
            inst.health_timeouts = 0
        elif inst.healthy and inst.health_timeouts < self.cfg.health_timeout_strikes:
            # Slow, not dead (yet): keep it in rotation, but say so.
            log.warning("%s: %s; still counted healthy", inst.name, detail)
            return
        if ok != inst.healthy:
            log.warning("%s is now %s%s", inst.name, "healthy" if ok else "UNHEALTHY", "" if ok else f" ({detail})")
        inst.healthy = ok
        if not ok:
            inst.last_error = detail

    async def loop(self, insts: list[Instance]) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.check(insts)
            await asyncio.sleep(self.cfg.health_interval)


def mark_down(inst: Instance, detail: str) -> None:
    """Passive health: a connection failure takes the instance out of
    rotation at once; the periodic check brings it back."""
    if inst.healthy:
        log.warning("%s marked UNHEALTHY: %s", inst.name, detail)
    inst.healthy = False
    inst.last_error = detail
