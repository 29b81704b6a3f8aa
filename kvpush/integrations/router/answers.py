"""The error answers the router makes up: vLLM's JSON error body, and 503 when a role has no healthy instance.

Rule: every answer the router makes up (not one passed through from P or D)
is built here, in the shape vLLM's OpenAI server uses for errors
(``{"error": {"message", "type", "code", ...}}``); a 503 for a missing role
names every instance of it with its last error and carries ``Retry-After``.
Reason: the endpoints (``app``) and a request's pairing (``pairing``) answer
alike, so a client reads one error format whatever refused it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvpush.integrations.router.pool import Pool


def error(status: int, message: str, typ: str, **extra: Any) -> web.Response:
    """An error answer: ``status``, and the body ``{"error": {message, type, code, **extra}}``."""
    payload = {"error": {"message": message, "type": typ, "code": status, **extra}}
    return web.json_response(payload, status=status)


def unavailable(prefill: Pool, decode: Pool, health_interval: float) -> web.Response | None:
    """HTTP 503 naming each role without a healthy instance (and why each of its instances is out); ``None``
    when both roles have one. ``Retry-After`` is the health check's period: no sooner can one come back."""
    pools = (("prefill", prefill), ("decode", decode))
    missing = [(role, pool) for role, pool in pools if not pool.any_healthy()]
    if not missing:
        return None
    parts = []
    for role, pool in missing:
        errs = "; ".join(f"{i.url}: {i.last_error or 'unhealthy'}" for i in pool.instances)
        parts.append(f"no healthy {role} instance ({errs})")
    resp = error(503, "; ".join(parts), "service_unavailable", retryable=True)
    resp.headers["Retry-After"] = str(max(1, round(health_interval)))
    return resp
