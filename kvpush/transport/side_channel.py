"""The side channel: ZMQ sockets for control messages between P and D.

P binds a ROUTER per rank; each D rank connects one DEALER per P rank it
talks to. Only the engine thread touches these sockets. Frames are
``kvpush.protocol`` messages; a frame that fails to decode is logged with the
sender and dropped, never raised into the loop.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from kvpush import protocol
from kvpush.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

ZMQ_MAX_MSG_BYTES = 2 * protocol.MAX_FRAME_BYTES
"""ZMQ's own cap, above the protocol's: a frame a little over the limit reaches
``protocol.decode`` and is logged with its size (a buggy peer gets a clear
line); a far larger one is cut by ZMQ, which drops the connection without
buffering it (a hostile peer gets no allocation)."""


class Server:
    """P's ROUTER socket; replies go to the identity a message came from."""

    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        try:
            if port == 0:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close()
            raise ConfigError(f"side channel cannot bind {host}:{port}: {exc}") from None
        self.host, self.port = host, port

    def recv(self) -> list[tuple[bytes, Any]]:
        """Drain pending frames as (identity, message); bad frames are logged and skipped."""
        out: list[tuple[bytes, Any]] = []
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            if len(parts) != 2:
                log.warning("side channel %s:%s: dropped frame with %d parts", self.host, self.port, len(parts))
                continue
            ident, data = parts
            try:
                out.append((ident, protocol.decode(data)))
            except ProtocolError as exc:
                log.warning("side channel %s:%s: rejected message: %s", self.host, self.port, exc)

    def send(self, ident: bytes, msg: protocol.Message) -> bool:
        try:
            self.sock.send_multipart([ident, protocol.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.warning("side channel: cannot reach peer %r: %s", ident, exc)
            return False

    def close(self) -> None:
        self.sock.close(linger=0)


class Client:
    """D's DEALER to one P rank."""

    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        self.sock.connect(f"tcp://{host}:{port}")
        self.host, self.port = host, port

    def send(self, msg: protocol.Message) -> bool:
        try:
            self.sock.send(protocol.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.warning("side channel to %s:%s: send failed: %s", self.host, self.port, exc)
            return False

    def recv(self) -> list[Any]:
        out: list[Any] = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(protocol.decode(data))
            except ProtocolError as exc:
                log.warning("side channel from %s:%s: rejected message: %s", self.host, self.port, exc)

    def close(self) -> None:
        self.sock.close(linger=0)
