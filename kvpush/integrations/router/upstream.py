"""Talking to P and D over HTTP: one call per stage, each failure an ``UpstreamError`` naming the stage."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.integrations.router.config import RouterConfig
from kvpush.integrations.router.dp import dp_headers
from kvpush.integrations.router.health import mark_down
from kvpush.integrations.router.pool import Instance
from kvpush.observability.prometheus import TextExposition


class UpstreamError(Exception):
    """An instance failed; ``status`` is what the client will get."""

    def __init__(self, inst: Instance, stage: str, detail: str, status: int = 502, body: bytes | None = None):
        super().__init__(f"{inst.name} failed during {stage}: {detail}")
        self.inst = inst
        self.stage = stage
        self.detail = detail
        self.status = status
        self.body = body  # an upstream 4xx body, passed through

    @property
    def retryable(self) -> bool:
        return self.status >= 500


def failure_cause(err: UpstreamError) -> str:
    """A small fixed label for an upstream failure (the detail text stays in the log)."""
    d = err.detail
    if err.status < 500:
        return "http_4xx"
    if d.startswith("cannot connect"):
        return "connect"
    if "within" in d or "silent" in d:
        return "timeout"
    if d.startswith("HTTP 5"):
        return "http_5xx"
    if "JSON" in d or "kv_transfer_params" in d or "engine id" in d:
        return "bad_response"
    return "other"


def loop_time() -> float:
    """The running event loop's monotonic clock (what asyncio timeouts use)."""
    return asyncio.get_running_loop().time()


def client_status(status: int) -> int:
    """Upstream 4xx are the client's errors and pass through; anything else
    becomes 502 (the router's upstream failed)."""
    return status if 400 <= status < 500 else 502


def status_detail(status: int, data: bytes) -> str:
    text = data[:500].decode("utf-8", "replace").strip()
    return f"HTTP {status}" + (f": {text}" if text else "")


def forward_headers(req: web.Request, tid: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if auth := req.headers.get("Authorization"):
        headers["Authorization"] = auth
    if tid is not None:
        headers["X-Request-Id"] = tid
    return headers


class Upstreams:
    """The HTTP calls to P and D, with the router's timeouts; P's time to answer is observed."""

    def __init__(self, cfg: RouterConfig, session: Callable[[], aiohttp.ClientSession], prom: TextExposition) -> None:
        self.cfg = cfg
        self._session = session
        self.prom = prom

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session()

    async def run_prefill(
        self, p: Instance, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        t0 = loop_time()
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.prefill_timeout, connect=self.cfg.connect_timeout)
            headers = {**headers, **dp_headers(p)}
            async with self.session.post(p.url + endpoint, json=body, headers=headers, timeout=timeout) as r:
                data = await r.read()
                if r.status != 200:
                    raise UpstreamError(p, "prefill", status_detail(r.status, data), client_status(r.status), data)
                self.prom.observe("kvpush_router_request_seconds", loop_time() - t0, stage="prefill")
                try:
                    return json.loads(data)
                except ValueError:
                    raise UpstreamError(p, "prefill", "response is not JSON") from None
        except TimeoutError:
            raise UpstreamError(p, "prefill", f"no answer within {self.cfg.prefill_timeout:g} s") from None
        except aiohttp.ClientConnectorError as e:
            mark_down(p, str(e))
            raise UpstreamError(p, "prefill", f"cannot connect: {e}") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(p, "prefill", f"{type(e).__name__}: {e}") from None

    async def open_decode(
        self, d: Instance, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout, sock_read=self.cfg.decode_timeout)
        try:
            headers = {**headers, **dp_headers(d)}
            r = await self.session.post(d.url + endpoint, json=body, headers=headers, timeout=timeout)
        except TimeoutError:
            raise UpstreamError(d, "decode", f"no answer within {self.cfg.decode_timeout:g} s") from None
        except aiohttp.ClientConnectorError as e:
            mark_down(d, str(e))
            raise UpstreamError(d, "decode", f"cannot connect: {e}") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(d, "decode", f"{type(e).__name__}: {e}") from None
        if r.status != 200:
            try:
                data = await r.read()
            except (TimeoutError, aiohttp.ClientError):
                data = b""
            finally:
                r.release()
            raise UpstreamError(d, "decode", status_detail(r.status, data), client_status(r.status), data)
        return r

    async def read_decode(self, d: Instance, r: aiohttp.ClientResponse) -> bytes:
        try:
            return await r.read()
        except TimeoutError:
            raise UpstreamError(d, "decode", f"silent for {self.cfg.decode_timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(d, "decode", f"{type(e).__name__}: {e}") from None

    async def read_chunk(self, d: Instance, r: aiohttp.ClientResponse) -> bytes:
        """Next piece of D's stream as it arrived (b"" at the end)."""
        try:
            return await r.content.readany()
        except TimeoutError:
            raise UpstreamError(d, "decode", f"stream silent for {self.cfg.decode_timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(d, "decode", f"{type(e).__name__}: {e}") from None
