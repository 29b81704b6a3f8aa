"""Forwarding D's stream to the client once it has bytes: whole events only, and an error event if D breaks.

Rule: from D's first chunk on the client has bytes, so a later D failure can
no longer be retried, only reported: server-sent events go out whole (the
start of one waits for its end), and a break (an upstream error, or D's
connection closing without ``data: [DONE]``) ends the stream with one error
event, marked retryable, in place of ``data: [DONE]``, never inside a
half-sent event. Reason: a client's SSE parser then always sees whole JSON
events, and the last one tells it whether the answer is complete. The books
of a break (counters, the health probe) are the caller's (``pairing``),
kept before the error event goes out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvpush.integrations.router.pool import Instance
from kvpush.integrations.router.upstream import UpstreamError, Upstreams

DONE_EVENT = b"data: [DONE]"  # the last event of every vLLM stream


async def forward_stream(
    req: web.Request,
    up: Upstreams,
    d: Instance,
    d_resp: aiohttp.ClientResponse,
    first: bytes,
    tid: str,
    on_cut: Callable[[UpstreamError], None],
) -> tuple[web.StreamResponse, bool]:
    """Send D's stream to the client unchanged, starting with ``first``; True if it ended normally.

    A cut is booked (``on_cut``) before the error event goes out, so the
    router's counters already show it when the client reads the event."""
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
            chunk = await up.read_chunk(d, d_resp)
        if events and not (sent + held).rstrip().endswith(DONE_EVENT):
            # D's connection closed cleanly mid-stream (a process killed between chunks can look so).
            raise UpstreamError(d, "decode", "the stream ended without data: [DONE]")
    except UpstreamError as e:
        on_cut(e)
        if events:
            await write_error_event(out, e)
        return out, False
    if held:
        await out.write(held)
    await out.write_eof()
    return out, True


async def write_error_event(out: web.StreamResponse, err: UpstreamError) -> None:
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
