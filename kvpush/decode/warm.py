"""Which P ranks D says hello to at start, before any request (pure).

A link to a P rank (``kvpush.decode.link``) opens at the first registration that needs it: the hello, P
loading D's NIXL metadata and preparing its lists for D, and NIXL's first connection are then on that
request's path (about half a second in the demo). A D configured with the P instances it serves
(``prefill_peers``) opens those links at start instead, so its first request is as fast as its hundredth;
the P ranks are the ones that write this D rank (``kvpush.core.topology.writer_channels``), each only if D
may dial it (``allowed_prefills``).
"""

from __future__ import annotations

import re

from kvpush.core.errors import ConfigError
from kvpush.core.topology import ConnKey, writer_channels
from kvpush.decode.allow import Allowed

_PEER = re.compile(
    r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>[0-9]{1,5})(?:/(?P<tp>[0-9]{1,4}))?$", re.ASCII
)


def parse_peer(text: str, what: str = "prefill_peers entry") -> tuple[str, int, int]:
    """``HOST:PORT`` or ``HOST:PORT/TP`` -> (host, port, P's TP size); ``ConfigError`` naming a bad entry
    (``what``: how the error names it)."""
    m = _PEER.match(text.strip())
    if m is None:
        raise ConfigError(f"{what} {text!r}: expected HOST:PORT or HOST:PORT/TP")
    port, tp = int(m["port"]), int(m["tp"] or 1)
    if not 1 <= port <= 65535 or not 1 <= tp <= 4096 or port + tp - 1 > 65535:
        raise ConfigError(f"{what} {text!r}: the port must be 1-65535 and TP 1-4096 (its ranks' ports too)")
    return m["host"].strip("[]"), port, tp


def warm_links(
    peers: tuple[str, ...], rank: int, tp_size: int, num_heads: int, allowed: Allowed
) -> tuple[list[ConnKey], list[str]]:
    """The P ranks this D rank says hello to at start, and why any configured one is left out (not allowed)."""
    keys: list[ConnKey] = []
    skipped: list[str] = []
    for text in peers:
        host, port, p_tp = parse_peer(text)
        for conn in writer_channels(host, port, p_tp, rank, tp_size, num_heads).values():
            why = allowed.why_not(*conn)
            if why:
                skipped.append(why)
            elif conn not in keys:
                keys.append(conn)
    return keys, skipped
