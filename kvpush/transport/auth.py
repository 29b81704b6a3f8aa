"""Who may use the side channel: CURVE key sets, and the ZAP handler that checks each connection.

The side channel hands out NIXL agent metadata, and with it RDMA access to
the registered KV cache, so nobody gets a message through without a key.
P holds a server key pair that every D knows the public half of (a fake P
fails the handshake: D never sends it its own metadata); each D holds a
client key pair whose public half P allows. ZeroMQ's CURVE does the
handshake, encryption and per-connection nonces (a replayed stream or a
replayed frame fails the handshake or the connection); this module loads
the keys and answers P's ZAP requests, naming the client key as the user id
of every message it sends, so P knows *which* D a message came from from
the key it proved, never from an id the peer declares.

Keys come from a key set directory (``kvpush keys DIR`` makes one) or from
``KVPUSH_AUTH_*`` environment variables; see ``docs/security.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kvpush.core.capability import derive_key, mint
from kvpush.core.errors import ConfigError
from kvpush.core.limits import Throttle
from kvpush.prefill.admission import CURVE_CLIENT_HANDSHAKE_BYTES, KeyConns, KeyLimits, PreAuth, names_cap

log = logging.getLogger(__name__)

PREAUTH_PER_ADDRESS = 64
"""Connections from one source address P keeps open before they authenticate (``Config.preauth_per_address``)."""
TCP_INFO_BYTES = 232
TCPI_BYTES_RECEIVED = 128
"""Linux's ``struct tcp_info``: its size as asked for, and the offset of ``tcpi_bytes_received`` (a u64)."""
PREFILL_PUBLIC = "prefill.key"
PREFILL_SECRET = "prefill.key_secret"
DECODE_SECRET = "decode.key_secret"
RANKS = "ranks"
"""Metadata of a D public key file: the ranks (TP size times DP) that D has (``kvpush.prefill.admission``)."""
DECODERS = "decoders"
"""A key set: P reads ``prefill.key_secret`` and the D public keys in ``decoders/*.key``;
D reads ``prefill.key`` (whom to trust) and ``decode.key_secret`` (who it is)."""

ENV_DIR = "KVPUSH_AUTH_KEYS_DIR"
ENV_PREFILL_PUBLIC = "KVPUSH_AUTH_PREFILL_PUBLIC"
ENV_PREFILL_SECRET = "KVPUSH_AUTH_PREFILL_SECRET"
ENV_DECODE_PUBLIC = "KVPUSH_AUTH_DECODE_PUBLIC"
ENV_DECODE_SECRET = "KVPUSH_AUTH_DECODE_SECRET"
ENV_DECODERS = "KVPUSH_AUTH_DECODERS"
ROUTER_KEY = "router/capability.key"
"""The router's file in a key set: the P fleet's capability key (``kvpush.core.capability``), hex, and nothing
else; ``kvpush keys`` writes it, derived from P's secret key (it does not reveal that key)."""
"""The same keys as environment variables (Z85 text, 40 characters; ``KVPUSH_AUTH_DECODERS`` lists
allowed D public keys separated by commas or white space), for secrets injected as variables."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "kvpush"
LOG_EVERY_S = 10.0
"""Refusals are logged once per (reason, address) in this interval, with a count of the ones held back:
an attacker reconnecting in a loop must not flood the log."""
HOW_TO_MAKE = "make a key set with `kvpush keys DIR` (docs/security.md)"


@dataclass(frozen=True)
class ServerKeys:
    """What P needs: its key pair and the D public keys it accepts (Z85 text)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]
    decoders_dir: Path | None = None
    """Where ``allowed`` was read from (re-read for keys added later); None: from the environment."""


@dataclass(frozen=True)
class ClientKeys:
    """What D needs: its key pair and P's public key."""

    public: bytes
    secret: bytes
    server: bytes


# -- key files -----------------------------------------------------------------


def write_key_file(path: Path, public: bytes, secret: bytes | None = None, ranks: int | None = None) -> None:
    """A ZeroMQ certificate file (the format of ``zmq.auth``); a secret one is readable by its owner only.
    ``ranks``: the D rank count its holder declares (metadata ``ranks``, ``declared_ranks``)."""
    text = "#   ZeroMQ CURVE certificate (kvpush)\n#   made by `kvpush keys`\n"
    if ranks is not None:
        text += f'metadata\n    {RANKS} = "{ranks}"\n'
    text += "curve\n"
    text += f'    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret is not None else 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


def read_key_file(path: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of a certificate file; ``ConfigError`` naming the file and what is wrong."""
    public = secret = None
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}; {HOW_TO_MAKE}") from None
    for line in lines:
        line = line.strip()
        if line.startswith(b"public-key"):
            public = line.split(b"=", 1)[1].strip(b" \t'\"")
        elif line.startswith(b"secret-key"):
            secret = line.split(b"=", 1)[1].strip(b" \t'\"")
    if public is None:
        raise ConfigError(f"key file {path} has no public-key line; {HOW_TO_MAKE}")
    _check_key(public, f"public key in {path}")
    if need_secret:
        if secret is None:
            raise ConfigError(f"key file {path} has no secret-key line (a .key_secret file is needed here)")
        _check_pair(public, secret, str(path))
    return public, secret


def _check_key(key: bytes, what: str) -> None:
    if len(key) != 40:
        raise ConfigError(f"{what}: a CURVE key is 40 Z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError):
        raise ConfigError(f"{what}: not Z85 text") from None


def _check_pair(public: bytes, secret: bytes, where: str) -> None:
    _check_key(secret, f"secret key in {where}")
    if zmq.curve_public(secret) != public:
        raise ConfigError(f"{where}: the secret key does not belong to the public key")


def make_key_set(path: str | os.PathLike[str]) -> list[Path]:
    """Create a key set in ``path`` (P's pair, one D pair allowed by P); never overwrites; returns the files made."""
    root = Path(path)
    (root / DECODERS).mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    if not (root / PREFILL_SECRET).exists():
        public, secret = zmq.curve_keypair()
        write_key_file(root / PREFILL_SECRET, public, secret)
        (root / PREFILL_PUBLIC).unlink(missing_ok=True)
        write_key_file(root / PREFILL_PUBLIC, public)
        made += [root / PREFILL_SECRET, root / PREFILL_PUBLIC]
    if not (root / DECODE_SECRET).exists():
        public, secret = zmq.curve_keypair()
        write_key_file(root / DECODE_SECRET, public, secret)
        (root / DECODERS / "decode.key").unlink(missing_ok=True)
        write_key_file(root / DECODERS / "decode.key", public)
        made += [root / DECODE_SECRET, root / DECODERS / "decode.key"]
    return made


def add_decode_key(path: str | os.PathLike[str], name: str, ranks: int | None = None) -> Path:
    """A D key pair of its own: ``path/name/`` is that D's mount (P's public key and its pair), and P
    allows it through ``path/decoders/name.key``, which declares ``ranks`` (that D's TP size times DP) when
    given. Returns the new directory."""
    root = Path(path)
    if ranks is not None and ranks < 1:
        raise ConfigError(f"--ranks {ranks}: a D has at least one rank")
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"D key name {name!r}: use a plain file name (letters, digits, - and _)")
    if not (root / PREFILL_PUBLIC).exists():
        raise ConfigError(f"{root} has no {PREFILL_PUBLIC}: run `kvpush keys {root}` first")
    own = root / name
    if own.exists():
        raise ConfigError(f"{own} exists already; choose another name or remove it")
    own.mkdir(parents=True)
    public, secret = zmq.curve_keypair()
    write_key_file(own / DECODE_SECRET, public, secret)
    write_key_file(own / PREFILL_PUBLIC, read_key_file(root / PREFILL_PUBLIC, need_secret=False)[0])
    (root / DECODERS).mkdir(exist_ok=True)
    write_key_file(root / DECODERS / f"{name}.key", public, ranks=ranks)
    return own


def write_router_key(path: str | os.PathLike[str]) -> Path | None:
    """``path/router/capability.key`` from the key set's P secret key (None: it exists already)."""
    root = Path(path)
    out = root / ROUTER_KEY
    if out.exists():
        return None
    _, secret = read_key_file(root / PREFILL_SECRET, need_secret=True)
    assert secret is not None
    out.parent.mkdir(exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(derive_key(secret).hex() + "\n")
    return out


def router_capability_key(path: str | os.PathLike[str] | None) -> bytes | None:
    """The capability key a router mints with: ``path`` is the router's key file, or a key set directory
    holding ``router/capability.key`` (or P's secret key, on a host that has it); None: nothing there."""
    if path is None or not str(path):
        return None
    p = Path(path)
    if p.is_dir():
        if (p / ROUTER_KEY).exists():
            p = p / ROUTER_KEY
        elif (p / PREFILL_SECRET).exists():
            _, secret = read_key_file(p / PREFILL_SECRET, need_secret=True)
            assert secret is not None
            return derive_key(secret)
        else:
            return None
    try:
        key = bytes.fromhex(p.read_text().strip())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"capability key file {p}: {exc} (`kvpush keys DIR` writes DIR/{ROUTER_KEY})") from None
    if len(key) != 32:
        raise ConfigError(f"capability key file {p}: expected 64 hex characters, got {2 * len(key)}")
    return key


@functools.lru_cache(maxsize=8)
def _session_key(root: str) -> bytes | None:
    return router_capability_key(root)


def session_capability(transfer_id: str) -> str:
    """The capability a harness acting as the router (tests, benchmarks) gives D: minted with the key set
    of ``$KVPUSH_AUTH_KEYS_DIR`` ("" without one, as with ``"auth": "none"``)."""
    root = keys_dir("")
    key = _session_key(str(root)) if root is not None else None
    return mint(key, transfer_id) if key is not None else ""


def read_declared_ranks(path: Path) -> dict[str, int]:
    """Z85 D public key -> the ranks its file in ``path/*.key`` declares (files that declare none are left
    out; an unreadable value is left out too: that key gets the default)."""
    out: dict[str, int] = {}
    for f in sorted(path.glob("*.key")):
        try:
            public, _ = read_key_file(f, need_secret=False)
            lines = f.read_bytes().splitlines()
        except (ConfigError, OSError):
            continue
        for line in lines:
            line = line.strip()
            if line.startswith(RANKS.encode()) and b"=" in line:
                try:
                    n = int(line.split(b"=", 1)[1].strip(b" \t'\""))
                except ValueError:
                    break
                if n >= 1:
                    out[public.decode()] = n
                break
    return out


class DeclaredRanks:
    """The ranks each allowed D key declares in P's ``decoders/`` (None without one): re-read when the
    directory changes, as the gate re-reads the keys."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._stamp: int | None = None
        self._ranks: dict[str, int] = {}

    def __call__(self, key: str) -> int | None:
        if self.path is None:
            return None
        stamp = _stamp(self.path)
        if stamp != self._stamp:
            try:
                self._stamp, self._ranks = stamp, read_declared_ranks(self.path)
            except OSError as exc:
                # e.g. a full descriptor table: keep what was read before, try again at the next hello
                log.warning("cannot re-read the ranks D keys declare in %s (kept the old ones): %s", self.path, exc)
        return self._ranks.get(key)


# -- loading for an engine -----------------------------------------------------


def keys_dir(auth_keys_dir: str) -> Path | None:
    """The configured key set directory, else ``$KVPUSH_AUTH_KEYS_DIR``, else None."""
    where = auth_keys_dir or os.environ.get(ENV_DIR, "")
    return Path(where) if where else None


def _env_key(name: str) -> bytes | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    _check_key(value.encode(), f"${name}")
    return value.encode()


def _missing(role: str, what: str) -> ConfigError:
    return ConfigError(
        f"side channel authentication is on (the default) but this {role} has no keys: {what}. "
        f"Set auth_keys_dir in kv_connector_extra_config (or ${ENV_DIR}) to a key set; {HOW_TO_MAKE}. "
        'Only on a host where every local process is trusted: "auth": "none"'
    )


def read_decoders(path: Path) -> frozenset[bytes]:
    """The D public keys in ``path/*.key`` (a bad file is an error naming it)."""
    keys = set()
    for f in sorted(path.glob("*.key")):
        keys.add(read_key_file(f, need_secret=False)[0])
    return frozenset(keys)


def server_keys(auth: str, auth_keys_dir: str) -> ServerKeys | None:
    """P's keys, or None when ``auth`` is ``"none"``; a clear ``ConfigError`` when any is missing."""
    if auth == "none":
        return None
    root = keys_dir(auth_keys_dir)
    if root is not None:
        if not (root / PREFILL_SECRET).exists():
            raise _missing("P", f"{root / PREFILL_SECRET} does not exist")
        public, secret = read_key_file(root / PREFILL_SECRET, need_secret=True)
        assert secret is not None
        allowed = read_decoders(root / DECODERS) | _env_decoders()
        if not allowed:
            raise _missing("P", f"no D public key in {root / DECODERS} (nor ${ENV_DECODERS}): P would accept nobody")
        return ServerKeys(public, secret, allowed, root / DECODERS)
    public, secret = _env_key(ENV_PREFILL_PUBLIC), _env_key(ENV_PREFILL_SECRET)
    if public is None or secret is None:
        raise _missing("P", f"no auth_keys_dir, ${ENV_DIR} unset, ${ENV_PREFILL_PUBLIC}/${ENV_PREFILL_SECRET} unset")
    _check_pair(public, secret, f"${ENV_PREFILL_SECRET}")
    allowed = _env_decoders()
    if not allowed:
        raise _missing("P", f"${ENV_DECODERS} lists no D public key: P would accept nobody")
    return ServerKeys(public, secret, allowed)


def _env_decoders() -> frozenset[bytes]:
    out = set()
    for item in os.environ.get(ENV_DECODERS, "").replace(",", " ").split():
        _check_key(item.encode(), f"${ENV_DECODERS} entry {item[:8]}...")
        out.add(item.encode())
    return frozenset(out)


def client_keys(auth: str, auth_keys_dir: str) -> ClientKeys | None:
    """D's keys, or None when ``auth`` is ``"none"``; a clear ``ConfigError`` when any is missing."""
    if auth == "none":
        return None
    root = keys_dir(auth_keys_dir)
    if root is not None:
        for name in (PREFILL_PUBLIC, DECODE_SECRET):
            if not (root / name).exists():
                raise _missing("D", f"{root / name} does not exist")
        server, _ = read_key_file(root / PREFILL_PUBLIC, need_secret=False)
        public, secret = read_key_file(root / DECODE_SECRET, need_secret=True)
        assert secret is not None
        return ClientKeys(public, secret, server)
    server, public, secret = _env_key(ENV_PREFILL_PUBLIC), _env_key(ENV_DECODE_PUBLIC), _env_key(ENV_DECODE_SECRET)
    if server is None or public is None or secret is None:
        raise _missing(
            "D",
            f"no auth_keys_dir, ${ENV_DIR} unset, "
            f"${ENV_PREFILL_PUBLIC}/${ENV_DECODE_PUBLIC}/${ENV_DECODE_SECRET} unset",
        )
    _check_pair(public, secret, f"${ENV_DECODE_SECRET}")
    return ClientKeys(public, secret, server)


def short(key: bytes | str) -> str:
    """A key's first characters, enough to tell keys apart in a log line."""
    text = key.decode() if isinstance(key, bytes) else key
    return text[:8] + "…" if text else "(none)"


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
    names cap: ``default_ranks`` or twice what its key file declares). A ZAP
    request names the source address, not the connection, so the gate ties it
    to the oldest connection from that address that has sent a whole CURVE
    handshake (``CURVE_CLIENT_HANDSHAKE_BYTES``, from ``TCP_INFO``) and is not
    tied yet: handshakes from one address are checked in the order they
    complete, and a tie can only be wrong between connections from one address
    whose handshakes end together, where it may count one key's connection
    under the other key of that address.
    """

    def __init__(
        self, keys: ServerKeys, label: str, per_address: int = PREAUTH_PER_ADDRESS, default_ranks: int = 16
    ) -> None:
        self.keys = keys
        self.label = label
        self.preauth = PreAuth(per_address)
        """Connections not yet past the handshake, per source address (``kvpush.prefill.admission.PreAuth``)."""
        self._remote: dict[int, tuple[str, int]] = {}  # descriptor -> the (host, port) it was accepted from
        self._tied: set[int] = set()  # connections whose ZAP request was answered (accepted or refused)
        self._declared = DeclaredRanks(keys.decoders_dir)
        limits = KeyLimits(default_ranks=default_ranks)
        self.conns = KeyConns(lambda key: names_cap(limits, self._declared(key)))
        """Authenticated connections per key (``kvpush.prefill.admission.KeyConns``)."""
        self.allowed = keys.allowed
        self._dir_stamp = _stamp(keys.decoders_dir)
        self.refused = 0
        """Handshakes refused by key (ZAP said no)."""
        self.failed = 0
        """Handshakes that failed before a key could be checked (protocol or cryptographic errors)."""
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
        try:
            address, mechanism = frames[3], frames[5]
            key = z85.encode(frames[6]) if mechanism == b"CURVE" and len(frames) > 6 else b""
            ok, why = self._allows(key)
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
            f"refused:{address!r}",
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
            for old in self.conns.tied(fd, key):
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
        stamp = _stamp(self.keys.decoders_dir)
        if stamp != self._dir_stamp and self.keys.decoders_dir is not None:
            # decoders/ changed since it was read: a D key added or removed while P runs takes effect
            # at the next handshake, without a restart (connections already made stay).
            self._dir_stamp = stamp
            try:
                self.allowed = _env_decoders() | read_decoders(self.keys.decoders_dir)
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


def _stamp(path: Path | None) -> int | None:
    """When ``path`` (a directory) last changed; None when there is none."""
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None


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
            f"{DECODERS}/ (or ${ENV_DECODERS})"
        )
    what = handshake_error(event)
    return (
        f"the CURVE handshake with {host}:{port} failed ({what}): it is not a kvpush P holding the key in this "
        f"D's {PREFILL_PUBLIC} (or ${ENV_PREFILL_PUBLIC}), or it runs with auth none; nothing was sent to it"
    )
