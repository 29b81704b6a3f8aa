"""Fencing a P for good (sans-I/O): what ``kvpush fence`` asks of a D, what D's fence listener accepts, and the
line that tells an operator what to run.

D cannot tell a killed P from a frozen one, so it never gives back the blocks of a P it declared dead on a
timer (``kvpush.decode.incoming``): they stay withheld until that P answers again. A P gone for good (its
pod deleted, its process killed, and a new one started elsewhere) never does; the orchestrator or an operator
says so instead, as a cluster's STONITH fence does: ``kvpush fence --prefill HOST:PORT[/TP] --decode
HOST:FENCE_PORT ...`` sends each D a *fence request* over CURVE with the operator's key (only keys in D's
``fence/operators/`` are accepted), naming P instances by their side channel (rank 0's port) and TP size.
D then ends every writer on those ranks (``Fencing.fenced_for_good``) and the blocks go back to vLLM.

This module holds the request and the reply as bytes (a small JSON object, checked field by field: a bad
request is answered with what is wrong, never acted on) and the hint a D logs with a withheld quarantine.
Whoever holds an operator key can make D give back the blocks of a P that may still write them: keep it as
the orchestrator's, as the P fleet's key is P's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvpush.core.errors import ConfigError, ProtocolError
from kvpush.core.topology import ConnKey
from kvpush.decode.warm import parse_peer

MAX_REQUEST_BYTES = 16384
"""A fence request is a few addresses; anything longer is refused unread."""
MAX_TARGETS = 64
"""P instances one request may name."""
MAX_REASON = 200
"""Characters of the operator's reason D logs."""


@dataclass(frozen=True)
class Target:
    """One P instance: its side channel (rank 0's; rank r listens on ``port + r``) and its TP size."""

    host: str
    port: int
    tp_size: int = 1

    def ranks(self) -> set[ConnKey]:
        """The side channels of its ranks, as D names the P ranks it registers with."""
        return {(self.host, self.port + r) for r in range(self.tp_size)}

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" + (f"/{self.tp_size}" if self.tp_size != 1 else "")


@dataclass(frozen=True)
class FenceRequest:
    """P instances the operator declares gone for good, and why (logged by D)."""

    targets: tuple[Target, ...]
    reason: str


def parse_targets(entries: list[str] | tuple[str, ...], what: str = "--prefill") -> tuple[Target, ...]:
    """``HOST:PORT`` or ``HOST:PORT/TP`` entries -> targets (duplicates once); ``ConfigError`` naming a bad one."""
    if not entries:
        raise ConfigError(f"{what}: name at least one P instance (HOST:PORT or HOST:PORT/TP)")
    if len(entries) > MAX_TARGETS:
        raise ConfigError(f"{what}: {len(entries)} P instances, at most {MAX_TARGETS} in one fence")
    out: list[Target] = []
    for text in entries:
        t = Target(*parse_peer(text, what))
        if t not in out:
            out.append(t)
    return tuple(out)


def _clean_reason(reason: str) -> str:
    return "".join(c if c.isprintable() else " " for c in reason)[:MAX_REASON]


def encode_request(req: FenceRequest) -> bytes:
    """The request's bytes (what ``decode_request`` takes back)."""
    body = {"fence": [str(t) for t in req.targets], "reason": _clean_reason(req.reason)}
    return json.dumps(body).encode()


def decode_request(data: bytes) -> FenceRequest:
    """A fence request from the wire; ``ProtocolError`` saying what is wrong (never a partial request)."""
    if len(data) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"a fence request is at most {MAX_REQUEST_BYTES} bytes, got {len(data)}")
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a fence request is a JSON object: {exc}") from None
    if not isinstance(body, dict) or set(body) - {"fence", "reason"} or "fence" not in body:
        raise ProtocolError('a fence request is {"fence": ["HOST:PORT[/TP]", ...], "reason": "..."}')
    entries, reason = body["fence"], body.get("reason", "")
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ProtocolError('"fence" must be a list of "HOST:PORT" or "HOST:PORT/TP" strings')
    if not isinstance(reason, str):
        raise ProtocolError('"reason" must be a string')
    try:
        targets = parse_targets(entries, "fence entry")
    except ConfigError as exc:
        raise ProtocolError(str(exc)) from None
    return FenceRequest(targets, _clean_reason(reason))


def encode_reply(fenced: tuple[Target, ...] = (), error: str = "") -> bytes:
    """D's answer: the P instances it will fence (at its next step), or why it refused the request."""
    if error:
        return json.dumps({"ok": False, "error": error[:500]}).encode()
    return json.dumps({"ok": True, "fenced": [str(t) for t in fenced]}).encode()


def decode_reply(data: bytes) -> tuple[bool, str]:
    """(accepted, what D said) of a reply; an unreadable one is not accepted."""
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False, f"an unreadable reply ({len(data)} bytes)"
    if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
        return False, "a reply without ok"
    if body["ok"]:
        fenced = body.get("fenced")
        return True, "will fence " + ", ".join(str(f) for f in fenced) if isinstance(fenced, list) else "accepted"
    return False, str(body.get("error", "refused"))


def hint(conn: ConnKey, fence_port: int) -> str:
    """What an operator runs to give back the blocks a P rank ``conn`` withholds, if that P is gone for good."""
    host = f"[{conn[0]}]" if ":" in conn[0] else conn[0]
    if not fence_port:
        return (
            f"if P {host}:{conn[1]} is gone for good, set fence_port on this D and run `kvpush fence --prefill "
            f"{host}:{conn[1]} --decode THIS_HOST:FENCE_PORT` (docs/operability.md); a P started again at that "
            "address fences it too"
        )
    return (
        f"if P {host}:{conn[1]} is gone for good (killed, not frozen), run `kvpush fence --prefill "
        f"{host}:{conn[1]} --decode THIS_HOST:{fence_port} --keys KEYS_DIR` for every D (docs/operability.md); a P "
        "started again at that address fences it too"
    )
