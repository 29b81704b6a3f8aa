"""Who gets through P's side channel: the ZAP gate that checks every CURVE handshake, and failures in words.

The side channel hands out NIXL agent metadata, and with it RDMA access to
the registered KV cache, so nobody gets a message through without a key.
ZeroMQ's CURVE does the handshake, encryption and per-connection nonces (a
replayed stream or a replayed frame fails the handshake or the connection);
this module answers P's ZAP requests against the allowed D keys
(``kvpush.transport.key_set`` loads them), naming the client key as the user
id of every message it sends, so P knows *which* D a message came from from
the key it proved, never from an id the peer declares. It also bounds
connections per source address before they authenticate and per key after,
refusing a key barred for going over its cap again and again (the rules are
``kvpush.prefill.admission``'s; here only the sockets and the clock), and says
why a handshake failed in words that name what to check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kvpush.core.errors import ConfigError
from kvpush.core.limits import Throttle
from kvpush.prefill.admission import (
    BARRED_S,
    CURVE_CLIENT_HANDSHAKE_BYTES,
    KeyConns,
    KeyLimits,
    PreAuth,
    names_cap,
)
from kvpush.transport.key_set import (
    DECODERS,
    ENV_DECODERS,
    ENV_PREFILL_PUBLIC,
    PREFILL_PUBLIC,
    DeclaredRanks,
    ServerKeys,
    dir_stamp,
    env_decoders,
    read_decoders,
    short,
)

log = logging.getLogger(__name__)

PREAUTH_PER_ADDRESS = 64
"""Connections from one source address P keeps open before they authenticate (``Config.preauth_per_address``)."""
TCP_INFO_BYTES = 232
TCPI_BYTES_RECEIVED = 128
"""Linux's ``struct tcp_info``: its size as asked for, and the offset of ``tcpi_bytes_received`` (a u64)."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "kvpush"
LOG_EVERY_S = 10.0
"""Refusals are logged once per (reason, address) in this interval, with a count of the ones held back:
an attacker reconnecting in a loop must not flood the log."""

# -- P's gate: the ZAP handler and the handshake monitor ------------------------


def _limited(throttle: Throttle, key: str, emit: Callable[[str], None], line: str) -> None:
    held = throttle.note(key, time.monotonic())
    if held is not None:
        emit(line + (f" ({held} more like it since the last line)" if held else ""))


class Gate:
    """P's ZAP handler and handshake monitor, on a thread of its own, for one server socket.

    A context has one ZAP endpoint, so the server socket lives in a context
    of its own (``Gate.ctx``). Every CURVE handshake is checked against the
    allowed D keys; the accepted key becomes the user id of the connection's
    messages. Refused keys and failed handshakes (no CURVE, wrong server key,
    a replayed stream) are logged with their reason, rate-limited.

    It also bounds connections: per source address before they authenticate
    (``PreAuth``), and per key after (``KeyConns``, a key's cap being its
    names cap: ``default_ranks`` or twice what its key file declares); a key
    ``KeyConns`` bars is refused in its handshake, before it is admitted. A ZAP
    request names the source address, not the connection, so the gate ties it
    to the oldest connection from that address that has sent a whole CURVE
    handshake (``CURVE_CLIENT_HANDSHAKE_BYTES``, from ``TCP_INFO``) and is not
    tied yet: handshakes from one address are checked in the order they
    complete, and a tie can only be wrong between connections from one address
    whose handshakes end together, where it may count one key's connection
    under the other key of that address.
    """

    def __init__(
        self,
        keys: ServerKeys,
        label: str,
        per_address: int = PREAUTH_PER_ADDRESS,
        default_ranks: int = 16,
        barred_s: float = BARRED_S,
    ) -> None:
        self.keys = keys
        self.label = label
        self.preauth = PreAuth(per_address)
        """Connections not yet past the handshake, per source address (``kvpush.prefill.admission.PreAuth``)."""
        self._remote: dict[int, tuple[str, int]] = {}  # descriptor -> the (host, port) it was accepted from
        self._tied: set[int] = set()  # connections whose ZAP request was answered (accepted or refused)
        self._declared = DeclaredRanks(keys.decoders_dir)
        limits = KeyLimits(default_ranks=default_ranks)
        self.conns = KeyConns(lambda key: names_cap(limits, self._declared(key)), barred_s)
        """Authenticated connections per key, and the keys barred (``kvpush.prefill.admission.KeyConns``)."""
        self.allowed = keys.allowed
        self._dir_stamp = dir_stamp(keys.decoders_dir)
        self.refused = 0
        """Handshakes refused by key (ZAP said no): a key not allowed, or one barred."""
        self.failed = 0
        """Handshakes that failed before a key could be checked (protocol or cryptographic errors)."""
        self.checked = 0
        """Handshakes whose key was checked (ZAP requests answered): what P authenticated, admitted or not."""
        self.ctx = zmq.Context()
        self._zap = self.ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._stop_tx = self.ctx.socket(zmq.PAIR)
        self._stop_rx = self.ctx.socket(zmq.PAIR)
        self._stop_rx.bind(f"inproc://kvpush-gate-stop-{id(self)}")
        self._stop_tx.connect(f"inproc://kvpush-gate-stop-{id(self)}")
        self._monitor: zmq.Socket | None = None
        self._limit = Throttle(LOG_EVERY_S)
        self._thread: threading.Thread | None = None

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (of ``self.ctx``) a CURVE server checked by this gate; start the thread."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        events |= zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        self._monitor = sock.get_monitor_socket(events)
        self._thread = threading.Thread(target=self._run, name=f"kvpush-gate-{self.label}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close its sockets (the server socket must be closed already)."""
        if self._thread is not None:
            self._stop_tx.send(b"")
            self._thread.join(5.0)
        for s in (self._zap, self._stop_tx, self._stop_rx, self._monitor):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in (self._zap, self._stop_rx, self._monitor):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._stop_rx in events:
                return
            try:
                # Connection events first: a ZAP request is tied to an accepted connection, so the accept
                # must be known by then.
                while self._monitor is not None and self._monitor.poll(0):
                    self._on_event(parse_monitor_message(self._monitor.recv_multipart()))
                if self._zap in events:
                    self._answer(self._zap.recv_multipart())
            except Exception:
                # A bug here must not stop the gate: a ZAP request left unanswered stalls every handshake.
                log.exception("side channel %s: the gate failed on a request", self.label)

    def _answer(self, frames: list[bytes]) -> None:
        """One ZAP request (``version, id, domain, address, routing id, mechanism, credentials...``),
        always answered: an unanswered request would stall that handshake and the REP socket with it."""
        version, request_id = [*frames, b"1.0", b""][:2]
        self.checked += 1
        barred = False
        try:
            address, mechanism = frames[3], frames[5]
            key = z85.encode(frames[6]) if mechanism == b"CURVE" and len(frames) > 6 else b""
            ok, why = self._allows(key)
            if ok:  # an allowed key: admitted unless barred (before anything is tied or shut for it)
                why = self.conns.handshake(key.decode(), time.monotonic())
                ok, barred = not why, bool(why)
        except Exception as exc:
            log.exception("side channel %s: malformed ZAP request", self.label)
            address, key, ok, why = b"?", b"", False, f"internal error: {exc}"
        self._tie(address.decode(errors="replace"), key.decode() if ok else None)
        if ok:
            self._zap.send_multipart([version, request_id, b"200", b"OK", key, b""])
            return
        self.refused += 1
        _limited(
            self._limit,
            f"barred:{key!r}" if barred else f"refused:{address!r}",
            log.warning,
            f"side channel {self.label}: refused a connection from {address.decode(errors='replace')}: {why}",
        )
        self._zap.send_multipart([version, request_id, b"400", why.encode()[:255], b"", b""])

    def _tie(self, host: str, key: str | None) -> None:
        """Tie a handshake from ``host`` to its connection (the oldest from there, past a whole handshake, not
        tied yet), counted under ``key`` (None: refused, only marked); shut that key's oldest beyond its cap."""
        for fd, remote in list(self._remote.items()):  # accept order: the oldest first
            if fd in self._tied or remote[0] != host:
                continue
            sent = _received(fd, remote)
            if sent is None or sent < CURVE_CLIENT_HANDSHAKE_BYTES:
                continue
            self._tied.add(fd)
            self.preauth.proven(fd)
            if key is None:
                return
            shut = 0
            for old in self.conns.tied(fd, key, time.monotonic()):
                shut += _shut(old, self._forget(old))
            if shut:
                _limited(
                    self._limit,
                    f"keyconns:{key}",
                    log.warning,
                    f"side channel {self.label}: shut the oldest connection of D key {short(key)}: more than "
                    f"{self.conns.cap(key)} connections of one key (its names cap); {self.conns.shut_total} so far",
                )
            return

    def _allows(self, key: bytes) -> tuple[bool, str]:
        if not key:
            return False, "no CURVE key (not a kvpush D, or a D running with auth none)"
        stamp = dir_stamp(self.keys.decoders_dir)
        if stamp != self._dir_stamp and self.keys.decoders_dir is not None:
            # decoders/ changed since it was read: a D key added or removed while P runs takes effect
            # at the next handshake, without a restart (connections already made stay).
            self._dir_stamp = stamp
            try:
                self.allowed = env_decoders() | read_decoders(self.keys.decoders_dir)
            except ConfigError as exc:
                log.error("side channel %s: cannot re-read the allowed D keys (kept the old ones): %s", self.label, exc)
        if key in self.allowed:
            return True, ""
        where = self.keys.decoders_dir or f"${ENV_DECODERS}"
        return False, f"D key {short(key)} is not among the allowed D keys ({where})"

    def _on_event(self, event: dict[str, object]) -> None:
        kind, value = event.get("event"), event.get("value")
        if kind == zmq.EVENT_ACCEPTED and isinstance(value, int):
            self._on_accepted(value)
            return
        if kind == zmq.EVENT_DISCONNECTED and isinstance(value, int):
            self._forget(value)
            return
        self.failed += 1
        what = handshake_error(event)
        _limited(
            self._limit,
            f"failed:{what}",
            log.warning,
            f"side channel {self.label}: CURVE rejected a connection ({what}): not a kvpush D with a key set of "
            "this P, or a replayed or corrupted stream; nothing it sent from there on was read",
        )

    def _forget(self, fd: int) -> tuple[str, int] | None:
        """Forget the connection ``fd`` wherever the gate counts it (closed, shut, or its descriptor number
        reused); the (host, port) it was accepted from, if known."""
        self.preauth.closed(fd)
        self.conns.closed(fd)
        self._tied.discard(fd)
        return self._remote.pop(fd, None)

    def _on_accepted(self, fd: int) -> None:
        """A connection was accepted: count it against its source address until it is past the handshake;
        beyond ``per_address`` unproven ones, shut the oldest (ZeroMQ then closes it as a dropped peer)."""
        remote = _remote_of(fd, None)
        if remote is None:
            return
        # A descriptor number reused: whatever connection it was is gone (its close may not have been seen).
        self._forget(fd)
        self._remote[fd] = remote
        host = remote[0]
        self.preauth.accepted(fd, host)
        shut = 0
        while (conn := self.preauth.over(host)) is not None:
            at = self._remote.get(conn)
            sent = _received(conn, at)
            if sent is None or sent >= CURVE_CLIENT_HANDSHAKE_BYTES:
                self.preauth.proven(conn)  # past its handshake, or no longer the connection it was
                continue
            self.preauth.shut(conn)
            self._forget(conn)
            shut += _shut(conn, at)
        if shut:
            _limited(
                self._limit,
                f"preauth:{host}",
                log.warning,
                f"side channel {self.label}: shut {shut} connection(s) from {host} that had not authenticated: "
                f"more than {self.preauth.per_address} open before authentication from one address "
                f"(preauth_per_address); {self.preauth.shut_total} so far",
            )


@contextlib.contextmanager
def _borrowed(fd: int, remote: tuple[str, int] | None) -> Iterator[socket.socket | None]:
    """Descriptor ``fd`` as a socket, if it is a TCP connection from ``remote`` (any, when None), else None
    (closed, or its number reused by another connection). Borrowed, not duplicated: no descriptor is
    taken (the table may be full, which is what this is for) and ``fd`` stays ZeroMQ's, open."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        ok = sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
        if ok and remote is not None:
            ok = tuple(sock.getpeername()[:2]) == remote
        yield sock if ok else None
    except OSError:
        yield None
    finally:
        sock.detach()


def _remote_of(fd: int, remote: tuple[str, int] | None) -> tuple[str, int] | None:
    with _borrowed(fd, remote) as sock:
        if sock is None:
            return None
        try:
            host, port = sock.getpeername()[:2]
            return str(host), int(port)
        except OSError:
            return None


def _received(fd: int, remote: tuple[str, int] | None) -> int | None:
    """Bytes the connection ``fd`` (still from ``remote``) has received (Linux ``TCP_INFO``), else None."""
    with _borrowed(fd, remote) as sock:
        if sock is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        except OSError:
            return None
        if len(info) < TCPI_BYTES_RECEIVED + 8:
            return CURVE_CLIENT_HANDSHAKE_BYTES  # a kernel that does not say: count it as proven
        return int(struct.unpack_from("<Q", info, TCPI_BYTES_RECEIVED)[0])


def _shut(fd: int, remote: tuple[str, int] | None) -> bool:
    """Shut the connection ``fd`` down if it is still the one from ``remote``: ZeroMQ sees it end and closes
    the descriptor itself (closing it here would pull it from under ZeroMQ)."""
    if remote is None:
        return False
    with _borrowed(fd, remote) as sock:
        if sock is None:
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False


def handshake_error(event: dict[str, object]) -> str:
    """A failed handshake's monitor event in words: the ZMTP protocol error, the errno, or the ZAP status."""
    kind, value = event.get("event"), event.get("value")
    if not isinstance(value, int):
        return str(value)
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        try:
            return zmq.Event(value).name.lower().replace("protocol_error_", "protocol error ")
        except ValueError:
            return f"protocol error {value:#x}"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"refused, ZAP status {value}"
    return os.strerror(value) if value else "no detail"


def describe_client_failure(event: dict[str, object], host: str, port: int) -> str:
    """Why D's handshake with a P failed, in words that say what to check."""
    if event.get("event") == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"P {host}:{port} refused this D's key ({handshake_error(event)}): add its public key to P's "
            f"{DECODERS}/ (or ${ENV_DECODERS}); if it is there, P's log says why (a key that went over its "
            "connection cap again and again is barred for a while)"
        )
    what = handshake_error(event)
    return (
        f"the CURVE handshake with {host}:{port} failed ({what}): it is not a kvpush P holding the key in this "
        f"D's {PREFILL_PUBLIC} (or ${ENV_PREFILL_PUBLIC}), or it runs with auth none; nothing was sent to it"
    )
