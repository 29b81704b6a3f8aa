"""The fence's transport: D's fence listener and the operator's client (``kvpush fence``), over ZeroMQ CURVE.

D listens (``fence_port``, one listener per D engine, in vLLM's scheduler process) as a CURVE server holding
the D fleet's fence key pair (``fence/decode.key_secret``); a handshake is accepted only from a key in D's
``fence/operators/`` (re-read when the directory changes), so nobody without an operator's secret key gets a
request read, and CURVE's per-connection keys and nonces make a recorded request useless on another
connection. Each request is checked (``kvpush.decode.fence.decode_request``) and, if good, handed to
``on_fence`` (the connector queues it for its workers' next step); the reply says what D will fence, or what
was wrong. The rules are in ``kvpush.decode.fence``; this module only moves bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from kvpush.core.errors import ConfigError, ProtocolError
from kvpush.decode.fence import MAX_REQUEST_BYTES, FenceRequest, decode_reply, decode_request, encode_reply
from kvpush.transport.auth import handshake_error
from kvpush.transport.key_set import FenceClientKeys, FenceServerKeys, dir_stamp, read_decoders, short

log = logging.getLogger(__name__)

POLL_MS = 200
"""How often the listener's thread looks whether it was closed."""


class Operators:
    """ZAP credentials provider: a client key is accepted when it is in ``path/*.key`` (re-read on change)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: int | None = None
        self._keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        stamp = dir_stamp(self.path)
        if stamp != self._stamp:
            try:
                self._keys, self._stamp = read_decoders(self.path), stamp
            except Exception as exc:  # a bad file: keep the keys read before, say why
                log.warning("kvpush fence listener: cannot re-read operator keys in %s: %s", self.path, exc)
        if key in self._keys:
            return True
        log.warning("kvpush fence listener: refused a connection from key %s: not in %s", short(key), self.path)
        return False


class FenceListener:
    """D's fence listener at ``host:port`` (``keys`` None: no authentication, ``"auth": "none"``)."""

    def __init__(
        self, host: str, port: int, keys: FenceServerKeys | None, on_fence: Callable[[FenceRequest], None]
    ) -> None:
        self.on_fence = on_fence
        self.ctx = zmq.Context()  # its own: its ZAP handler must not see vLLM's sockets
        self.auth: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if keys is not None:
            self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("kvpush.fence.zap"))
            self.auth.start()
            self.auth.configure_curve_callback("*", credentials_provider=Operators(keys.operators_dir))
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
            raise ConfigError(f"fence_port: cannot listen on {host}:{port}: {exc}") from None
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpush-fence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 2:
                continue
            ident, payload = frames[0], frames[-1]
            try:
                req = decode_request(payload)
            except ProtocolError as exc:
                log.warning("kvpush fence listener: refused a request: %s", exc)
                self._reply(ident, encode_reply(error=str(exc)))
                continue
            log.warning(
                "kvpush fence listener: P %s fenced for good by an operator (%s)",
                ", ".join(str(t) for t in req.targets),
                req.reason or "no reason given",
            )
            try:
                self.on_fence(req)
            except Exception as exc:
                log.exception("kvpush fence listener: the fence could not be queued")
                self._reply(ident, encode_reply(error=f"D could not queue the fence: {exc}"))
                continue
            self._reply(ident, encode_reply(req.targets))

    def _reply(self, ident: bytes, data: bytes) -> None:
        try:
            self.sock.send_multipart([ident, b"", data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("kvpush fence listener: reply lost: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def send_fence(address: str, request: bytes, keys: FenceClientKeys | None, timeout_s: float) -> tuple[bool, str]:
    """Send one fence request to D's listener at ``address`` (HOST:PORT); (accepted, what D or the handshake
    said). Never raises for a D that is down, refuses the key or does not answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = None
    try:
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
        sock.connect(f"tcp://{address}")
        sock.send(request)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if sock in ready:
            return decode_reply(sock.recv())
        if monitor is not None and monitor in ready:
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return False, f"D refused the operator key ({handshake_error(event)}): add it to D's fence/operators/"
            return False, (
                f"the CURVE handshake failed ({handshake_error(event)}): not a kvpush fence listener holding the "
                "key in fence/decode.key, or one running with auth none"
            )
        return False, f"no answer within {timeout_s:g}s (is fence_port set on that D, and is it up?)"
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
