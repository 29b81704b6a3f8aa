"""Whose keys the side channel trusts: CURVE key files, key sets, and loading them for an engine.

P holds a server key pair that every D knows the public half of; each D
holds a client key pair whose public half P allows (``kvpush.transport.auth``
checks each handshake against them). Those keys live in a key set directory
(``kvpush keys DIR`` makes one, and D key pairs of their own with the ranks
each D declares) or in ``KVPUSH_AUTH_*`` environment variables, for secrets
injected as variables; the router's capability key is derived from P's
secret key and kept in the same set. This module only reads and writes those
files and variables: a missing or malformed key is a ``ConfigError`` naming
the file or variable and how to make one, so a misconfigured engine stops at
start-up instead of failing every handshake later. It holds no socket and no
thread, so the CLI, the router and the tests use it without the gate's
machinery. See ``docs/security.md``.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from kvpush.core.capability import derive_key, mint
from kvpush.core.errors import ConfigError

log = logging.getLogger(__name__)

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
FENCE_SECRET = "fence/decode.key_secret"
"""The key pair of D's fence listener (``fence_port``), shared by the D fleet as P's pair is by the P fleet."""
FENCE_PUBLIC = "fence/decode.key"
"""Its public half: what ``kvpush fence`` checks D's listener against."""
OPERATOR_SECRET = "fence/operator.key_secret"
"""The operator's key pair: who may fence a P for good (``kvpush fence``, an orchestrator's hook)."""
OPERATORS = "fence/operators"
"""The operator public keys D's fence listener accepts (``*.key``), re-read when the directory changes."""
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
    return made + make_fence_keys(root)


def make_fence_keys(root: Path) -> list[Path]:
    """The fence's keys in key set ``root`` (D's listener pair, one operator pair D accepts) where missing;
    never overwrites; returns the files made. ``kvpush keys DIR`` on an older key set adds them."""
    (root / OPERATORS).mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    if not (root / FENCE_SECRET).exists():
        public, secret = zmq.curve_keypair()
        write_key_file(root / FENCE_SECRET, public, secret)
        (root / FENCE_PUBLIC).unlink(missing_ok=True)
        write_key_file(root / FENCE_PUBLIC, public)
        made += [root / FENCE_SECRET, root / FENCE_PUBLIC]
    if not (root / OPERATOR_SECRET).exists():
        public, secret = zmq.curve_keypair()
        write_key_file(root / OPERATOR_SECRET, public, secret)
        (root / OPERATORS / "operator.key").unlink(missing_ok=True)
        write_key_file(root / OPERATORS / "operator.key", public)
        made += [root / OPERATOR_SECRET, root / OPERATORS / "operator.key"]
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
    if (root / FENCE_SECRET).exists():  # the D's fence listener: the fleet's pair and the operators it accepts
        (own / OPERATORS).mkdir(parents=True)
        fence_public, fence_secret = read_key_file(root / FENCE_SECRET, need_secret=True)
        write_key_file(own / FENCE_SECRET, fence_public, fence_secret)
        for f in sorted((root / OPERATORS).glob("*.key")):
            write_key_file(own / OPERATORS / f.name, read_key_file(f, need_secret=False)[0])
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
        stamp = dir_stamp(self.path)
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
        allowed = read_decoders(root / DECODERS) | env_decoders()
        if not allowed:
            raise _missing("P", f"no D public key in {root / DECODERS} (nor ${ENV_DECODERS}): P would accept nobody")
        return ServerKeys(public, secret, allowed, root / DECODERS)
    public, secret = _env_key(ENV_PREFILL_PUBLIC), _env_key(ENV_PREFILL_SECRET)
    if public is None or secret is None:
        raise _missing("P", f"no auth_keys_dir, ${ENV_DIR} unset, ${ENV_PREFILL_PUBLIC}/${ENV_PREFILL_SECRET} unset")
    _check_pair(public, secret, f"${ENV_PREFILL_SECRET}")
    allowed = env_decoders()
    if not allowed:
        raise _missing("P", f"${ENV_DECODERS} lists no D public key: P would accept nobody")
    return ServerKeys(public, secret, allowed)


def env_decoders() -> frozenset[bytes]:
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


@dataclass(frozen=True)
class FenceServerKeys:
    """What D's fence listener needs: the fleet's listener pair and where the operator keys it accepts are."""

    public: bytes
    secret: bytes
    operators_dir: Path


@dataclass(frozen=True)
class FenceClientKeys:
    """What ``kvpush fence`` needs: the operator's pair and the public key of D's fence listener."""

    public: bytes
    secret: bytes
    server: bytes


def _missing_fence(what: str) -> ConfigError:
    return ConfigError(
        f"{what}; `kvpush keys DIR` makes the fence's keys (on an existing key set too: it adds only what is "
        'missing), docs/security.md, "Fencing a P for good"'
    )


def fence_server_keys(auth: str, auth_keys_dir: str) -> FenceServerKeys | None:
    """D's fence listener keys (``fence_port`` set), None with ``"auth": "none"``; a ``ConfigError`` naming what
    is missing. Only from a key set directory: the operator keys are files, re-read as they change."""
    if auth == "none":
        return None
    root = keys_dir(auth_keys_dir)
    if root is None:
        raise _missing_fence(
            f"fence_port is set but no key set directory (auth_keys_dir or ${ENV_DIR}) holds {FENCE_SECRET}"
        )
    if not (root / FENCE_SECRET).exists():
        raise _missing_fence(f"fence_port is set but {root / FENCE_SECRET} does not exist")
    public, secret = read_key_file(root / FENCE_SECRET, need_secret=True)
    assert secret is not None
    if not read_decoders(root / OPERATORS):
        raise _missing_fence(f"fence_port is set but {root / OPERATORS} holds no operator key: nobody could fence")
    return FenceServerKeys(public, secret, root / OPERATORS)


def fence_client_keys(path: str | os.PathLike[str]) -> FenceClientKeys:
    """The operator's keys from key set ``path`` (``fence/operator.key_secret``, ``fence/decode.key``)."""
    root = Path(path)
    for name in (OPERATOR_SECRET, FENCE_PUBLIC):
        if not (root / name).exists():
            raise _missing_fence(f"{root / name} does not exist")
    public, secret = read_key_file(root / OPERATOR_SECRET, need_secret=True)
    server, _ = read_key_file(root / FENCE_PUBLIC, need_secret=False)
    assert secret is not None
    return FenceClientKeys(public, secret, server)


def short(key: bytes | str) -> str:
    """A key's first characters, enough to tell keys apart in a log line."""
    text = key.decode() if isinstance(key, bytes) else key
    return text[:8] + "…" if text else "(none)"


def dir_stamp(path: Path | None) -> int | None:
    """When ``path`` (a directory) last changed; None when there is none."""
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None
