"""Client side of the fleet fault tests: requests whose every ending is recorded, and killing and restarting
an instance of the fleet.

A request through a router ends one of four ways, and the tests assert which:
its whole answer (``done``), an HTTP error status with the router's error
body, a stream that ends with an error event (``data: {"error": ...}``), or
a connection that just ends (``broken``: neither ``data: [DONE]`` nor an
error). Each is recorded with the time it took, so a test can tell a fast
failure from a hang (the client's timeout).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from kvpush_tools.demo import launcher


@dataclass
class Outcome:
    """How one request ended."""

    status: int = 0
    text: str = ""  # the completion's text (streamed: the events' texts joined)
    done: bool = False  # the whole answer came (streamed: up to ``data: [DONE]``)
    error: dict[str, Any] | None = None  # the error object of an error status's body or of the stream's error event
    broken: str = ""  # the connection ended without an answer or an error (what the client saw)
    seconds: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)  # streamed: the first text arrived
    ended_at: float = 0.0  # time.monotonic() at the end

    @property
    def retryable_error(self) -> bool:
        """An error that says the request may be sent again: HTTP 5xx, or an error event marked retryable."""
        if self.error is None:
            return False
        return self.status >= 500 or bool(self.error.get("retryable"))

    def words(self, n: int) -> list[str]:
        return self.text.split()[:n]


def request(base: str, body: dict[str, Any], out: Outcome, timeout: float = 120.0) -> Outcome:
    """POST ``body`` to ``base``'s ``/v1/completions`` and record how it ended in ``out``."""
    url = urllib.parse.urlsplit(base)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        out.status = r.status
        if r.status != 200:
            raw = r.read()
            try:
                out.error = json.loads(raw).get("error") or {"message": raw[:500].decode("utf-8", "replace")}
            except (ValueError, AttributeError):
                out.error = {"message": raw[:500].decode("utf-8", "replace")}
        elif body.get("stream"):
            _read_events(r, out)
        else:
            answer = json.loads(r.read())
            out.text, out.done = answer["choices"][0]["text"], True
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.broken = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        out.ended_at = time.monotonic()
        out.seconds = out.ended_at - t0
        out.started.set()  # nobody waits for a first text that will not come
    return out


def _read_events(r: http.client.HTTPResponse, out: Outcome) -> None:
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.done = True
            return
        event = json.loads(line[6:])
        if "error" in event:
            out.error = event["error"]
            return
        out.text += event["choices"][0].get("text") or ""
        out.started.set()
    if not out.done and out.error is None:
        out.broken = "the stream ended without data: [DONE] or an error event"


def start(base: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[Outcome, threading.Thread]:
    """``request`` in a thread; the caller joins it."""
    out = Outcome()
    t = threading.Thread(target=request, args=(base, body, out, timeout), daemon=True)
    t.start()
    return out, t


def freeze(proc: launcher.ServerProcess) -> None:
    """SIGSTOP the server's whole process group: it holds its connections and answers nothing."""
    assert proc.proc is not None
    os.killpg(proc.proc.pid, signal.SIGSTOP)


def kill(proc: launcher.ServerProcess) -> None:
    """SIGKILL the server's whole process group (an instance lost, not shut down)."""
    assert proc.proc is not None
    os.killpg(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait(timeout=30)


def restarted(proc: launcher.ServerProcess, timeout: float = 60.0) -> launcher.ServerProcess:
    """The same server (command, ports, environment) started again, once the killed one's ports are free (a
    killed process lets go of its sockets only when it has finished exiting); the caller waits for it to be
    healthy."""
    deadline = time.monotonic() + timeout
    while busy := [p for p in proc.ports if not launcher.port_is_free(p)]:
        if time.monotonic() > deadline:
            raise launcher.ServerError(f"{proc.name}: port(s) {busy} still in use {timeout:g} s after it was killed")
        time.sleep(0.2)
    return dataclasses.replace(proc, proc=None, started_at=0.0, ready_after=None).start()
