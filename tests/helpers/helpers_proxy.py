"""A recording TCP proxy that understands ZMTP framing: what a man in the middle of the side channel sees.

Every connection to the proxy is forwarded to ``target``; the bytes the
client sends are cut into ZMTP units (the 64-byte greeting, then frames:
a flags byte, a 1- or 8-byte size, the body) and recorded, so a test can
replay a whole recorded stream on a fresh connection (:meth:`Proxy.replay`)
or inject a copy of one recorded frame into the live connection at a frame
boundary (:meth:`Proxy.inject`). It does not read or change the contents.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

GREETING = 64
COMMAND = 0x04
LONG = 0x02


@dataclass
class Conn:
    """One proxied connection: the client's units in order, and the socket to the target."""

    upstream: socket.socket
    units: list[bytes] = field(default_factory=list)
    """The greeting's pieces as the client sent them (each waits for the other side's), then frames."""
    greeting_parts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def frames(self, commands: bool = False) -> list[bytes]:
        """The recorded frames after the greeting (commands too with ``commands``)."""
        return [u for u in self.units[self.greeting_parts :] if commands or not u[0] & COMMAND]


def _cut(buf: bytearray) -> bytes | None:
    """The next complete ZMTP frame at the front of ``buf`` (removed), or None if it is not complete yet."""
    if len(buf) < 2:
        return None
    head = 9 if buf[0] & LONG else 2
    if len(buf) < head:
        return None
    size = int.from_bytes(buf[1:9], "big") if buf[0] & LONG else buf[1]
    if len(buf) < head + size:
        return None
    unit = bytes(buf[: head + size])
    del buf[: head + size]
    return unit


class Proxy:
    """Listens on a free port of 127.0.0.1; ``close`` ends every connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.conns: list[Conn] = []
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            conn = Conn(upstream)
            self.conns.append(conn)
            self._socks += [client, upstream]
            threading.Thread(target=self._up, args=(client, conn), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    def _up(self, client: socket.socket, conn: Conn) -> None:
        """Client to target: the greeting as it comes (its halves wait for the other side's), then
        whole frames at a time, so an injected frame lands between two."""
        buf, greeting = bytearray(), bytearray()
        while True:
            try:
                data = client.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                conn.upstream.close()
                return
            if len(greeting) < GREETING:
                part, data = data[: GREETING - len(greeting)], data[GREETING - len(greeting) :]
                greeting += part
                conn.units.append(part)
                conn.greeting_parts += 1
                with conn.lock:
                    try:
                        conn.upstream.sendall(part)
                    except OSError:
                        return
            buf += data
            while (unit := _cut(buf)) is not None:
                conn.units.append(unit)
                with conn.lock:
                    try:
                        conn.upstream.sendall(unit)
                    except OSError:
                        return

    @staticmethod
    def _down(upstream: socket.socket, client: socket.socket) -> None:
        while True:
            try:
                data = upstream.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                client.close()
                return
            try:
                client.sendall(data)
            except OSError:
                return

    def inject(self, conn: Conn, unit: bytes) -> None:
        """Send ``unit`` (a recorded frame) to the target again, inside the live connection."""
        with conn.lock:
            conn.upstream.sendall(unit)

    def replay(self, conn: Conn, pause_s: float = 0.05) -> socket.socket:
        """A fresh connection to the target carrying every unit ``conn``'s client sent, paced as a
        client would (ZMQ reads the greeting in steps); left open. Stops early if the target hangs up."""
        s = socket.create_connection(self.target)
        self._socks.append(s)
        for unit in conn.units:
            try:
                s.sendall(unit)
            except OSError:
                break  # the target hung up: it rejected what it read so far
            time.sleep(pause_s)
        return s

    def close(self) -> None:
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
