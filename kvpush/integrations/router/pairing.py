"""One client request through the fleet: its P/D pairing, the one retry, and what the client gets when it fails.

For a completion request ``Proxy`` picks a prefill instance (P) and a
decode instance (D) (or D alone, when the selector says so), gives the pair
one transfer id, sends P and D their requests (``requests``), and returns
D's answer, or stream (``stream``), unchanged; P's request runs as a task
(``prefill_tasks``). The HTTP application around it is ``app``; the error
answers it makes up are ``answers``.

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
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.integrations.router.answers import error, unavailable
from kvpush.integrations.router.config import RouterConfig
from kvpush.integrations.router.health import HealthChecker
from kvpush.integrations.router.multi_turn import MultiTurn, TurnPlan
from kvpush.integrations.router.pool import Instance, Pool
from kvpush.integrations.router.prefill_tasks import PrefillTasks, race
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
from kvpush.integrations.router.stream import forward_stream
from kvpush.integrations.router.turns import TurnCosts, TurnRoute
from kvpush.integrations.router.upstream import UpstreamError, Upstreams, failure_cause, forward_headers, loop_time
from kvpush.observability.prometheus import TextExposition

log = logging.getLogger("kvpush.router")


class Proxy:
    """Serves client requests through P/D pairings (the module's failure policy), and counts them.

    Its collaborators come in explicitly: the pools, the upstream calls, the
    health checker (an instance that failed a request is checked at once),
    the metrics, and ``started`` (whether the router's HTTP session is open,
    so that no probe starts before it is open).
    """

    def __init__(
        self,
        config: RouterConfig,
        pools: tuple[Pool, Pool],
        up: Upstreams,
        health: HealthChecker,
        prom: TextExposition,
        started: Callable[[], bool],
    ) -> None:
        self.cfg = config
        self.prefill, self.decode = pools
        self.up = up
        self.health = health
        self.prom = prom  # latency, failures by cause, aborts
        self._started = started
        self.pending = 0  # client requests being proxied
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
        self.selector = Selector() if config.selective else None
        costs = TurnCosts(interference=config.turn_interference)
        self.turns = MultiTurn(costs=costs) if config.multi_turn else None
        self._probes: set[asyncio.Task[None]] = set()  # health checks of instances that just failed a request
        self.prefills = PrefillTasks(up, prom, self._suspect, lambda: self.selector is not None)

    async def serve(self, req: web.Request, endpoint: str) -> web.StreamResponse:
        """Answer one client request: its pairing, retried once where the policy allows."""
        self.counters["requests"] += 1
        try:
            body = await req.json()
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except (ValueError, json.JSONDecodeError) as e:
            self.counters["client_errors"] += 1
            return error(400, f"invalid JSON body: {e}", "invalid_request_error")
        refused = client_params_error(body, self.cfg.client_params)
        if refused is not None:
            self.counters["client_errors"] += 1
            return error(400, refused, "invalid_request_error", param="kv_transfer_params")
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
        return error(
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
        plan = self.turns.plan(body, self.prefill, self.decode, failed, self.selector) if self.turns else None
        choice = None
        if plan is not None and plan.held:  # a D holds the prompt's start: the turn route decides
            local = plan.turn.route is TurnRoute.D_ALONE
            d: Instance | None = plan.d
            p = None if local else self._prefill_for(plan, failed)
            self.prom.inc("kvpush_router_turn_routes_total", route=plan.turn.route.value)
        else:
            choice = self.selector.choose(body) if self.selector is not None else None
            local = choice is not None and choice.local
            p = None if local else self.prefill.pick(exclude=failed)
            d = self.decode.pick(exclude=failed)
        if (p is None and not local) or d is None:
            self.counters["unavailable"] += 1
            return unavailable(self.prefill, self.decode, self.cfg.health_interval) or error(
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
                if plan is not None:
                    self._learn_prefill(p, p_task, plan)
            # D's response headers (and, non-streamed, its whole body or, streamed,
            # its first chunk) race P: a P failure before then ends the pairing.
            d_resp = await race(p_task, self.up.open_decode(d, endpoint, d_body, headers))
            if not body.get("stream"):
                data = await race(p_task, self.up.read_decode(d, d_resp))
                self._first_byte(t_start, p_task, body)
                ok = True
                if plan is not None and self.turns is not None:
                    self.turns.served(d, plan, body, data)
                return web.Response(
                    body=data, status=d_resp.status, content_type=d_resp.content_type, headers={"X-Request-Id": tid}
                )
            first = await race(p_task, self.up.read_chunk(d, d_resp))
            self._first_byte(t_start, p_task, body)
            out, ok = await forward_stream(req, self.up, d, d_resp, first, tid, self._stream_cut)
            if ok and plan is not None and self.turns is not None:
                self.turns.served(d, plan, body, None)
            return out
        except UpstreamError as e:
            e.inst.failures += 1
            self._suspect(e)
            return e
        finally:
            self._end_attempt(p, p_task, d, d_resp, ok, t_start)

    def _prefill_for(self, plan: TurnPlan, failed: list[Instance]) -> Instance | None:
        """Today's path for a prompt a D holds the start of: the P holding the most of it (it computes less)
        unless another has less load, else the least-loaded."""
        least = self.prefill.pick(exclude=failed)
        if plan.p is not None and least is not None and plan.p.load <= least.load:
            return plan.p
        return least

    def _learn_prefill(self, p: Instance, p_task: asyncio.Task[dict[str, Any]], plan: TurnPlan) -> None:
        """Once P answered: it holds the prompt (the held index learns it)."""
        turns = self.turns

        def learn(t: asyncio.Task[dict[str, Any]]) -> None:
            if turns is not None and not t.cancelled() and t.exception() is None:
                turns.prefilled(p, plan, t.result())

        p_task.add_done_callback(learn)

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
        resp = error(503, why, "overloaded", retryable=True)
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
            self.prefills.settle(p, p_task, cancel=not ok)

    async def _start_pair(
        self, p: Instance, endpoint: str, body: dict[str, Any], tid: str, headers: dict[str, str]
    ) -> tuple[asyncio.Task[dict[str, Any]], dict[str, Any]]:
        """Send P its request; D's body, once D's parameters are known (at once, or from P's answer)."""
        mode = self.cfg.mode
        cap = capability_of(self.cfg.capability_key, tid)
        p_body = prefill_body(body, mode, tid, bound=bool(cap))
        p_body["kv_transfer_params"] = with_client_params(p_body["kv_transfer_params"], body)
        p_task = self.prefills.start(p, endpoint, p_body, headers)
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
            p_json, p_done = t.result(), self.prefills.answered_at(t, now)
            tokens = (p_json.get("usage") or {}).get("prompt_tokens")
            if isinstance(tokens, int):
                selector.observe_transfer(tokens, now - p_done)
                if isinstance(prompt, str):
                    selector.observe_prompt(len(prompt), tokens)

        if p_task.done():
            learn(p_task)
        else:
            p_task.add_done_callback(learn)

    def _stream_cut(self, err: UpstreamError) -> None:
        """D's stream broke after the client had bytes: book it (the stream itself ends with an error event)."""
        err.inst.failures += 1
        self.counters["decode_failures"] += 1
        self.prom.inc("kvpush_router_failures_total", role="decode", cause="stream_cut")
        self._suspect(err)
        log.error("%s (after streaming started; stream ended with an error event)", err)

    def _suspect(self, err: UpstreamError) -> None:
        """An instance failed a request with a 5xx-class failure: check its health now, so that a dead one
        leaves rotation before the next periodic check (a live one that merely failed this request stays)."""
        if not err.retryable or not err.inst.healthy or not self._started():
            return
        task = asyncio.create_task(self.health.check([err.inst]))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)
