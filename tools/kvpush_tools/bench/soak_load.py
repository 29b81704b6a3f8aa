"""The soak's load: a fixed set of prompts, a plan of which request asks which prompt and how (one answer,
streamed, or streamed and closed by the client), the references from the single instance, and the clients.

Every request is greedy with a fixed ``max_tokens`` (``ignore_eos``), so each prompt has one right answer,
computed once on the single instance; a request's text is compared with its prompt's. A few clients send one
request after another (a fixed concurrency, not a rate: the soak counts requests, it does not time them). A
client whose request failed waits until the router is healthy again before its next one, as a client that
honours the router's ``Retry-After`` would: a fault then costs the requests in flight, not the whole plan.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpush_tools.bench.soak_rules import ABORTED, FAILED, MISMATCH, OK, Record
from kvpush_tools.demo.words import prompt_words

KINDS = ("plain", "stream", "abort-early", "abort-mid")


def prompt_lengths(n: int, lo: int, hi: int) -> list[int]:
    """``n`` prompt lengths from ``lo`` to ``hi`` tokens, evenly spaced on a log scale (as many short
    prompts as long ones, by ratio)."""
    if n < 2:
        return [lo] * n
    return [round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)]


def prompts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """The prompt set: distinct texts (distinct seeds) of :func:`prompt_lengths` tokens."""
    return [prompt_words(length, seed=seed * 1000 + i) for i, length in enumerate(prompt_lengths(n, lo, hi))]


@dataclass(frozen=True)
class Spec:
    """One planned request: its prompt, its kind (:data:`KINDS`), and for ``abort-early`` when the client
    closes it (seconds after sending, whatever arrived)."""

    index: int
    prompt: int
    kind: str
    abort_after_s: float = 0.0


def plan(n: int, n_prompts: int, abort_share: float, stream_share: float, seed: int) -> list[Spec]:
    """``n`` requests: prompts drawn uniformly, ``abort_share`` of them closed by the client (half after a
    delay of 0.05-1 s, which lands anywhere from P's prefill to D's decode, half at the first text), and of
    the rest ``stream_share`` streamed to their end, the others answered at once. Deterministic in ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randrange(n_prompts)
        if rng.random() < abort_share:
            early = rng.random() < 0.5
            out.append(Spec(i, prompt, "abort-early" if early else "abort-mid", round(rng.uniform(0.05, 1.0), 3)))
        else:
            out.append(Spec(i, prompt, "stream" if rng.random() < stream_share else "plain"))
    return out


def body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy completion of exactly ``max_tokens`` tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


def references(url: str, texts: Sequence[str], model: str, max_tokens: int, timeout: float = 300.0) -> list[str]:
    """Each prompt's answer from the single instance at ``url``, one request at a time."""
    out = []
    for text in texts:
        req = urllib.request.Request(
            url + "/v1/completions",
            json.dumps(body(model, text, max_tokens, False)).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out.append(json.loads(r.read())["choices"][0]["text"])
    return out


def _events(buf: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Whole server-sent events of ``buf`` as JSON, and what is left of it."""
    out = []
    while b"\n\n" in buf:
        event, buf = buf.split(b"\n\n", 1)
        data = event.strip().removeprefix(b"data:").strip()
        if data and not data.startswith(b":") and data != b"[DONE]":
            out.append(json.loads(data))
    return out, buf


async def _read(r: Any, spec: Spec, rec: Record) -> str | None:
    """The answer's text (None: the client closed it, or it failed: ``rec`` says which)."""
    if r.status != 200:
        rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
        return None
    if spec.kind == "plain":
        choice = (await r.json())["choices"][0]
        return _finished(rec, choice.get("finish_reason"), str(choice["text"]))
    text, buf, finish = [], b"", None
    async for chunk in r.content.iter_any():
        events, buf = _events(buf + chunk)
        for msg in events:
            if msg.get("error"):
                rec.error = f"stream error: {str(msg['error'])[:200]}"
                return None
            for choice in msg.get("choices") or ():
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
            if spec.kind == "abort-mid" and "".join(text) and finish is None:
                r.close()  # the client goes away mid-stream: the connection closes under the router
                rec.outcome = ABORTED
                return None
    return _finished(rec, finish, "".join(text))


def _finished(rec: Record, finish: str | None, text: str) -> str | None:
    """The text of an answer that ended as asked (``length``: ``max_tokens`` reached, or ``stop``); None with
    the reason in ``rec`` for any other end (vLLM's ``error`` for a failed KV load, ``abort`` for a request
    its engine dropped): those are failures, not texts to compare."""
    if finish in ("length", "stop"):
        return text
    rec.error = f"finish_reason {finish}"
    return None


async def one(
    session: Any, url: str, spec: Spec, payload: dict[str, Any], want: str, t0: float, timeout_s: float
) -> Record:
    """Send one planned request and judge it (:mod:`kvpush_tools.bench.soak_rules`' outcomes)."""
    rec = Record(spec.index, spec.prompt, spec.kind, start=time.monotonic() - t0)
    whole = asyncio.timeout(timeout_s)
    early = asyncio.timeout(spec.abort_after_s if spec.kind == "abort-early" else None)
    try:
        async with whole, early, session.post(url + "/v1/completions", json=payload) as r:
            text = await _read(r, spec, rec)
        if text is not None:
            rec.outcome = OK if text == want else MISMATCH
            if rec.outcome == MISMATCH:
                rec.error = f"got {text[:80]!r}, want {want[:80]!r}"
    except TimeoutError:
        if early.expired():
            rec.outcome = ABORTED
        else:
            rec.timed_out, rec.error = True, f"no answer within {timeout_s:g} s"
    except Exception as exc:  # a client survives any server failure; the record says what it was
        rec.outcome, rec.error = FAILED, f"{type(exc).__name__}: {exc}"[:200]
    rec.end = time.monotonic() - t0
    return rec


class Load:
    """The clients: ``concurrency`` of them take the plan's requests in turn. ``sent`` and ``ended`` count as
    they go (the faults and the sampler read them); :meth:`halt` stops the sending."""

    def __init__(
        self,
        url: str,
        specs: Sequence[Spec],
        texts: Sequence[str],
        refs: Sequence[str],
        make_body: Callable[[str, bool], dict[str, Any]],
        healthy: Callable[[], bool],
        concurrency: int,
        timeout_s: float,
        log: Path | None = None,
    ) -> None:
        self.url, self.specs, self.texts, self.refs = url, specs, texts, refs
        self.log = log
        """Where each request's record is appended as it ends (one JSON line), so a run cut short keeps them."""
        self.make_body, self.healthy = make_body, healthy
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.records: list[Record] = []
        self.sent = self.ended = 0
        self.stopped = threading.Event()
        self.why_halted = ""

    def halt(self, why: str) -> None:
        self.why_halted = self.why_halted or why
        self.stopped.set()

    async def _wait_healthy(self, patience_s: float = 1800.0) -> None:
        deadline = time.monotonic() + patience_s
        while not self.stopped.is_set():
            if await asyncio.to_thread(self.healthy):
                return
            if time.monotonic() > deadline:
                self.halt(f"the router was not healthy for {patience_s:g} s after a failure")
                return
            await asyncio.sleep(1.0)

    async def _client(self, session: Any, t0: float) -> None:
        while not self.stopped.is_set() and self.sent < len(self.specs):
            spec = self.specs[self.sent]
            self.sent += 1
            payload = self.make_body(self.texts[spec.prompt], spec.kind != "plain")
            rec = await one(session, self.url, spec, payload, self.refs[spec.prompt], t0, self.timeout_s)
            self.records.append(rec)
            self.ended += 1
            if self.log is not None:
                with self.log.open("a") as f:
                    f.write(json.dumps(asdict(rec)) + "\n")
            if rec.outcome == FAILED:
                await self._wait_healthy()

    async def run(self, t0: float) -> None:
        """Until the plan is sent and answered, or :meth:`halt`."""
        import aiohttp

        connector, no_limit = aiohttp.TCPConnector(limit=0), aiohttp.ClientTimeout(total=None)  # one() times
        async with aiohttp.ClientSession(connector=connector, timeout=no_limit) as session:
            await asyncio.gather(*(self._client(session, t0) for _ in range(self.concurrency)))
