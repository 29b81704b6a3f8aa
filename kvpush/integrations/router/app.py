"""The router's HTTP application: one P/D pairing per client request, D's answer passed through unchanged.

A client talks to the router as if it were one vLLM server. For every
completion request the router picks a prefill instance (P) and a decode
instance (D), gives the pair one transfer id, and returns D's answer (or
stream) to the client unchanged, byte for byte. What P and D are sent in
each mode is in ``requests``; health in ``health``.

Failure policy (never a hang):

* P fails (connection error, timeout, HTTP 5xx) before D has produced any
  output -> D's request is cancelled (closing the connection makes vLLM
  abort it) and the pairing is retried once on another healthy P (new
  transfer id, D chosen afresh); without another P, HTTP 502 naming P.
* D fails before producing anything (connection error, HTTP 5xx, or, not
  streamed, its connection lost before its whole answer) -> one retry on
  another healthy D with a new transfer id and a new P request; without
  another D, HTTP 502 naming D.
* One retry per request, on an instance that has not failed it: a request
  that failed twice is answered, not sent around the fleet.
* Every HTTP 5xx the router answers says ``"retryable": true`` in its error
  body: nothing of it was served, and a new request may succeed (503s also
  carry ``Retry-After``).
* D's stream breaks after the client had bytes: the stream ends with an
  error event (``data: {"error": {..., "retryable": true}}``) in place of
  ``data: [DONE]``; events are forwarded whole, so the error never lands
  inside a half-sent one. A client that sees it retries the request.
* An instance that failed a request (HTTP 5xx, connection lost) is checked
  at once (``GET /health``, the health rule): a dead one leaves rotation
  within that check, not at the next periodic one; the periodic check
  brings it back when it answers again.
* An HTTP 4xx from P or D is the client's error (bad parameters, prompt too
  long): it is passed through as is, without retry.
* No healthy P or D -> HTTP 503.
* Overload (``max_prefill_queue``): the least-loaded P already has that
  many requests queued or running -> HTTP 503 at once, with the reason and
  ``Retry-After``: a client retries later instead of waiting behind a
  backlog that would outlast its patience, and P and D hold nothing for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.integrations.router.config import RouterConfig
from kvpush.integrations.router.engine_metrics import PrefillRate, queue_loop
from kvpush.integrations.router.health import HealthChecker, mark_down
from kvpush.integrations.router.metrics import ROUTER_METRICS, fixed_exposition
from kvpush.integrations.router.pool import Instance, Pool
from kvpush.integrations.router.requests import (
    capability_of,
    client_params_error,
    concurrent,
    decode_body,
    decode_params,
    new_transfer_id,
    prefill_body,
    with_client_params,
)
from kvpush.integrations.router.selective import Selector
from kvpush.integrations.router.upstream import (
    UpstreamError,
    Upstreams,
    failure_cause,
    forward_headers,
    loop_time,
)
from kvpush.observability.prometheus import TextExposition

log = logging.getLogger("kvpush.router")

COMPLETIONS = "/v1/completions"
DONE_EVENT = b"data: [DONE]"  # the last event of every vLLM stream
CHAT = "/v1/chat/completions"


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
            "overloaded": 0,
        }
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.prom = TextExposition(ROUTER_METRICS)  # latency, failures by cause, aborts
        self.health = HealthChecker(config, lambda: self.session)
        self.selector = Selector() if config.selective else None
        # P task -> when P answered (selective: where the transfer's time starts); gone with the task.
        self._prefill_done: weakref.WeakKeyDictionary[asyncio.Task[dict[str, Any]], float] = weakref.WeakKeyDictionary()
        self._scrape_task: asyncio.Task[None] | None = None
        self._queue_task: asyncio.Task[None] | None = None
        self.up = Upstreams(config, lambda: self.session, self.prom)
        self._probes: set[asyncio.Task[None]] = set()  # health checks of instances that just failed a request

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
        pools = (("prefill", self.prefill), ("decode", self.decode))
        missing = [(role, pool) for role, pool in pools if not pool.any_healthy()]
        if not missing:
            return None
        parts = []
        for role, pool in missing:
            errs = "; ".join(f"{i.url}: {i.last_error or 'unhealthy'}" for i in pool.instances)
            parts.append(f"no healthy {role} instance ({errs})")
        resp = _error(503, "; ".join(parts), "service_unavailable", retryable=True)
        resp.headers["Retry-After"] = str(max(1, round(self.cfg.health_interval)))
        return resp

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
        return web.json_response(
            {"pending": self.pending, "pending_prefill": self.pending_prefill, **self._instances_json(), **extra}
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
        return self._unavailable() or _error(503, "no instance answered /v1/models", "service_unavailable")

    async def _metrics(self, _req: web.Request) -> web.Response:
        insts = self.prefill.instances + self.decode.instances
        text = fixed_exposition(self.pending, self.pending_prefill, self.counters, insts) + self.prom.render()
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
        refused = client_params_error(body, self.cfg.client_params)
        if refused is not None:
            self.counters["client_errors"] += 1
            return _error(400, refused, "invalid_request_error", param="kv_transfer_params")
        self.pending += 1
        try:
            failed: list[Instance] = []
            while True:
                resp = await self._attempt(req, endpoint, body, failed)
                if not isinstance(resp, UpstreamError):
                    return resp
                failed.append(resp.inst)
                if self._may_retry(resp, failed):
                    self.counters["retries"] += 1
                    log.warning("%s; retrying on another %s instance", resp, resp.inst.role)
                    continue
                return self._fail(resp)
        finally:
            self.pending -= 1

    def _may_retry(self, err: UpstreamError, failed: list[Instance]) -> bool:
        """Retry once, for a 5xx-class failure, when the failed role has a healthy instance that has not
        failed this request (the module docstring's policy)."""
        allowed = self.cfg.retry_decode if err.inst.role == "decode" else self.cfg.retry_prefill
        pool = self.decode if err.inst.role == "decode" else self.prefill
        return allowed and err.retryable and len(failed) == 1 and pool.pick(exclude=failed) is not None

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
            retryable=True,
        )

    async def _attempt(
        self, req: web.Request, endpoint: str, body: dict[str, Any], failed: list[Instance]
    ) -> web.StreamResponse | UpstreamError:
        """One P/D pairing (or D alone, when the selector says so) on instances not in ``failed``. Returns
        the client response, or the error that ended it before anything was sent to the client (so a retry
        is safe)."""
        choice = self.selector.choose(body) if self.selector is not None else None
        local = choice is not None and choice.local
        p = None if local else self.prefill.pick(exclude=failed)
        d = self.decode.pick(exclude=failed)
        if (p is None and not local) or d is None:
            self.counters["unavailable"] += 1
            return self._unavailable() or _error(
                503, "no healthy instance left to try", "service_unavailable", retryable=True
            )
        busy = self._overloaded(p)
        if busy is not None:
            return busy
        if choice is not None:
            self.prom.inc("kvpush_router_routes_total", route=choice.route.value)
        tid = new_transfer_id()
        t_start = loop_time()
        headers = forward_headers(req, tid)
        d.in_flight += 1
        p_task: asyncio.Task[dict[str, Any]] | None = None
        d_resp: aiohttp.ClientResponse | None = None
        ok = False
        try:
            if p is None:
                d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            else:
                p_task, d_body = await self._start_pair(p, endpoint, body, tid, headers)
            # D's response headers (and, non-streamed, its whole body or, streamed,
            # its first chunk) race P: a P failure before then ends the pairing.
            d_resp = await self._race(p_task, self.up.open_decode(d, endpoint, d_body, headers))
            if not body.get("stream"):
                data = await self._race(p_task, self.up.read_decode(d, d_resp))
                self._first_byte(t_start, p_task, body)
                ok = True
                return web.Response(
                    body=data, status=d_resp.status, content_type=d_resp.content_type, headers={"X-Request-Id": tid}
                )
            first = await self._race(p_task, self.up.read_chunk(d, d_resp))
            self._first_byte(t_start, p_task, body)
            out, ok = await self._forward_stream(req, d, d_resp, first, tid)
            return out
        except UpstreamError as e:
            e.inst.failures += 1
            self._suspect(e)
            return e
        finally:
            self._end_attempt(p, p_task, d, d_resp, ok, t_start)

    def _overloaded(self, p: Instance | None) -> web.Response | None:
        """503 with ``Retry-After`` when the least-loaded P already holds ``max_prefill_queue`` requests.

        Refusing at once lets the client retry later instead of waiting behind a
        backlog, and P and D hold nothing for it.
        """
        bound = self.cfg.max_prefill_queue
        if p is None or not bound or p.load < bound:
            return None
        self.counters["overloaded"] += 1
        why = (
            f"overloaded: the least-loaded prefill instance ({p.url}) has {p.load} requests queued or running "
            f"(limit {bound}); retry later"
        )
        log.warning("%s", why)
        resp = _error(503, why, "overloaded", retryable=True)
        resp.headers["Retry-After"] = "1"
        return resp

    def _end_attempt(
        self,
        p: Instance | None,
        p_task: asyncio.Task[dict[str, Any]] | None,
        d: Instance,
        d_resp: aiohttp.ClientResponse | None,
        ok: bool,
        t_start: float,
    ) -> None:
        """Settle one pairing's books: D's load and counters, D's response (closed when unfinished, so vLLM
        aborts it), and P's request (cancelled unless the pairing succeeded)."""
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
        if p_task is not None and p is not None:
            self._settle_prefill(p, p_task, cancel=not ok)

    async def _start_pair(
        self, p: Instance, endpoint: str, body: dict[str, Any], tid: str, headers: dict[str, str]
    ) -> tuple[asyncio.Task[dict[str, Any]], dict[str, Any]]:
        """Send P its request; D's body, once D's parameters are known (at once, or from P's answer)."""
        mode = self.cfg.mode
        cap = capability_of(self.cfg.capability_key, tid)
        p_body = prefill_body(body, mode, tid, bound=bool(cap))
        p_body["kv_transfer_params"] = with_client_params(p_body["kv_transfer_params"], body)
        p_task = self._start_prefill(p, endpoint, p_body, headers)
        if concurrent(mode, p):
            params = decode_params(mode, tid, p, capability=cap)
        else:
            p_json = await p_task
            if mode == "vllm-push" and p.engine_id is None:
                p.engine_id = (p_json.get("kv_transfer_params") or {}).get("remote_engine_id")
            try:
                params = decode_params(mode, tid, p, p_json, cap)
            except ValueError as e:
                raise UpstreamError(p, "prefill", str(e)) from None
        return p_task, decode_body(body, with_client_params(params, body))

    def _first_byte(self, t_start: float, p_task: asyncio.Task[dict[str, Any]] | None, body: dict[str, Any]) -> None:
        """D's first bytes are here: time them, and teach the selector what the transfer added."""
        now = loop_time()
        self.prom.observe("kvpush_router_request_seconds", now - t_start, stage="decode_first_byte")
        if self.selector is None or p_task is None:
            return
        selector = self.selector
        prompt = body.get("prompt")

        def learn(t: asyncio.Task[dict[str, Any]]) -> None:
            if t.cancelled() or t.exception() is not None:
                return
            p_json, p_done = t.result(), self._prefill_done.pop(t, now)
            tokens = (p_json.get("usage") or {}).get("prompt_tokens")
            if isinstance(tokens, int):
                selector.observe_transfer(tokens, now - p_done)
                if isinstance(prompt, str):
                    selector.observe_prompt(len(prompt), tokens)

        if p_task.done():
            learn(p_task)
        else:
            p_task.add_done_callback(learn)

    async def _forward_stream(
        self, req: web.Request, d: Instance, d_resp: aiohttp.ClientResponse, first: bytes, tid: str
    ) -> tuple[web.StreamResponse, bool]:
        """Send D's stream to the client unchanged; True if it ended normally.

        The client has bytes from here on, so a later D failure can only end
        the stream: server-sent events go out whole (a piece of one waits for
        its end), and a break ends the stream with an error event saying the
        request may be retried, never inside a half-sent event."""
        out = web.StreamResponse(status=d_resp.status, headers={"X-Request-Id": tid})
        out.content_type = d_resp.content_type
        await out.prepare(req)
        events = d_resp.content_type == "text/event-stream"
        held = b""  # the start of an event whose end has not come yet
        sent = b""  # the end of what was sent (events: the last whole event)
        chunk = first
        try:
            while chunk:
                if events:
                    data = held + chunk
                    end = data.rfind(b"\n\n")
                    cut = 0 if end < 0 else end + 2
                    chunk, held = data[:cut], data[cut:]
                if chunk:
                    await out.write(chunk)
                    sent = (sent + chunk)[-64:]
                chunk = await self.up.read_chunk(d, d_resp)
            if events and not (sent + held).rstrip().endswith(DONE_EVENT):
                # D's connection closed cleanly mid-stream (a process killed between chunks can look so).
                raise UpstreamError(d, "decode", "the stream ended without data: [DONE]")
        except UpstreamError as e:
            d.failures += 1
            self.counters["decode_failures"] += 1
            self.prom.inc("kvpush_router_failures_total", role="decode", cause="stream_cut")
            self._suspect(e)
            log.error("%s (after streaming started; stream ended with an error event)", e)
            if events:
                await self._write_error_event(out, e)
            return out, False
        if held:
            await out.write(held)
        await out.write_eof()
        return out, True

    @staticmethod
    async def _write_error_event(out: web.StreamResponse, err: UpstreamError) -> None:
        """The stream's last event: the failure, as vLLM reports errors in a stream, marked retryable."""
        error = {
            "message": f"{err} (after streaming started)",
            "type": "upstream_error",
            "code": 502,
            "instance": err.inst.url,
            "role": err.inst.role,
            "stage": err.stage,
            "retryable": True,
        }
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
            await out.write_eof()

    def _suspect(self, err: UpstreamError) -> None:
        """An instance failed a request with a 5xx-class failure: check its health now, so that a dead one
        leaves rotation before the next periodic check (a live one that merely failed this request stays)."""
        if not err.retryable or not err.inst.healthy or self._session is None:
            return
        task = asyncio.create_task(self.health.check([err.inst]))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _settle_prefill(self, p: Instance, task: asyncio.Task[dict[str, Any]], cancel: bool) -> None:
        """After a pairing ends: a failed pairing cancels a still-running P
        request (the closed connection makes vLLM abort it and free its
        blocks); a successful one lets P finish in the background, since D's
        answer does not wait for P's one-token reply."""

        def done(t: asyncio.Task[dict[str, Any]]) -> None:
            if t.cancelled():
                return
            exc = t.exception()
            if exc is None:
                p.served += 1
            else:
                log.debug("prefill after the pairing ended: %s", exc)
                if isinstance(exc, UpstreamError):
                    self._suspect(exc)

        if cancel and not task.done():
            task.cancel()
            self.prom.inc("kvpush_router_prefill_aborts_total")
        if task.done():
            done(task)
        else:
            task.add_done_callback(done)

    async def _race(self, p_task: asyncio.Task[dict[str, Any]] | None, d_coro: Any) -> Any:
        """Await ``d_coro`` but fail fast if P fails first.

        P succeeding first is fine (D keeps going); D finishing first is fine
        too. Only a P failure while D is still pending ends the pairing.
        Without a P (D alone) it is a plain await.
        """
        if p_task is None:
            return await d_coro
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
        task = asyncio.create_task(self.up.run_prefill(p, endpoint, body, headers))

        def done(t: asyncio.Task[dict[str, Any]]) -> None:
            p.in_flight -= 1
            self.pending_prefill -= 1
            if self.selector is not None:
                self._prefill_done[t] = loop_time()

        task.add_done_callback(done)
        return task
