"""The soak's network: two namespaces joined by a veth pair, so the link between P and the rest can be cut.

P runs in namespace ``<tag>-p``; D, the router, the single instance and the soak's own client run in
``<tag>-a`` (the soak re-runs itself there: :func:`command_inside`). Each namespace has its own loopback, and
the pair (``kvs-a`` at :data:`A_ADDR`, ``kvs-p`` at :data:`P_ADDR`) is the only way between them: the router
reaches P's HTTP port over it, D reaches P's side channel and P's WRITEs reach D over it. :meth:`Net.drop`
takes both ends down (nothing crosses either way, the TCP connections stay open and retransmit into
nothing), :meth:`Net.heal` brings them up again.

Why not P in a namespace joined to the host itself: the host end would be one more interface on a shared
machine, where other processes' UCX may pick it as a TCP rail; cutting it would cut them. Here nothing of the
host's network changes. The servers' UCX is told to use TCP over the pair only (:meth:`Net.ucx_env`): P and D
share this host's memory, and UCX would otherwise move bytes through shared memory, beside the network cut.

Needs root (``ip netns add``). A namespace of a soak whose process is gone is deleted by the next one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

NETNS_DIR = Path("/var/run/netns")
PREFIX = "kvpsoak"
A_ADDR, P_ADDR = "10.233.0.1", "10.233.0.2"
"""Private addresses on the pair, inside the soak's namespaces only."""
A_DEV, P_DEV = "kvs-a", "kvs-p"


class NoNamespaces(Exception):
    """This machine cannot make network namespaces (not root, no ``ip``, or the kernel refuses)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NoNamespaces(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _remove_stale() -> None:
    """Delete namespaces a soak left when it was killed (the pid in their name is gone)."""
    if not NETNS_DIR.is_dir():
        return
    for ns in NETNS_DIR.iterdir():
        parts = ns.name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            _ip("netns", "del", ns.name, check=False)


class Link:
    """The pair between namespaces ``a_ns`` and ``p_ns``, by name: what the soak inside namespace A cuts and
    heals."""

    def __init__(self, a_ns: str, p_ns: str) -> None:
        self.a_ns, self.p_ns = a_ns, p_ns

    @classmethod
    def parse(cls, inside: str) -> Link:
        """From ``--inside``'s value, ``A,P``."""
        a, _, p = inside.partition(",")
        if not a or not p:
            raise ValueError(f"--inside takes the namespaces' names as A,P, got {inside!r}")
        return cls(a, p)

    @property
    def names(self) -> str:
        return f"{self.a_ns},{self.p_ns}"

    def ends(self) -> list[tuple[str, str]]:
        return [(self.a_ns, A_DEV), (self.p_ns, P_DEV)]

    def drop(self) -> None:
        """Cut the pair: both ends down."""
        for ns, dev in self.ends():
            _ip("-n", ns, "link", "set", dev, "down")

    def heal(self) -> None:
        """Both ends up again (addresses and routes come back with them); returns once both have a carrier."""
        for ns, dev in self.ends():
            _ip("-n", ns, "link", "set", dev, "up")
        self.wait_carrier()

    def wait_carrier(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(" state UP " in _ip("-n", ns, "link", "show", dev).stdout for ns, dev in self.ends()):
            if time.monotonic() > deadline:
                raise NoNamespaces(f"the veth pair has no carrier after {timeout_s:g} s")
            time.sleep(0.05)


class Net(Link):
    """Makes the two namespaces and the pair (the module's docstring); :meth:`close` deletes them."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise NoNamespaces("not root: `ip netns add` needs CAP_SYS_ADMIN")
        _remove_stale()
        tag = f"{PREFIX}-{os.getpid()}"
        super().__init__(f"{tag}-a", f"{tag}-p")
        self._made: list[str] = []
        try:
            for ns in (self.a_ns, self.p_ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
            _ip("link", "add", A_DEV, "netns", self.a_ns, "type", "veth", "peer", "name", P_DEV, "netns", self.p_ns)
            for ns, dev, addr in ((self.a_ns, A_DEV, A_ADDR), (self.p_ns, P_DEV, P_ADDR)):
                # IPv4 only: no tentative IPv6 address for a transport to bind while the link comes up
                _ip("netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
            self.wait_carrier()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete both namespaces (and with them the pair); safe to call twice."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)


def ucx_env(dev: str) -> dict[str, str]:
    """What a server on the end ``dev`` of the pair sets: UCX over TCP on that device only."""
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}


def in_namespace(ns: str, cmd: Sequence[str]) -> list[str]:
    """``cmd`` run in network namespace ``ns`` (``ip netns exec``: a ``/sys`` of its own too)."""
    return ["ip", "netns", "exec", ns, *cmd]


def command_inside(net: Link, argv: Sequence[str]) -> list[str]:
    """The soak's command line re-run in namespace A, told both namespaces' names (``--inside A,P``)."""
    return in_namespace(net.a_ns, [sys.executable, "-m", "kvpush_tools.bench.soak", *argv, "--inside", net.names])
