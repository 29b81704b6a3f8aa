"""The client side of the serving benchmarks: streamed completions sent to a stack on a schedule, timed as
``vllm bench serve`` times them, and the stack warmed up and drained between runs.

Shared by ``kvpush bench serve`` (``serve``), its overload profile (``overload``) and the layer-wise and
idle benchmarks, which import it rather than each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpush_tools.bench.loadgen import RequestOutput
from kvpush_tools.bench.server_metrics import http_get
from kvpush_tools.bench.stack_build import MODEL_NAME
from kvpush_tools.bench.stacks import Stack


def request_body(prompt: str, output_len: int, model: str = MODEL_NAME) -> dict[str, Any]:
    """A streamed completion of exactly ``output_len`` tokens (``ignore_eos``),
    greedy, with the usage chunk that carries the token count."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_one(session: Any, url: str, body: dict[str, Any], prompt_len: int, t_run: float) -> RequestOutput:
    """One streamed request, timed as ``vllm bench serve`` times it: TTFT at the
    first chunk with a choice (its text may be empty), one ITL per later such
    chunk, latency to the last such chunk."""
    out = RequestOutput(prompt_len=prompt_len)
    st = time.perf_counter()
    out.start_time = st - t_run
    last = st
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return out
            buf = b""
            first = True
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.strip().removeprefix(b"data:").strip()
                    if not data or data.startswith(b":") or data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if msg.get("choices"):
                        out.text += str(msg["choices"][0].get("text") or "")
                        now = time.perf_counter()
                        if first:
                            out.ttft = now - st
                            first = False
                        else:
                            out.itl.append(now - last)
                        last = now
                    elif msg.get("usage"):
                        out.output_tokens = int(msg["usage"].get("completion_tokens") or 0)
                    elif msg.get("error"):
                        out.error = f"stream error: {str(msg['error'])[:300]}"
            if first:
                out.error = out.error or "no chunk with a choice (stream ended without output)"
            elif not out.error:
                out.ok = True
            out.latency = last - st
    except Exception as exc:  # the client must survive any server failure
        out.error = f"{type(exc).__name__}: {exc}"[:400]
    return out


async def run_load(
    url: str,
    prompts: Sequence[str],
    prompt_lens: Sequence[int],
    arrivals: Sequence[float],
    output_len: int,
    on_done: Callable[[RequestOutput], None] | None = None,
    timeout_s: float = 900.0,
) -> tuple[list[RequestOutput], float]:
    """Send ``prompts[i]`` at ``arrivals[i]`` seconds; returns outputs (in send
    order) and the duration from the first send to the last answer."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def launch(i: int) -> RequestOutput:
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            res = await send_one(session, url, request_body(prompts[i], output_len), prompt_lens[i], t0)
            if on_done is not None:
                on_done(res)
            return res

        outs = await asyncio.gather(*(launch(i) for i in range(len(prompts))))
        return list(outs), time.perf_counter() - t0


def warm_up(stack: Stack, input_len: int, seed: int, n: int = 2, tries: int = 4) -> dict[str, Any]:
    """After a resume: a few short requests until ``n`` succeed in a row.

    Resuming from SIGSTOP makes peers look silent for the paused time;
    connectors then re-handshake on the next request. That cost belongs to
    the pause, not to the mode, so it is paid here, outside the measurement.
    """
    from kvpush_tools.demo.words import prompt_words

    t0 = time.perf_counter()
    ok = failed = 0
    errors: list[str] = []
    for i in range(n + tries):
        body = request_body(prompt_words(min(input_len, 256), seed=seed + i), 4)
        res = asyncio.run(run_load(stack.url, [body["prompt"]], [0], [0.0], 4, timeout_s=120))[0][0]
        if res.ok:
            ok += 1
            if ok >= n:
                break
        else:
            failed += 1
            ok = 0
            errors.append(res.error[:200])
            time.sleep(1.0)
    return {"seconds": time.perf_counter() - t0, "failed": failed, "errors": errors}


def wait_drained(stack: Stack, timeout: float = 30.0) -> bool:
    """Until the router has no request or P request pending (P may answer
    after D's stream ended); True if it drained."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = http_get(stack.url + "/kvpush/pending", timeout=3.0)
        if status != 200:
            return True  # an attached router without this endpoint
        with contextlib.suppress(ValueError, KeyError):
            p = json.loads(body)
            if p["pending"] == 0 and p["pending_prefill"] == 0:
                return True
        time.sleep(0.2)
    return False
