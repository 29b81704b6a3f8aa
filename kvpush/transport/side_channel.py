"""The side channel: ZMQ sockets for control messages between P and D.

P binds a ROUTER per rank; each D rank connects one DEALER per P rank it
talks to. Only the engine thread touches these sockets. Frames are
``kvpush.core.protocol`` messages; a frame that fails to decode is logged with the
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
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvpush.core import protocol
from kvpush.core.errors import ConfigError, ProtocolError
from kvpush.core.limits import Budgets, Throttle, Verdict
from kvpush.transport import auth, key_set
from kvpush.transport.auth import LOG_EVERY_S, Gate, describe_client_failure
from kvpush.transport.key_set import ClientKeys, ServerKeys

log = logging.getLogger(__name__)

ZMQ_MAX_MSG_BYTES = protocol.MAX_FRAME_BYTES + (64 << 10)
"""ZMQ's own cap, a little above the protocol's: a frame just over the limit
reaches ``protocol.decode`` and is logged with its size (a buggy peer gets a
clear line); a larger one is cut by ZMQ, which drops the connection without
buffering it (a hostile peer gets no allocation)."""
SNDHWM = 10_000
"""Answers P queues per connection: a peer that sends but never reads (a flood) costs at most this many
(each a few hundred bytes); beyond it P's answers to that connection are dropped and counted."""
RCVHWM = 8
"""Frames ZMQ holds per connection before the engine reads them; beyond that ZMQ stops reading the
socket (TCP pushes back on the sender, nothing is lost). Bounds what one connection can make this
side hold to ``RCVHWM * ZMQ_MAX_MSG_BYTES`` while the engine decodes (it drains every frame at each
wake-up): a peer sending frames of the largest size fills it whenever one of them is being decoded."""
STEP_FRAMES = 1024
STEP_BYTES = 16 << 20
"""What one engine step reads from the side channel at most (frames, and bytes of frames decoded)."""
REJECTED_LINES = 10
"""Rejected frames logged per peer per ``LOG_EVERY_S`` (then one line with the count held back)."""
REFUSED_AFTER = 3
"""Handshakes in a row a P may hang up in before D takes it as a refusal (ZMQ retries every 100 ms)."""
HANDSHAKE_IVL_MS = 10_000
"""A connection that has not finished its handshake by then is dropped (ZMQ's default is 30 s):
half-open connections are what an unauthenticated flood can still make."""
OPEN_WARNING = (
    'side channel of %s runs WITHOUT authentication ("auth": "none"): any process that reaches %s can '
    "read and write this %s's registered KV cache through NIXL, and register, abort or hijack transfers"
)


def peer_budgets(cfg: Any) -> Budgets:
    """The per-peer read budgets of a ``Config`` (``peer_bytes_per_s``, ``peer_messages_per_s``)."""
    return Budgets(cfg.limits.peer_bytes_per_s, cfg.limits.peer_messages_per_s, ZMQ_MAX_MSG_BYTES)


def server_keys(cfg: Any) -> ServerKeys | None:
    """P's keys per its ``Config`` (``ConfigError`` naming what is missing); None, with a warning, for auth none."""
    keys = key_set.server_keys(cfg.security.auth, cfg.security.auth_keys_dir)
    if keys is None:
        log.warning(OPEN_WARNING, "this P", "its port", "P")
    return keys


def client_keys(cfg: Any) -> ClientKeys | None:
    """D's keys per its ``Config`` (``ConfigError`` naming what is missing); None, with a warning, for auth none."""
    keys = key_set.client_keys(cfg.security.auth, cfg.security.auth_keys_dir)
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

    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        port: int,
        keys: ServerKeys | None,
        budgets: Budgets | None = None,
        preauth_per_address: int = auth.PREAUTH_PER_ADDRESS,
        default_ranks: int = 16,
    ) -> None:
        self.gate = Gate(keys, f"{host}:{port}", preauth_per_address, default_ranks) if keys is not None else None
        self.budgets = budgets
        self.dropped = 0
        """Frames dropped unread because their peer was over its budget."""
        self.unsent = 0
        self._unsent_logged = float("-inf")
        self._reject_log = Throttle(LOG_EVERY_S, REJECTED_LINES)
        self.sock = (self.gate.ctx if self.gate is not None else ctx).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
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

    def deliver(
        self,
        handle: Callable[[bytes, str, Any], None],
        precheck: Callable[[bytes, str, memoryview], bool] | None = None,
    ) -> None:
        """Decode the pending messages one at a time, handing each to ``handle(ident, key, message)``
        before the next is decoded; bad frames are logged and skipped.

        A decoded registration can be a hundred times its frame, so only the one being handled is alive
        (a loop over a list or a generator would keep the previous one while decoding the next). At most
        ``STEP_FRAMES`` frames and ``STEP_BYTES`` decoded bytes per call, the rest stays queued: under a
        flood the engine gets back to its pushes every step. ``precheck(ident, key, frame)`` may drop a
        frame before it is decoded (a registration larger than its sender can have).
        """
        frames = decoded = 0
        while frames < STEP_FRAMES and decoded < STEP_BYTES:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames += 1
            if len(parts) != 2:
                log.warning("side channel %s:%s: dropped frame with %d parts", self.host, self.port, len(parts))
                continue
            ident, data = parts
            key = _user_id(data) if self.gate is not None else ""
            if not self._admit(key or ident.bytes, len(data), key):
                continue
            if precheck is not None and not precheck(ident.bytes, key, data.buffer):
                continue
            decoded += len(data)
            try:
                handle(ident.bytes, key, protocol.decode(data.buffer))
            except ProtocolError as exc:
                self._rejected(key or ident.bytes, key, exc)

    def recv(self) -> list[Received]:
        """The pending messages as a list (tests and tools; the engine uses ``deliver``)."""
        out: list[Received] = []
        self.deliver(lambda ident, key, msg: out.append(Received(ident, key, msg)))
        return out

    def _rejected(self, peer: str | bytes, key: str, exc: ProtocolError) -> None:
        held = self._reject_log.note(peer, time.monotonic())
        if held is not None:
            who = key_set.short(key) if key else "(auth none)"
            more = f" ({held} more rejected since the last lines)" if held else ""
            log.warning(
                "side channel %s:%s: rejected message from D key %s: %s%s", self.host, self.port, who, exc, more
            )

    def _admit(self, peer: str | bytes, nbytes: int, key: str) -> bool:
        """Within the peer's budget? A frame over it is dropped unread; drops are logged per peer per interval."""
        if self.budgets is None:
            return True
        now = time.monotonic()
        verdict = self.budgets.admit(peer, nbytes, now)
        if verdict is Verdict.ADMIT:
            return True
        self.dropped += 1
        n = self.budgets.report(peer, now, LOG_EVERY_S)
        if n:
            log.warning(
                "side channel %s:%s: dropped %d frame(s) of D key %s unread: %s (peer_bytes_per_s %.0f, "
                "peer_messages_per_s %g)",
                self.host,
                self.port,
                n,
                key_set.short(key) if key else "(auth none)",
                verdict.value.replace("_", " "),
                self.budgets.bytes_per_s,
                self.budgets.messages_per_s,
            )
        return False

    def send(self, ident: bytes, msg: protocol.Message) -> bool:
        """Queue ``msg`` for the connection ``ident``; False when it is gone or holds ``SNDHWM`` unread
        messages already (a peer that does not read its answers), logged once per interval."""
        try:
            self.sock.send_multipart([ident, protocol.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            self.unsent += 1
            now = time.monotonic()
            if now - self._unsent_logged >= LOG_EVERY_S:
                self._unsent_logged = now
                log.warning("side channel: cannot reach peer %r: %s (%d unsent so far)", ident, exc, self.unsent)
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

    def __init__(
        self, ctx: zmq.Context, host: str, port: int, keys: ClientKeys | None, budgets: Budgets | None = None
    ) -> None:
        self.budgets = budgets
        self.dropped = 0
        self._reject_log = Throttle(LOG_EVERY_S, REJECTED_LINES)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        self.monitor: zmq.Socket | None = None
        self.failure = ""
        """Why the last handshake failed ("" once one succeeded)."""
        self.refused = False
        """Handshakes fail in a way every retry will (keys, mechanism): P will never hear this D."""
        self._failures = 0
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
        """The pending messages (at most ``STEP_FRAMES`` frames and ``STEP_BYTES`` decoded bytes per call)."""
        self._handshakes()
        out: list[Any] = []
        frames = decoded = 0
        while frames < STEP_FRAMES and decoded < STEP_BYTES:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            frames += 1
            if self.budgets is not None and not self._admit(len(data)):
                continue
            decoded += len(data)
            try:
                out.append(protocol.decode(data))
            except ProtocolError as exc:
                held = self._reject_log.note("", time.monotonic())
                if held is not None:
                    more = f" ({held} more rejected since the last lines)" if held else ""
                    log.warning("side channel from %s:%s: rejected message: %s%s", self.host, self.port, exc, more)
        return out

    def _admit(self, nbytes: int) -> bool:
        assert self.budgets is not None
        now = time.monotonic()
        verdict = self.budgets.admit(b"", nbytes, now)
        if verdict is Verdict.ADMIT:
            return True
        self.dropped += 1
        n = self.budgets.report(b"", now, LOG_EVERY_S)
        if n:
            log.warning(
                "side channel from P %s:%s: dropped %d frame(s) unread: %s", self.host, self.port, n, verdict.value
            )
        return False

    def _handshakes(self) -> None:
        """Note the handshake outcomes the monitor reported since the last call."""
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failure, self.refused, self._failures = "", False, 0
                continue
            self.failure = describe_client_failure(event, self.host, self.port)
            self._failures += 1
            # Wrong keys (or no CURVE there) fail every attempt; one dropped connection may be chance, but
            # a server that hangs up in the handshake again and again does so because of the keys.
            self.refused = self._failures >= REFUSED_AFTER or event["event"] in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            )
            now = time.monotonic()
            if now - self._logged >= LOG_EVERY_S:
                self._logged = now
                log.error("side channel: %s", self.failure)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
