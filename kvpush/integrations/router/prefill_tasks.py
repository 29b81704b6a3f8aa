"""P's request as an asyncio task: started, raced against D's calls, and settled once the pairing ends.

Rule: P's load (``Instance.in_flight``) and the pending-transfer gauge
follow P's task itself, not the pairing, since P may answer after D is done
or be cancelled before it ever ran; only a P *failure* while D's call is
still pending ends a pairing (``race``); a failed pairing cancels a P
request still running (vLLM aborts it and frees its blocks), a successful
one lets it finish in the background. Reason: D's answer never waits for
P's one-token reply, and a pairing that failed leaves nothing held on P.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

from kvpush.integrations.router.pool import Instance
from kvpush.integrations.router.upstream import UpstreamError, Upstreams, loop_time
from kvpush.observability.prometheus import TextExposition

log = logging.getLogger("kvpush.router")


class PrefillTasks:
    """P's requests in flight as tasks; ``pending`` counts them (the router's ``pending_prefill``)."""

    def __init__(
        self,
        up: Upstreams,
        prom: TextExposition,
        suspect: Callable[[UpstreamError], None],
        timed: Callable[[], bool],
    ) -> None:
        self._up = up
        self._prom = prom
        self._suspect = suspect  # an instance failed a request: check its health now
        self._timed = timed  # whether P's answer times are kept (the selector learns from them)
        self.pending = 0  # P requests in flight
        # P task -> when P answered (selective: where the transfer's time starts); gone with the task.
        self._answered: weakref.WeakKeyDictionary[asyncio.Task[dict[str, Any]], float] = weakref.WeakKeyDictionary()

    def start(
        self, p: Instance, endpoint: str, body: dict[str, Any], headers: dict[str, str]
    ) -> asyncio.Task[dict[str, Any]]:
        """Start P's request as a task. P's load and the pending-transfer
        gauge follow the task itself (not the pairing), since P may answer
        after D is done, or be cancelled before it ever ran."""
        p.in_flight += 1
        self.pending += 1
        task = asyncio.create_task(self._up.run_prefill(p, endpoint, body, headers))

        def done(t: asyncio.Task[dict[str, Any]]) -> None:
            p.in_flight -= 1
            self.pending -= 1
            if self._timed():
                self._answered[t] = loop_time()

        task.add_done_callback(done)
        return task

    def settle(self, p: Instance, task: asyncio.Task[dict[str, Any]], cancel: bool) -> None:
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
            self._prom.inc("kvpush_router_prefill_aborts_total")
        if task.done():
            done(task)
        else:
            task.add_done_callback(done)

    def answered_at(self, task: asyncio.Task[dict[str, Any]], default: float) -> float:
        """When P's ``task`` answered (forgotten once read), or ``default`` when its time was not kept."""
        return self._answered.pop(task, default)


async def race(p_task: asyncio.Task[dict[str, Any]] | None, d_coro: Any) -> Any:
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
