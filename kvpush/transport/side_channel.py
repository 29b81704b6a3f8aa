"""The side channel: ZMQ sockets for control messages between P and D.

P binds a ROUTER per rank; each D rank connects one DEALER per P rank it
talks to. Only the engine thread touches these sockets. Frames are
``kvpush.protocol`` messages; a frame that fails to decode is logged with the
sender and dropped, never raised into the loop.

Authentication (``kvpush.transport.auth``): with keys, P's socket is a CURVE
server behind a ZAP gate and D's a CURVE client that knows P's public key, so
no message reaches either side over a connection that did not prove its key,
and P learns for every message the D key it came from (``Received.key``).
``keys=None`` is ``"auth": "none"``: open to anyone who reaches the port,
which is logged as a warning when the socket is made.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvpush import protocol
from kvpush.errors import ConfigError, ProtocolError
from kvpush.transport import auth
from kvpush.transport.auth import LOG_EVERY_S, ClientKeys, Gate, ServerKeys, describe_client_failure

log = logging.getLogger(__name__)

ZMQ_MAX_MSG_BYTES = 2 * protocol.MAX_FRAME_BYTES
"""ZMQ's own cap, above the protocol's: a frame a little over the limit reaches
``protocol.decode`` and is logged with its size (a buggy peer gets a clear
line); a far larger one is cut by ZMQ, which drops the connection without
buffering it (a hostile peer gets no allocation)."""
HANDSHAKE_IVL_MS = 10_000
"""A connection that has not finished its handshake by then is dropped (ZMQ's default is 30 s):
half-open connections are what an unauthenticated flood can still make."""
OPEN_WARNING = (
    'side channel of %s runs WITHOUT authentication ("auth": "none"): any process that reaches %s can '
    "read and write this %s's registered KV cache through NIXL, and register, abort or hijack transfers"
)


def server_keys(cfg: Any) -> ServerKeys | None:
    """P's keys per its ``Config`` (``ConfigError`` naming what is missing); None, with a warning, for auth none."""
    keys = auth.server_keys(cfg.auth, cfg.auth_keys_dir)
    if keys is None:
        log.warning(OPEN_WARNING, "this P", "its port", "P")
    return keys


def client_keys(cfg: Any) -> ClientKeys | None:
    """D's keys per its ``Config`` (``ConfigError`` naming what is missing); None, with a warning, for auth none."""
    keys = auth.client_keys(cfg.auth, cfg.auth_keys_dir)
    if keys is None:
        log.warning(OPEN_WARNING, "this D", "a P's port posing as P", "D")
    return keys


class Received(NamedTuple):
    """One message P read: the ROUTER identity to answer, the D key it proved ("" without auth), the message."""

    ident: bytes
    key: str
    msg: Any


class Server:
    """P's ROUTER socket; replies go to the identity a message came from."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, keys: ServerKeys | None) -> None:
        self.gate = Gate(keys, f"{host}:{port}") if keys is not None else None
        self.sock = (self.gate.ctx if self.gate is not None else ctx).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if self.gate is not None:
            self.gate.secure(self.sock)
        try:
            if port == 0:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"side channel cannot bind {host}:{port}: {exc}") from None
        self.host, self.port = host, port
        if self.gate is not None:
            self.gate.label = f"{host}:{port}"

    def recv(self) -> list[Received]:
        """Drain pending frames; bad frames are logged and skipped."""
        out: list[Received] = []
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            if len(parts) != 2:
                log.warning("side channel %s:%s: dropped frame with %d parts", self.host, self.port, len(parts))
                continue
            ident, data = parts
            key = _user_id(data) if self.gate is not None else ""
            try:
                out.append(Received(ident.bytes, key, protocol.decode(data.buffer)))
            except ProtocolError as exc:
                log.warning("side channel %s:%s: rejected message from D key %s: %s", self.host, self.port, key, exc)

    def send(self, ident: bytes, msg: protocol.Message) -> bool:
        try:
            self.sock.send_multipart([ident, protocol.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.warning("side channel: cannot reach peer %r: %s", ident, exc)
            return False

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.gate is not None:
            self.gate.close()


def _user_id(frame: zmq.Frame) -> str:
    """The key the connection proved (the gate made it the user id); "" if ZMQ has none."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:
        return ""


class Client:
    """D's DEALER to one P rank.

    With keys it only ever talks to a P that holds the secret half of
    ``keys.server``: messages queued before the handshake (the hello, with D's
    NIXL metadata) are never sent to anyone else. A failed handshake is
    logged and kept in ``failure`` until a later handshake succeeds.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, keys: ClientKeys | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        self.monitor: zmq.Socket | None = None
        self.failure = ""
        self._logged = -1e9
        if keys is not None:
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            self.monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
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
        self._handshakes()
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

    def _handshakes(self) -> None:
        """Note the handshake outcomes the monitor reported since the last call."""
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failure = ""
                continue
            self.failure = describe_client_failure(event, self.host, self.port)
            now = time.monotonic()
            if now - self._logged >= LOG_EVERY_S:
                self._logged = now
                log.error("side channel: %s", self.failure)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
