"""Two network namespaces joined by a veth pair, made and removed by a test: a P and a D on "two hosts"
whose network the test can cut and heal.

``Net`` makes namespaces ``<prefix>-p`` and ``<prefix>-d`` (``ip netns add``) and a veth pair created
directly inside them (it never appears among the host's own interfaces), with private addresses that exist
only in those namespaces (``P_ADDR``, ``D_ADDR``); nothing is ever sent to an address outside them.
``drop`` takes both ends of the pair down (no frame crosses, in either direction; the TCP connections over
it stay open, retransmitting into nothing) and ``heal`` brings them up again. ``close`` deletes the
namespaces, which deletes the pair: a ``with`` block does it on failure too, and a new ``Net`` first
deletes what a killed run of this helper left (namespaces whose creating process is gone).

A worker process enters a namespace with :func:`enter` before it starts anything (``procs.Node(netns=...)``
calls it first thing in the spawned process): ``setns`` moves the calling thread only, so it must run
before the process's first other thread; every thread started afterwards (the engine's, ZMQ's, UCX's and
libfabric's) is in the namespace. Its mount namespace is made private and ``/sys`` mounted afresh, as
``ip netns exec`` does, so that ``/sys/class/net`` shows the namespace's own devices to the transports that
read it.

Each worker is also told which device to use (``transport_env``): UCX only ``tcp`` over the veth (P and D
share this host's memory and IPC namespace, so UCX would otherwise move the bytes through shared memory,
beside the network the test cuts), libfabric's tcp provider the veth.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

NETNS_DIR = Path("/var/run/netns")
PREFIX = "kvpnet"
P_ADDR, D_ADDR = "10.231.0.1", "10.231.0.2"
"""Private addresses on the veth pair, inside the test's namespaces only."""
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_PRIVATE, MNT_DETACH = 0x4000, 1 << 18, 2


class NoNamespaces(Exception):
    """This machine cannot make network namespaces (not root, no ``ip``, or the kernel refuses)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _remove_stale() -> None:
    """Delete the namespaces a run of this helper left when it was killed (its pid is gone)."""
    if not NETNS_DIR.is_dir():
        return
    for ns in NETNS_DIR.iterdir():
        parts = ns.name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            _ip("netns", "del", ns.name, check=False)


class Net:
    """P's and D's namespaces and the veth pair between them (see the module's docstring)."""

    def __init__(self) -> None:
        if shutil.which("ip") is None:
            raise NoNamespaces("no `ip` command (iproute2)")
        _remove_stale()
        tag = f"{PREFIX}-{os.getpid()}"
        self.p_ns, self.d_ns = f"{tag}-p", f"{tag}-d"
        # veth names are at most 15 characters; each lives only in its namespace, so they need not be unique
        self.p_dev, self.d_dev = "kvp-p", "kvp-d"
        self._made: list[str] = []
        try:
            for ns in (self.p_ns, self.d_ns):
                _ip("netns", "del", ns, check=False)  # left by an earlier Net of this process
                made = _ip("netns", "add", ns, check=False)
                if made.returncode != 0:
                    raise NoNamespaces(f"`ip netns add {ns}` failed: {made.stderr.strip()}")
                self._made.append(ns)
            _ip(
                "link",
                "add",
                self.p_dev,
                "netns",
                self.p_ns,
                "type",
                "veth",
                "peer",
                "name",
                self.d_dev,
                "netns",
                self.d_ns,
            )
            for ns, dev, addr in ((self.p_ns, self.p_dev, P_ADDR), (self.d_ns, self.d_dev, D_ADDR)):
                # IPv4 only: an IPv6 link-local address is tentative for a while after the link comes up, and
                # libfabric's tcp provider, listing the device's addresses, may bind it then (fi_enable fails)
                _ip("netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6")
                _ip("netns", "exec", ns, "sh", "-c", f"echo 1 > /proc/sys/net/ipv6/conf/{dev}/disable_ipv6")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
            self._wait_carrier()
        except BaseException:
            self.close()
            raise

    def ends(self) -> list[tuple[str, str]]:
        """The pair's two ends: (namespace, device) of P's, then of D's."""
        return [(self.p_ns, self.p_dev), (self.d_ns, self.d_dev)]

    def drop(self) -> None:
        """Cut the pair: both ends down, nothing crosses in either direction."""
        for ns, dev in self.ends():
            _ip("-n", ns, "link", "set", dev, "down")

    def heal(self) -> None:
        """Both ends up again: their addresses and routes come back with them. Returns once frames cross."""
        for ns, dev in self.ends():
            _ip("-n", ns, "link", "set", dev, "up")
        self._wait_carrier()

    def _wait_carrier(self, timeout_s: float = 10.0) -> None:
        """Until both ends are up with a carrier (a veth end has one once its peer is up too)."""
        deadline = time.monotonic() + timeout_s
        while not all(" state UP " in _ip("-n", ns, "link", "show", dev).stdout for ns, dev in self.ends()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth pair has no carrier after {timeout_s}s")
            time.sleep(0.01)

    def on_the_way_to_d(self, besides_port: int = 0) -> int:
        """Bytes P sent D over TCP that D's process has not read yet: unacknowledged in P's socket queues (a
        closed socket's included: the kernel keeps sending what it holds) or unread in D's. 0 once whatever was
        on the way when the network healed has arrived, or was dropped with its connection. ``besides_port``:
        leave out the connections to P's port of that number (its side channel, whose words are always on the
        way)."""
        total = 0
        for ns, peer, queue, p_port in ((self.p_ns, D_ADDR, 2, 3), (self.d_ns, P_ADDR, 1, 4)):
            for line in _ip("netns", "exec", ns, "ss", "-tnH", "dst", peer).stdout.splitlines():
                cols = line.split()  # state, Recv-Q, Send-Q, local address:port, peer address:port
                if len(cols) >= 5 and not (besides_port and cols[p_port].rsplit(":", 1)[1] == str(besides_port)):
                    total += int(cols[queue])
        return total

    def transport_env(self, side: str) -> dict[str, str]:
        """What a worker on ``side`` (``"p"``, ``"d"``) sets before its first NIXL agent: the transports over
        the veth alone."""
        dev = self.p_dev if side == "p" else self.d_dev
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev, "FI_TCP_IFACE": dev}

    def close(self) -> None:
        """Delete both namespaces (and with them the pair); safe to call twice."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def enter(netns: str, env: dict[str, str]) -> None:
    """Move this process (its only thread: call it first thing) into network namespace ``netns`` with a
    ``/sys`` of its own, as ``ip netns exec`` does, and set ``env``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({netns})")
    finally:
        os.close(fd)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    # private mounts from here on (nothing of ours reaches the host's), then a /sys showing this namespace
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.umount2(b"/sys", MNT_DETACH) == 0:
        libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None)
    os.environ.update(env)
