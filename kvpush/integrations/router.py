"""OpenAI-compatible router for prefill/decode disaggregated vLLM.

A client talks to the router as if it were one vLLM server. For every
completion request the router picks a prefill instance (P) and a decode
instance (D), gives the pair one transfer id, and returns D's answer (or
stream) to the client unchanged, byte for byte.

Modes (``--mode``), i.e. which KV connector the vLLM instances run:

``kvpush`` (default)
    P and D are sent their requests *concurrently*: D allocates blocks and
    registers them with P while P is still prefilling, and P pushes the KV
    as soon as both meet. P gets ``max_tokens=1`` and
    ``kv_transfer_params={"do_remote_decode": true, "transfer_id": tid}``;
    D gets the client's body plus ``{"do_remote_prefill": true,
    "transfer_id": tid, "remote_host", "remote_port", "remote_tp_size"}``
    (P's kvpush side channel).
``vllm-pull`` (vLLM's ``NixlConnector``)
    P first; D then gets the ``kv_transfer_params`` P returned and pulls.
``vllm-push`` (vLLM's ``NixlPushConnector``)
    Concurrent like kvpush. vLLM 0.32 pairs P and D by request id (its random
    suffix stripped), so both get the same ``X-Request-Id``; D also needs P's
    NIXL engine id, side-channel address and TP size. The engine id comes
    from ``--prefill-engine-id`` (set ``"engine_id"`` in P's
    ``kv_transfer_config``); when it is unknown, the first request to that P
    runs P first and learns it from P's response (push pairing works in
    either order), later requests are concurrent.

Failure policy (never a hang):

* P fails (connection error, timeout, HTTP 5xx) before D has produced any
  output -> D's request is cancelled (closing the connection makes vLLM
  abort it) and the client gets HTTP 502 naming P.
* D fails before producing anything (connection error, HTTP 5xx) -> one
  retry on another healthy D with a new transfer id and a new P request;
  without another D, HTTP 502 naming D.
* An HTTP 4xx from P or D is the client's error (bad parameters, prompt too
  long): it is passed through as is, without retry.
* No healthy P or D -> HTTP 503. Instances are marked unhealthy by the
  periodic ``/health`` check and immediately on a connection error; the
  check brings them back.

Health rule (``--health-timeout``, ``--health-timeout-strikes``): a
``/health`` check that gets an answer other than 200, or cannot reach the
instance at all (connection refused or reset), marks it unhealthy at once:
that is a definite answer. A check that merely *times out* is only a strike:
an instance busy with prefills or decodes can be slow to answer its health
endpoint while still serving (on a loaded 2-core machine a 2 s probe of a
busy D timed out and took the only D out of rotation, turning a slow
request into an HTTP 503). Only ``health_timeout_strikes`` timeouts in a
row (default 3) mark it unhealthy; any answered check resets the count. A
hung instance is thus taken out after about ``strikes * (interval +
timeout)`` seconds (30 s with the defaults); meanwhile its growing in-flight
count already steers least-loaded selection away from it.

Selection: least in-flight requests, ties broken round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.prometheus import LATENCY_BUCKETS, MetricSpec, TextExposition

log = logging.getLogger("kvpush.router")

MODES = ("kvpush", "vllm-pull", "vllm-push")
DEFAULT_HEALTH_TIMEOUT = 5.0
DEFAULT_HEALTH_TIMEOUT_STRIKES = 3
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


# --------------------------------------------------------------------------- #
# Pure part: instances, selection, request bodies (tested without HTTP).
# --------------------------------------------------------------------------- #


@dataclass(eq=False)
class Instance:
    """One vLLM server the router sends to, with its live load and health.

    ``kv_host``/``kv_port`` are P's KV side channel (kvpush: the connector's
    ``side_channel_port``; vllm-push: ``VLLM_NIXL_SIDE_CHANNEL_PORT``); D
    needs them to register with P. Unused for D instances.
    """

    url: str
    role: str  # "prefill" | "decode"
    kv_host: str | None = None
    kv_port: int | None = None
    tp_size: int = 1
    engine_id: str | None = None
    in_flight: int = 0
    healthy: bool = True
    last_error: str = ""
    served: int = 0
    failures: int = 0
    # /health checks in a row that timed out (see the module's health rule).
    health_timeouts: int = 0

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    @property
    def name(self) -> str:
        return f"{self.role} {self.url}"


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
            if best is None or inst.in_flight < best.in_flight:
                best, best_pos = inst, pos
        if best is not None:
            self._cursor = (best_pos + 1) % n
        return best

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances)


def new_transfer_id() -> str:
    """A fresh id naming one P/D transfer (also sent as ``X-Request-Id``)."""
    return uuid.uuid4().hex


def prefill_body(body: dict[str, Any], mode: str, tid: str) -> dict[str, Any]:
    """The request P gets: the client's, cut to one output token, not streamed,
    tagged so P keeps (kvpush, vllm-push) or offers (vllm-pull) its KV."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out or "messages" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # vLLM rejects these on a non-streamed / one-token request.
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    if mode == "kvpush":
        out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
    elif mode in ("vllm-pull", "vllm-push"):
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "transfer_id": tid,
        }
    else:
        raise ValueError(f"unknown router mode {mode!r}; expected one of {MODES}")
    return out


def decode_params(
    mode: str, tid: str, prefill: Instance, prefill_response: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``kv_transfer_params`` for D.

    kvpush and vllm-push know everything up front (P's coordinates); vllm-pull
    needs ``prefill_response``, P's response JSON, whose ``kv_transfer_params``
    say where P's blocks are. Raises ``ValueError`` when a needed piece is
    missing, so a misconfigured router fails loudly, not with a stuck D.
    """
    if mode == "kvpush":
        if prefill.kv_host is None or prefill.kv_port is None:
            raise ValueError(f"{prefill.name}: no KV side-channel address (--prefill-kv) for mode kvpush")
        return {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": prefill.kv_host,
            "remote_port": prefill.kv_port,
            "remote_tp_size": prefill.tp_size,
        }
    if mode == "vllm-pull":
        params = (prefill_response or {}).get("kv_transfer_params")
        if not isinstance(params, dict) or not params:
            raise ValueError(f"{prefill.name} returned no kv_transfer_params (is it running NixlConnector?)")
        return params
    if mode == "vllm-push":
        engine_id = prefill.engine_id
        if engine_id is None and prefill_response is not None:
            engine_id = (prefill_response.get("kv_transfer_params") or {}).get("remote_engine_id")
        if engine_id is None:
            raise ValueError(f"{prefill.name}: NIXL engine id unknown (--prefill-engine-id)")
        if prefill.kv_host is None or prefill.kv_port is None:
            raise ValueError(f"{prefill.name}: no NIXL side-channel address (--prefill-kv) for mode vllm-push")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            # P's internal id carries a random suffix we cannot know; vLLM
            # pairs push requests by the suffix-stripped X-Request-Id, and
            # uses this only for lease heartbeats.
            "remote_request_id": tid,
            "remote_host": prefill.kv_host,
            "remote_port": prefill.kv_port,
            "tp_size": prefill.tp_size,
            "transfer_id": tid,
        }
    raise ValueError(f"unknown router mode {mode!r}; expected one of {MODES}")


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The request D gets: the client's body unchanged plus ``params``."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = params
    return out


def concurrent(mode: str, prefill: Instance) -> bool:
    """Whether P and D run at the same time for this P (else P first)."""
    return mode == "kvpush" or (mode == "vllm-push" and prefill.engine_id is not None)


# --------------------------------------------------------------------------- #
# HTTP part.
# --------------------------------------------------------------------------- #


@dataclass
class RouterConfig:
    """Everything the router needs; built from the CLI or by tests."""

    prefill: list[Instance]
    decode: list[Instance]
    mode: str = "kvpush"
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout: float = 5.0
    prefill_timeout: float = 600.0
    # Longest D may stay silent (before its first byte and between chunks).
    decode_timeout: float = 600.0
    health_interval: float = 5.0
    # Seconds one /health check may take. 2 s proved too short for a busy D.
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT
    # Timed-out checks in a row before an instance counts as unhealthy.
    health_timeout_strikes: int = DEFAULT_HEALTH_TIMEOUT_STRIKES
    retry_decode: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown router mode {self.mode!r}; expected one of {MODES}")
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        if not self.health_timeout > 0:
            raise ValueError(f"health_timeout must be > 0 seconds, got {self.health_timeout}")
        if self.health_timeout_strikes < 1:
            raise ValueError(f"health_timeout_strikes must be >= 1, got {self.health_timeout_strikes}")
        for inst in self.prefill:
            inst.role = "prefill"
            if self.mode in ("kvpush", "vllm-push") and (inst.kv_host is None or inst.kv_port is None):
                raise ValueError(f"{inst.name}: mode {self.mode} needs its KV side-channel address (--prefill-kv)")
        for inst in self.decode:
            inst.role = "decode"


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


ROUTER_METRICS = (
    MetricSpec(
        "kvpush_router_request_seconds",
        "histogram",
        "Router-side time per successful request and stage: prefill (P's one-token answer), decode_first_byte "
        "(D's first bytes, i.e. the pushed KV arrived and D produced output), total.",
        ("stage",),
        LATENCY_BUCKETS,
    ),
    MetricSpec(
        "kvpush_router_failures_total",
        "counter",
        "Upstream failures by role and cause (connect, timeout, http_5xx, http_4xx, bad_response, stream_cut, other).",
        ("role", "cause"),
    ),
    MetricSpec(
        "kvpush_router_prefill_aborts_total",
        "counter",
        "P requests cancelled because their pairing failed first (vLLM aborts them and frees their blocks).",
        (),
    ),
)


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


def _error(status: int, message: str, typ: str, **extra: Any) -> web.Response:
    payload = {"error": {"message": message, "type": typ, "code": status, **extra}}
    return web.json_response(payload, status=status)


class Router:
    """The aiohttp application plus its shared state (pools, counters)."""

    def __init__(self, config: RouterConfig) -> None:
        self.cfg = config
        self.prefill = Pool(config.prefill)
        self.decode = Pool(config.decode)
        self.pending = 0  # client requests being proxied
        self.pending_prefill = 0  # P requests in flight
        self.counters: dict[str, int] = {
            "requests": 0,
            "ok": 0,
            "client_errors": 0,
            "prefill_failures": 0,
            "decode_failures": 0,
            "retries": 0,
            "unavailable": 0,
        }
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.prom = TextExposition(ROUTER_METRICS)  # latency, failures by cause, aborts

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
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout),
        )
        if self.cfg.health_interval > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def _on_cleanup(self, _app: web.Application) -> None:
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

    # -- health ------------------------------------------------------------ #

    async def check_health(self) -> None:
        """One round of ``GET /health`` on every instance, concurrently."""
        insts = self.prefill.instances + self.decode.instances
        await asyncio.gather(*(self._check_one(i) for i in insts))

    async def _check_one(self, inst: Instance) -> None:
        """Check one instance and apply the health rule (module docstring):
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

    async def _health_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.check_health()
            await asyncio.sleep(self.cfg.health_interval)

    def _mark_down(self, inst: Instance, detail: str) -> None:
        """Passive health: a connection failure takes the instance out of
        rotation at once; the periodic check brings it back."""
        if inst.healthy:
            log.warning("%s marked UNHEALTHY: %s", inst.name, detail)
        inst.healthy = False
        inst.last_error = detail

    # -- small endpoints --------------------------------------------------- #

    def _unavailable(self) -> web.Response | None:
        pools = (("prefill", self.prefill), ("decode", self.decode))
        missing = [(role, pool) for role, pool in pools if not pool.any_healthy()]
        if not missing:
            return None
        parts = []
        for role, pool in missing:
            errs = "; ".join(f"{i.url}: {i.last_error or 'unhealthy'}" for i in pool.instances)
            parts.append(f"no healthy {role} instance ({errs})")
        return _error(503, "; ".join(parts), "service_unavailable")

    async def _health(self, _req: web.Request) -> web.Response:
        bad = self._unavailable()
        if bad is not None:
            return bad
        return web.json_response({"status": "ok", **self._instances_json()})

    def _instances_json(self) -> dict[str, Any]:
        def one(i: Instance) -> dict[str, Any]:
            return {
                "url": i.url,
                "healthy": i.healthy,
                "in_flight": i.in_flight,
                "served": i.served,
                "failures": i.failures,
                "health_timeouts": i.health_timeouts,
                "last_error": i.last_error,
            }

        return {
            "mode": self.cfg.mode,
            "prefill": [one(i) for i in self.prefill.instances],
            "decode": [one(i) for i in self.decode.instances],
        }

    async def _pending(self, _req: web.Request) -> web.Response:
        return web.json_response(
            {"pending": self.pending, "pending_prefill": self.pending_prefill, **self._instances_json()}
        )

    async def _models(self, req: web.Request) -> web.StreamResponse:
        for pool in (self.decode, self.prefill):
            inst = pool.pick()
            if inst is None:
                continue
            try:
                async with self.session.get(
                    inst.url + "/v1/models",
                    headers=_forward_headers(req, None),
                    timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout + self.cfg.connect_timeout),
                ) as r:
                    data = await r.read()
                    return web.Response(body=data, status=r.status, content_type="application/json")
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self._mark_down(inst, f"/v1/models: {type(e).__name__}: {e}")
        return self._unavailable() or _error(503, "no instance answered /v1/models", "service_unavailable")

    async def _metrics(self, _req: web.Request) -> web.Response:
        lines = [
            "# HELP kvpush_router_pending_requests Client requests being proxied now.",
            "# TYPE kvpush_router_pending_requests gauge",
            f"kvpush_router_pending_requests {self.pending}",
            "# HELP kvpush_router_pending_transfers P (prefill) requests in flight, i.e. transfers not yet prefilled.",
            "# TYPE kvpush_router_pending_transfers gauge",
            f"kvpush_router_pending_transfers {self.pending_prefill}",
            "# HELP kvpush_router_requests_total Requests by outcome.",
            "# TYPE kvpush_router_requests_total counter",
        ]
        for outcome in ("ok", "client_errors", "prefill_failures", "decode_failures", "unavailable"):
            lines.append(f'kvpush_router_requests_total{{outcome="{outcome}"}} {self.counters[outcome]}')
        lines += [
            "# HELP kvpush_router_received_total Requests received on completion endpoints.",
            "# TYPE kvpush_router_received_total counter",
            f"kvpush_router_received_total {self.counters['requests']}",
            "# HELP kvpush_router_retries_total Requests retried on another decode instance.",
            "# TYPE kvpush_router_retries_total counter",
            f"kvpush_router_retries_total {self.counters['retries']}",
            "# HELP kvpush_router_instance_in_flight Requests in flight per instance.",
            "# TYPE kvpush_router_instance_in_flight gauge",
        ]
        insts = self.prefill.instances + self.decode.instances
        for i in insts:
            lines.append(f'kvpush_router_instance_in_flight{{role="{i.role}",url="{i.url}"}} {i.in_flight}')
        lines += ["# HELP kvpush_router_instance_healthy 1 if healthy.", "# TYPE kvpush_router_instance_healthy gauge"]
        for i in insts:
            lines.append(f'kvpush_router_instance_healthy{{role="{i.role}",url="{i.url}"}} {int(i.healthy)}')
        text = "\n".join(lines) + "\n" + self.prom.render()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- proxying ---------------------------------------------------------- #

    async def _completions(self, req: web.Request) -> web.StreamResponse:
        return await self._proxy(req, COMPLETIONS)

    async def _chat(self, req: web.Request) -> web.StreamResponse:
        return await self._proxy(req, CHAT)

    async def _proxy(self, req: web.Request, endpoint: str) -> web.StreamResponse:
        self.counters["requests"] += 1
        try:
            body = await req.json()
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except (ValueError, json.JSONDecodeError) as e:
            self.counters["client_errors"] += 1
            return _error(400, f"invalid JSON body: {e}", "invalid_request_error")
        self.pending += 1
        try:
            tried: list[Instance] = []
            while True:
                resp = await self._attempt(req, endpoint, body, tried)
                if isinstance(resp, UpstreamError):
                    err = resp
                    if (
                        err.inst.role == "decode"
                        and err.retryable
                        and self.cfg.retry_decode
                        and len(tried) == 1
                        and self.decode.pick(exclude=tried) is not None
                    ):
                        self.counters["retries"] += 1
                        log.warning("%s; retrying on another decode instance", err)
                        continue
                    return self._fail(err)
                return resp
        finally:
            self.pending -= 1

    def _fail(self, err: UpstreamError) -> web.Response:
        self.prom.inc("kvpush_router_failures_total", role=err.inst.role, cause=failure_cause(err))
        if err.status < 500:
            self.counters["client_errors"] += 1
            return web.Response(
                body=err.body or b"",
                status=err.status,
                content_type="application/json",
                headers={"X-Kvpush-Instance": err.inst.url},
            )
        self.counters["prefill_failures" if err.inst.role == "prefill" else "decode_failures"] += 1
        log.error("%s", err)
        return _error(
            502,
            str(err),
            "upstream_error",
            instance=err.inst.url,
            role=err.inst.role,
            stage=err.stage,
        )

    async def _attempt(
        self, req: web.Request, endpoint: str, body: dict[str, Any], tried: list[Instance]
    ) -> web.StreamResponse | UpstreamError:
        """One P/D pairing. Returns the client response, or the error that
        ended it before anything was sent to the client (so a retry is safe)."""
        p = self.prefill.pick()
        d = self.decode.pick(exclude=tried)
        if p is None or d is None:
            self.counters["unavailable"] += 1
            return self._unavailable() or _error(503, "no healthy decode instance left to try", "service_unavailable")
        tried.append(d)
        tid = new_transfer_id()
        t_start = loop_time()
        mode = self.cfg.mode
        headers = _forward_headers(req, tid)
        stream = bool(body.get("stream"))
        d.in_flight += 1
        p_task: asyncio.Task[dict[str, Any]] | None = None
        d_resp: aiohttp.ClientResponse | None = None
        ok = False
        try:
            p_task = self._start_prefill(p, endpoint, prefill_body(body, mode, tid), headers)
            if concurrent(mode, p):
                params = decode_params(mode, tid, p)
            else:
                p_json = await p_task
                if mode == "vllm-push" and p.engine_id is None:
                    p.engine_id = (p_json.get("kv_transfer_params") or {}).get("remote_engine_id")
                try:
                    params = decode_params(mode, tid, p, p_json)
                except ValueError as e:
                    raise UpstreamError(p, "prefill", str(e)) from None
            # D's response headers (and, non-streamed, its whole body or, streamed,
            # its first chunk) race P: a P failure before then ends the pairing.
            d_resp = await self._race(p_task, self._open_decode(d, endpoint, decode_body(body, params), headers))
            if not stream:
                data = await self._race(p_task, self._read_decode(d, d_resp))
                self.prom.observe("kvpush_router_request_seconds", loop_time() - t_start, stage="decode_first_byte")
                ok = True
                return web.Response(
                    body=data, status=d_resp.status, content_type=d_resp.content_type, headers={"X-Request-Id": tid}
                )
            first = await self._race(p_task, self._read_chunk(d, d_resp))
            self.prom.observe("kvpush_router_request_seconds", loop_time() - t_start, stage="decode_first_byte")
            out, ok = await self._forward_stream(req, d, d_resp, first, tid)
            return out
        except UpstreamError as e:
            e.inst.failures += 1
            return e
        finally:
            d.in_flight -= 1
            if ok:
                d.served += 1
                self.counters["ok"] += 1
                self.prom.observe("kvpush_router_request_seconds", loop_time() - t_start, stage="total")
            if d_resp is not None:
                if ok:
                    d_resp.release()
                else:
                    d_resp.close()  # an unfinished D request: vLLM aborts it
            if p_task is not None:
                self._settle_prefill(p, p_task, cancel=not ok)

    async def _forward_stream(
        self, req: web.Request, d: Instance, d_resp: aiohttp.ClientResponse, first: bytes, tid: str
    ) -> tuple[web.StreamResponse, bool]:
        """Send D's stream to the client chunk by chunk, unchanged; True if it
        ended normally. The client has bytes from here on, so a later D
        failure can only cut the stream short."""
        out = web.StreamResponse(status=d_resp.status, headers={"X-Request-Id": tid})
        out.content_type = d_resp.content_type
        await out.prepare(req)
        chunk = first
        try:
            while chunk:
                await out.write(chunk)
                chunk = await self._read_chunk(d, d_resp)
        except UpstreamError as e:
            d.failures += 1
            self.counters["decode_failures"] += 1
            self.prom.inc("kvpush_router_failures_total", role="decode", cause="stream_cut")
            log.error("%s (after streaming started; stream cut)", e)
            return out, False
        await out.write_eof()
        return out, True

    def _settle_prefill(self, p: Instance, task: asyncio.Task[dict[str, Any]], cancel: bool) -> None:
        """After a pairing ends: a failed pairing cancels a still-running P
        request (the closed connection makes vLLM abort it and free its
        blocks); a successful one lets P finish in the background, since D's
        answer does not wait for P's one-token reply."""

        def done(t: asyncio.Task[dict[str, Any]]) -> None:
            if t.cancelled():
                return
            if t.exception() is None:
                p.served += 1
            else:
                log.debug("prefill after the pairing ended: %s", t.exception())

        if cancel and not task.done():
            task.cancel()
            self.prom.inc("kvpush_router_prefill_aborts_total")
        if task.done():
            done(task)
        else:
            task.add_done_callback(done)

    async def _race(self, p_task: asyncio.Task[dict[str, Any]], d_coro: Any) -> Any:
        """Await ``d_coro`` but fail fast if P fails first.

        P succeeding first is fine (D keeps going); D finishing first is fine
        too. Only a P failure while D is still pending ends the pairing.
        """
        d_task = asyncio.ensure_future(d_coro)
        try:
            while True:
                if p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
                    d_task.cancel()
                    raise p_task.exception()  # type: ignore[misc]
                waiting: set[asyncio.Future[Any]] = {d_task} if p_task.done() else {d_task, p_task}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if d_task in done:
                    return d_task.result()
        finally:
            if not d_task.done():
                d_task.cancel()
                with contextlib.suppress(BaseException):
                    await d_task

    def _start_prefill(
        self, p: Instance, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> asyncio.Task[dict[str, Any]]:
        """Start P's request as a task. P's load and the pending-transfer
        gauge follow the task itself (not the pairing), since P may answer
        after D is done, or be cancelled before it ever ran."""
        p.in_flight += 1
        self.pending_prefill += 1
        task = asyncio.create_task(self._run_prefill(p, endpoint, body, headers))

        def done(_t: asyncio.Task[dict[str, Any]]) -> None:
            p.in_flight -= 1
            self.pending_prefill -= 1

        task.add_done_callback(done)
        return task

    async def _run_prefill(
        self, p: Instance, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        t0 = loop_time()
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.prefill_timeout, connect=self.cfg.connect_timeout)
            async with self.session.post(p.url + endpoint, json=body, headers=headers, timeout=timeout) as r:
                data = await r.read()
                if r.status != 200:
                    raise UpstreamError(p, "prefill", _status_detail(r.status, data), _client_status(r.status), data)
                self.prom.observe("kvpush_router_request_seconds", loop_time() - t0, stage="prefill")
                try:
                    return json.loads(data)
                except ValueError:
                    raise UpstreamError(p, "prefill", "response is not JSON") from None
        except TimeoutError:
            raise UpstreamError(p, "prefill", f"no answer within {self.cfg.prefill_timeout:g} s") from None
        except aiohttp.ClientConnectorError as e:
            self._mark_down(p, str(e))
            raise UpstreamError(p, "prefill", f"cannot connect: {e}") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(p, "prefill", f"{type(e).__name__}: {e}") from None

    async def _open_decode(
        self, d: Instance, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout, sock_read=self.cfg.decode_timeout)
        try:
            r = await self.session.post(d.url + endpoint, json=body, headers=headers, timeout=timeout)
        except TimeoutError:
            raise UpstreamError(d, "decode", f"no answer within {self.cfg.decode_timeout:g} s") from None
        except aiohttp.ClientConnectorError as e:
            self._mark_down(d, str(e))
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
            raise UpstreamError(d, "decode", _status_detail(r.status, data), _client_status(r.status), data)
        return r

    async def _read_decode(self, d: Instance, r: aiohttp.ClientResponse) -> bytes:
        try:
            return await r.read()
        except TimeoutError:
            raise UpstreamError(d, "decode", f"silent for {self.cfg.decode_timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(d, "decode", f"{type(e).__name__}: {e}") from None

    async def _read_chunk(self, d: Instance, r: aiohttp.ClientResponse) -> bytes:
        """Next piece of D's stream as it arrived (b"" at the end)."""
        try:
            return await r.content.readany()
        except TimeoutError:
            raise UpstreamError(d, "decode", f"stream silent for {self.cfg.decode_timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(d, "decode", f"{type(e).__name__}: {e}") from None


def loop_time() -> float:
    """The running event loop's monotonic clock (what asyncio timeouts use)."""
    return asyncio.get_running_loop().time()


def _client_status(status: int) -> int:
    """Upstream 4xx are the client's errors and pass through; anything else
    becomes 502 (the router's upstream failed)."""
    return status if 400 <= status < 500 else 502


def _status_detail(status: int, data: bytes) -> str:
    text = data[:500].decode("utf-8", "replace").strip()
    return f"HTTP {status}" + (f": {text}" if text else "")


def _forward_headers(req: web.Request, tid: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if auth := req.headers.get("Authorization"):
        headers["Authorization"] = auth
    if tid is not None:
        headers["X-Request-Id"] = tid
    return headers


# --------------------------------------------------------------------------- #
# CLI.
# --------------------------------------------------------------------------- #


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush router",
        description="OpenAI-compatible router for P/D-disaggregated vLLM (kvpush, vLLM NIXL pull or push).",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--mode", choices=MODES, default="kvpush")
    ap.add_argument("--prefill", action="append", default=[], metavar="URL", help="P instance (repeatable)")
    ap.add_argument(
        "--prefill-kv",
        action="append",
        default=[],
        type=_hostport,
        metavar="HOST:PORT",
        help="KV side channel of the P instance at the same position (kvpush, vllm-push)",
    )
    ap.add_argument(
        "--prefill-tp",
        action="append",
        default=[],
        type=int,
        metavar="N",
        help="TP size per P (one value for all, or one per --prefill; default 1)",
    )
    ap.add_argument(
        "--prefill-engine-id",
        action="append",
        default=[],
        metavar="ID",
        help="vllm-push: NIXL engine id per P (else learned from the first request)",
    )
    ap.add_argument("--decode", action="append", default=[], metavar="URL", help="D instance (repeatable)")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--prefill-timeout", type=float, default=600.0, help="seconds for P's whole answer")
    ap.add_argument("--decode-timeout", type=float, default=600.0, help="longest silence from D (seconds)")
    ap.add_argument("--health-interval", type=float, default=5.0, help="seconds between /health checks (0: off)")
    ap.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_HEALTH_TIMEOUT,
        metavar="SECONDS",
        help=f"how long one /health check may take (default {DEFAULT_HEALTH_TIMEOUT:g})",
    )
    ap.add_argument(
        "--health-timeout-strikes",
        type=int,
        default=DEFAULT_HEALTH_TIMEOUT_STRIKES,
        metavar="N",
        help="timed-out /health checks in a row before an instance counts as unhealthy; an error answer or a "
        f"refused connection counts at once (default {DEFAULT_HEALTH_TIMEOUT_STRIKES}; 1: any timeout)",
    )
    ap.add_argument("--no-retry", action="store_true", help="do not retry a failed D on another D")
    ap.add_argument("--log-level", default="INFO")
    return ap


def _per_prefill(ap: argparse.ArgumentParser, name: str, values: Sequence[Any], n: int, default: Any) -> list[Any]:
    if not values:
        return [default] * n
    if len(values) == 1 and name == "--prefill-tp":
        return list(values) * n
    if len(values) != n:
        ap.error(f"{name} given {len(values)} times for {n} --prefill instances (they pair in order)")
    return list(values)


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse the CLI into a validated :class:`RouterConfig`."""
    ap = build_parser()
    return _config(ap, ap.parse_args(argv))


def _config(ap: argparse.ArgumentParser, a: argparse.Namespace) -> RouterConfig:
    if not a.prefill or not a.decode:
        ap.error("give at least one --prefill and one --decode")
    n = len(a.prefill)
    kvs = _per_prefill(ap, "--prefill-kv", a.prefill_kv, n, None)
    tps = _per_prefill(ap, "--prefill-tp", a.prefill_tp, n, 1)
    eids = _per_prefill(ap, "--prefill-engine-id", a.prefill_engine_id, n, None)
    prefill = [
        Instance(url, "prefill", kv[0] if kv else None, kv[1] if kv else None, tp, eid)
        for url, kv, tp, eid in zip(a.prefill, kvs, tps, eids, strict=True)
    ]
    decode = [Instance(url, "decode") for url in a.decode]
    try:
        return RouterConfig(
            prefill=prefill,
            decode=decode,
            mode=a.mode,
            host=a.host,
            port=a.port,
            connect_timeout=a.connect_timeout,
            prefill_timeout=a.prefill_timeout,
            decode_timeout=a.decode_timeout,
            health_interval=a.health_interval,
            health_timeout=a.health_timeout,
            health_timeout_strikes=a.health_timeout_strikes,
            retry_decode=not a.no_retry,
        )
    except ValueError as e:
        ap.error(str(e))
        raise  # unreachable: ap.error exits


async def serve(config: RouterConfig) -> None:
    """Run the router until cancelled."""
    router = Router(config)
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    log.info(
        "kvpush router (%s) on http://%s:%d: prefill %s, decode %s",
        config.mode,
        config.host,
        config.port,
        [i.url for i in config.prefill],
        [i.url for i in config.decode],
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """``kvpush router ...``: run the router in the foreground (Ctrl-C stops it)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    config = _config(ap, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "MODES",
    "Instance",
    "Pool",
    "Router",
    "RouterConfig",
    "concurrent",
    "config_from_args",
    "decode_body",
    "decode_params",
    "main",
    "new_transfer_id",
    "prefill_body",
    "serve",
]
