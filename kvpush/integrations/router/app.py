"""The router's HTTP application: its endpoints, its lifecycle, and the state they show.

A client talks to the router as if it were one vLLM server. The completion
endpoints (``/v1/completions``, ``/v1/chat/completions``) hand each request
to ``pairing.Proxy`` (one P/D pairing per request, D's answer passed through
unchanged; the failure policy is in its docstring). The rest are answered
here: ``/health`` (200 while each role has a healthy instance, else 503),
``/v1/models`` (from the first instance that answers), ``/metrics`` and
``/kvpush/pending``. What P and D are sent in each mode is in ``requests``;
health in ``health``.

Rule: this module owns what lives as long as the application (the HTTP
session, the health, queue and selector loops) and only reads the request
state it shows. Reason: a request's pairing is tested and read on its own,
and nothing here decides how a request is served.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.integrations.router.answers import error, unavailable
from kvpush.integrations.router.config import RouterConfig
from kvpush.integrations.router.engine_metrics import PrefillRate, queue_loop
from kvpush.integrations.router.health import HealthChecker, mark_down
from kvpush.integrations.router.metrics import ROUTER_METRICS, fixed_exposition
from kvpush.integrations.router.pairing import Proxy
from kvpush.integrations.router.pool import Instance, Pool
from kvpush.integrations.router.selective import Selector
from kvpush.integrations.router.upstream import Upstreams, forward_headers
from kvpush.observability.prometheus import TextExposition

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


class Router:
    """The aiohttp application plus its shared state (pools, the proxy and its counters)."""

    def __init__(self, config: RouterConfig) -> None:
        self.cfg = config
        self.prefill = Pool(config.prefill)
        self.decode = Pool(config.decode)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.prom = TextExposition(ROUTER_METRICS)  # latency, failures by cause, aborts
        self.health = HealthChecker(config, lambda: self.session)
        self._scrape_task: asyncio.Task[None] | None = None
        self._queue_task: asyncio.Task[None] | None = None
        self.up = Upstreams(config, lambda: self.session, self.prom)
        self.proxy = Proxy(
            config, (self.prefill, self.decode), self.up, self.health, self.prom, lambda: self._session is not None
        )

    @property
    def counters(self) -> dict[str, int]:
        """Client requests by outcome (``Proxy.counters``)."""
        return self.proxy.counters

    @property
    def selector(self) -> Selector | None:
        """The selective-disaggregation choice (``None`` unless ``selective``), the proxy's."""
        return self.proxy.selector

    @selector.setter
    def selector(self, selector: Selector | None) -> None:
        self.proxy.selector = selector

    # -- lifecycle --------------------------------------------------------- #

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(COMPLETIONS, self._completions)
        app.router.add_post(CHAT, self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kvpush/pending", self._pending)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=self.cfg.upstream_keepalive),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout),
        )
        if self.cfg.health_interval > 0:
            self._health_task = asyncio.create_task(self.health.loop(self._instances()))
        if self.cfg.queue_interval > 0:
            self._queue_task = asyncio.create_task(
                queue_loop(self.prefill.instances, lambda: self.session, self.cfg.queue_interval)
            )
        if self.selector is not None:
            rate = PrefillRate(self.selector, lambda: self.session)
            self._scrape_task = asyncio.create_task(rate.loop(self.prefill.instances))

    async def _on_cleanup(self, _app: web.Application) -> None:
        for task in (self._scrape_task, self._queue_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "router app not started"
        return self._session

    def _instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    async def check_health(self) -> None:
        """One round of ``GET /health`` on every instance (the rule is in ``health``)."""
        await self.health.check(self._instances())

    # -- small endpoints --------------------------------------------------- #

    def _unavailable(self) -> web.Response | None:
        return unavailable(self.prefill, self.decode, self.cfg.health_interval)

    async def _health(self, _req: web.Request) -> web.Response:
        bad = self._unavailable()
        if bad is not None:
            return bad
        return web.json_response({"status": "ok", **self._instances_json()})

    def _instances_json(self) -> dict[str, Any]:
        return {
            "mode": self.cfg.mode,
            "prefill": [i.as_json() for i in self.prefill.instances],
            "decode": [i.as_json() for i in self.decode.instances],
        }

    async def _pending(self, _req: web.Request) -> web.Response:
        extra = {"selective": self.selector.state()} if self.selector is not None else {}
        proxy = self.proxy
        if proxy.turns is not None:
            extra["multi_turn"] = proxy.turns.state()
        return web.json_response(
            {"pending": proxy.pending, "pending_prefill": proxy.prefills.pending, **self._instances_json(), **extra}
        )

    async def _models(self, req: web.Request) -> web.StreamResponse:
        for pool in (self.decode, self.prefill):
            inst = pool.pick()
            if inst is None:
                continue
            try:
                async with self.session.get(
                    inst.url + "/v1/models",
                    headers=forward_headers(req, None),
                    timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout + self.cfg.connect_timeout),
                ) as r:
                    data = await r.read()
                    return web.Response(body=data, status=r.status, content_type="application/json")
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                mark_down(inst, f"/v1/models: {type(e).__name__}: {e}")
        return self._unavailable() or error(503, "no instance answered /v1/models", "service_unavailable")

    async def _metrics(self, _req: web.Request) -> web.Response:
        insts = self.prefill.instances + self.decode.instances
        proxy = self.proxy
        text = fixed_exposition(proxy.pending, proxy.prefills.pending, self.counters, insts) + self.prom.render()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- the completion endpoints: one pairing per request (``pairing``) --- #

    async def _completions(self, req: web.Request) -> web.StreamResponse:
        return await self.proxy.serve(req, COMPLETIONS)

    async def _chat(self, req: web.Request) -> web.StreamResponse:
        return await self.proxy.serve(req, CHAT)
