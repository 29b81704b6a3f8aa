"""Which P side channels a D may dial (pure: addresses in, verdicts out).

A request names its P (``remote_host``/``remote_port``); a client that
reaches D's HTTP port directly could name any address and make D open a TCP
connection there (CURVE then fails, but the dial happened: a port scan from
D's network position). With ``allowed_prefills`` in D's config, D dials only
the listed P instances, and a request naming another fails before any
connection, saying which address was refused.

Entries: ``ADDR``, ``ADDR:PORT`` or ``ADDR:LO-HI`` where ``ADDR`` is a host
name (compared as written: D resolves nothing to decide), an IP address or a
network in CIDR notation; IPv6 in brackets when a port follows. A P instance
of TP size t listens on ``port`` to ``port + t - 1``: list its range, or its
address alone.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kvpush.core.errors import ConfigError

_BRACKETED = re.compile(r"^\[(?P<addr>[^\]]+)\](?::(?P<lo>\d+)(?:-(?P<hi>\d+))?)?$")
_PLAIN = re.compile(r"^(?P<addr>[^:\[\]\s]+)(?::(?P<lo>\d+)(?:-(?P<hi>\d+))?)?$")
_BARE_V6 = re.compile(r"^(?P<addr>[0-9a-fA-F:.]+(?:/\d+)?)$")
_NO_PORT = {"lo": None, "hi": None}


@dataclass(frozen=True)
class Entry:
    """One allowed address (a name or a network) and port range."""

    name: str = ""
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    lo: int = 1
    hi: int = 65535

    def admits(self, host: str, port: int) -> bool:
        if not self.lo <= port <= self.hi:
            return False
        if self.network is None:
            return host.lower() == self.name
        ip = _ip(host)
        return ip is not None and ip.version == self.network.version and ip in self.network


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def parse_entry(text: str) -> Entry:
    """One entry of ``allowed_prefills``; ``ConfigError`` naming it when it is not one."""
    raw = text.strip()
    pattern = _BRACKETED if raw.startswith("[") else _BARE_V6 if raw.count(":") > 1 else _PLAIN
    m = pattern.match(raw)
    if m is None:
        raise ConfigError(f"allowed_prefills entry {text!r}: expected ADDR, ADDR:PORT or ADDR:LO-HI")
    parts = {**_NO_PORT, **m.groupdict()}
    addr, lo_s, hi_s = parts["addr"].lower(), parts["lo"], parts["hi"]
    lo = int(lo_s) if lo_s else 1
    hi = int(hi_s) if hi_s else (lo if lo_s else 65535)
    if not 1 <= lo <= hi <= 65535:
        raise ConfigError(f"allowed_prefills entry {text!r}: ports must be 1-65535, the range low to high")
    try:
        network = ipaddress.ip_network(addr, strict=False)
    except ValueError:
        if "/" in addr or not addr:
            raise ConfigError(f"allowed_prefills entry {text!r}: {addr!r} is not a network") from None
        return Entry(name=addr, lo=lo, hi=hi)
    return Entry(network=network, lo=lo, hi=hi)


@dataclass(frozen=True)
class Allowed:
    """D's allow-list of P side channels; empty admits every address (the router names P)."""

    entries: tuple[Entry, ...] = ()

    @classmethod
    def parse(cls, texts: tuple[str, ...] | list[str]) -> Allowed:
        return cls(tuple(parse_entry(t) for t in texts))

    def why_not(self, host: str, port: int) -> str:
        """Why D may not dial ``host:port`` ("" if it may)."""
        if not self.entries or any(e.admits(host, port) for e in self.entries):
            return ""
        return f"P side channel {host}:{port} is not in this D's allowed_prefills; D did not connect"
