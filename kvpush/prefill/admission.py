"""P's admission of D keys (sans-I/O): what one authenticated D key may make P hold, counted as a whole.

Per-D-rank limits alone bound nothing when a key can make up D rank names:
every limit is then multiplied by the names it says hello under. So P keeps
one budget per D key, in bytes, over everything that key makes it hold:

* its rank names, each with the NIXL metadata P loaded for it (NIXL keeps a
  parsed copy besides the bytes: ``METADATA_FACTOR``) and a fixed cost
  (``NAME_BYTES``: the peer record and NIXL's state for a loaded agent);
* its open registrations (``REGISTRATION_BYTES`` each) and the block ids
  they hold (``BLOCK_ID_BYTES`` each).

A key may be known under at most ``names_cap`` rank names: twice the ranks
its key set declares (``kvpush keys DIR --decode NAME --ranks N``: TP size
times DP of that D), else ``default_ranks``. Twice, because a D that
restarts says hello under new names while the old ones wait out
``peer_dead_s``. The key set decides and not the hello: the hello is the
peer's own word, the key set the operator's.

What one registration may hold is P's own view, never the peer's claim: a
prompt P prefills fits in P's cache, so no registration needs more blocks
per group than that many tokens fill in D's blocks (``block_ceiling``).

A hello's NIXL metadata must be what NIXL makes for the regions the hello
declares, with nothing after it (``metadata_problem``): NIXL keeps a loaded
blob's bytes, so a valid blob with a tail would otherwise cost P the tail
for every name.

Time and I/O stay with the caller; a refusal is a reason that names the key.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

NAME_BYTES = 256 << 10
"""What one D rank name costs P besides its metadata: the peer record, NIXL's state for the loaded agent
(its backend connection, the remote keys it unpacked). Measured well below this (docs/security.md)."""
METADATA_FACTOR = 3
"""P holds a loaded NIXL metadata blob about this many times over (the bytes, NIXL's parsed copy of them,
the backend's unpacked remote keys): a 6 MiB blob cost P about 14 MB."""
REGISTRATION_BYTES = 4 << 10
"""One open registration: the decoded message, the rendezvous entry, its record and plan."""
BLOCK_ID_BYTES = 16
"""One block id held in an open registration: 4 bytes as decoded, and what the plan built from it keeps."""

SERDES = b"nixlSerDes|"
"""NIXL's serialised metadata starts so (``nixlSerDes``): then ``tag, u64 length, value, "|"`` entries."""
MAX_CONN_BYTES = 64 << 10
"""A backend's connection info in NIXL metadata (a UCX worker address is a few hundred bytes)."""
MAX_DESC_BYTES = 8 << 10
"""One registered buffer's entry in NIXL metadata: address, length, device and the backend's remote key."""
MAX_BACKENDS = 16
"""Backends a hello may declare (``protocol.Hello.nixl_backends``)."""
OPAQUE_BASE_BYTES = 64 << 10
OPAQUE_PER_REGION_BYTES = 16 << 10
"""The size bound for metadata not in ``nixlSerDes`` form (another NIXL's format): base plus per region."""


@dataclass(frozen=True)
class KeyLimits:
    """What one D key may make a P rank hold (``Config``: ``peer_key_bytes``, ``peer_max_ranks``)."""

    max_bytes: int = 256 << 20
    default_ranks: int = 16


def names_cap(limits: KeyLimits, declared: int | None) -> int:
    """Rank names a key may be known under: twice its declared ranks (a restart's new names while the old
    ones wait out ``peer_dead_s``), else ``default_ranks``."""
    return 2 * declared if declared else limits.default_ranks


def name_cost(metadata_bytes: int) -> int:
    return NAME_BYTES + METADATA_FACTOR * metadata_bytes


def holding_cost(registrations: int, block_ids: int) -> int:
    return REGISTRATION_BYTES * registrations + BLOCK_ID_BYTES * block_ids


def block_ceiling(p_num_blocks: int, p_block_size: int, d_block_size: int) -> int:
    """Most block ids per group a registration can need: the tokens P's whole cache holds (a prompt P
    prefills fits in it), in D's blocks, plus one (D may hold a partial block at each end)."""
    tokens = p_num_blocks * p_block_size
    return -(-tokens // d_block_size) + 1


@dataclass
class _Key:
    names: dict[object, int] = field(default_factory=dict)  # rank name -> what it costs P


class Admission:
    """The rank names each D key is known under on one P rank, and what they cost P.

    ``hello`` says why a key may not take one more name ("" if it may); ``add``/``remove`` follow the names
    P takes and forgets; ``register`` says why a registration would put the key over its bytes, given what
    its names hold in open registrations now (kept by the rendezvous, per rank name).
    """

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits
        self._keys: dict[str, _Key] = {}

    def names(self, key: str) -> int:
        k = self._keys.get(key)
        return len(k.names) if k is not None else 0

    def names_bytes(self, key: str) -> int:
        k = self._keys.get(key)
        return sum(k.names.values()) if k is not None else 0

    def held(self, key: str, holdings: Iterable[tuple[int, int]]) -> int:
        """Bytes ``key`` makes P hold: its names, and ``holdings`` (registrations, block ids) of its names."""
        return self.names_bytes(key) + sum(holding_cost(r, b) for r, b in holdings)

    def hello(
        self, key: str, name: object, metadata_bytes: int, declared: int | None, holdings: Iterable[tuple[int, int]]
    ) -> str:
        """Why ``key`` may not be known under one more rank name ``name`` whose metadata has that many bytes."""
        k = self._keys.get(key)
        replaced = k.names.get(name) if k is not None else None  # the same name again (a restart)
        cap = names_cap(self.limits, declared)
        have = len(k.names) if k is not None else 0
        if replaced is None and have >= cap:
            where = f"{declared} ranks declared in its key set, x2" if declared else "peer_max_ranks"
            return f"D key {_short(key)} is known as {have} D ranks on this P rank already (limit {cap}: {where})"
        total = self.held(key, holdings) + name_cost(metadata_bytes) - (replaced or 0)
        if total > self.limits.max_bytes:
            return (
                f"D key {_short(key)} would make this P rank hold {total} bytes with one more D rank "
                f"(peer_key_bytes {self.limits.max_bytes})"
            )
        return ""

    def add(self, key: str, name: object, metadata_bytes: int) -> None:
        self._keys.setdefault(key, _Key()).names[name] = name_cost(metadata_bytes)

    def remove(self, key: str, name: object) -> None:
        k = self._keys.get(key)
        if k is None:
            return
        k.names.pop(name, None)
        if not k.names:
            del self._keys[key]

    def register(
        self, key: str, holdings: Iterable[tuple[int, int]], block_ids: int, replacing: int | None = None
    ) -> str:
        """Why ``key`` may not hold a registration of ``block_ids`` more ids ("" if it may); ``replacing``:
        the ids of the registration it replaces (None: it adds one)."""
        now = self.held(key, holdings)
        more = holding_cost(0 if replacing is not None else 1, block_ids - (replacing or 0))
        if now + more > self.limits.max_bytes:
            return (
                f"D key {_short(key)} would make this P rank hold {now + more} bytes "
                f"(peer_key_bytes {self.limits.max_bytes})"
            )
        return ""


def _short(key: str) -> str:
    return key[:8] + "…" if len(key) > 8 else (key or "(auth none)")


# -- NIXL metadata ---------------------------------------------------------------


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob, self.at = blob, 0

    def entry(self, tag: bytes, most: int) -> bytes:
        """The value of the entry ``tag`` at the cursor (``ValueError`` saying what is wrong)."""
        b, at = self.blob, self.at
        if b[at : at + len(tag)] != tag:
            raise ValueError(f"expected entry {tag.decode()!r} at byte {at}")
        at += len(tag)
        if at + 8 > len(b):
            raise ValueError(f"entry {tag.decode()!r} cut short at byte {at}")
        (n,) = struct.unpack_from("<Q", b, at)
        at += 8
        if n > most:
            raise ValueError(f"entry {tag.decode()!r} holds {n} bytes (at most {most})")
        if at + n + 1 > len(b) or b[at + n : at + n + 1] != b"|":
            raise ValueError(f"entry {tag.decode()!r} cut short at byte {at}")
        self.at = at + n + 1
        return b[at : at + n]

    def count(self, tag: bytes, most: int) -> int:
        raw = self.entry(tag, 8)
        if len(raw) != 8:
            raise ValueError(f"entry {tag.decode()!r} is not a count")
        (n,) = struct.unpack("<Q", raw)
        if n > most:
            raise ValueError(f"{tag.decode()!r} is {n} (at most {most})")
        return n


def metadata_problem(blob: bytes, regions: int, name_bytes: int = 1024) -> str:
    """Why ``blob`` is not NIXL metadata of an agent with at most ``regions`` registered buffers per backend
    and memory kind ("" if it is).

    In NIXL's form (``nixlSerDes``): the agent's name, its backends' connection info, then per backend and
    memory kind the buffers' entries, each of bounded size, and not one byte after them. In any other form
    (a NIXL whose format this does not know) only its size is bounded.
    """
    if not blob.startswith(SERDES):
        most = OPAQUE_BASE_BYTES + OPAQUE_PER_REGION_BYTES * regions
        if len(blob) > most:
            return f"NIXL metadata of {len(blob)} bytes for {regions} regions (at most {most})"
        return ""
    r = _Reader(blob)
    r.at = len(SERDES)
    try:
        r.entry(b"Agent", name_bytes)
        conns = r.count(b"Conns", MAX_BACKENDS)
        for _ in range(conns):
            r.entry(b"t", 64)
            r.entry(b"c", MAX_CONN_BYTES)
        if r.entry(b"", 64) != b"MemSection":
            raise ValueError("no MemSection")
        sections = r.count(b"nixlSecElms", 2 * MAX_BACKENDS)
        for _ in range(sections):
            r.entry(b"bknd", 64)
            if r.entry(b"nixlDList", 64) != b"nixlSDList":
                raise ValueError("no descriptor list")
            r.entry(b"t", 8)
            descs = r.count(b"n", regions)
            for _ in range(descs):
                r.entry(b"", MAX_DESC_BYTES)
    except ValueError as exc:
        return f"NIXL metadata is malformed or too large for {regions} regions: {exc}"
    if r.at != len(blob):
        return f"NIXL metadata has {len(blob) - r.at} bytes after its end (a blob of {r.at} bytes)"
    return ""


# -- connections before authentication ----------------------------------------------

CURVE_CLIENT_HANDSHAKE_BYTES = 64 + 202 + 266
"""What a CURVE client sends before its key is checked, at least: the ZMTP greeting (64), HELLO (200 and
its frame header) and INITIATE (257 at least, with its 9-byte long-frame header). A connection that has
sent this much has finished its handshake, or ZeroMQ is closing it (an INITIATE that fails its box or the
key check ends the connection); one that has sent less is still before authentication."""


class PreAuth:
    """Connections not yet past authentication, per source address; the oldest beyond ``per_address`` go.

    A client without a key can open connections and send nothing: each holds a descriptor of P until the
    handshake times out, and enough of them fill P's descriptor table, so that a real D's connection can
    not be accepted. Per source address, at most ``per_address`` such connections are kept: when one more
    is accepted, the oldest of that address that has not proven a key is shut. The newest stays, so a real
    D behind the same address (a NAT, a shared host) gets its connection through as long as its handshake
    (milliseconds) is faster than the attacker opens ``per_address`` new ones.

    Events in (``accepted``, ``proven``, ``closed``), connections to shut out; the shell learns which
    connections are past the handshake (``CURVE_CLIENT_HANDSHAKE_BYTES``) and shuts them.
    """

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self._addr: dict[int, object] = {}  # connection -> source address, not yet proven
        self._pending: dict[object, list[int]] = {}  # source address -> its unproven connections, oldest first
        self.shut_total = 0

    def pending(self, addr: object) -> list[int]:
        return list(self._pending.get(addr, ()))

    def __len__(self) -> int:
        return len(self._addr)

    def accepted(self, conn: int, addr: object) -> None:
        self.closed(conn)  # a descriptor number reused: whatever it was is gone
        self._addr[conn] = addr
        self._pending.setdefault(addr, []).append(conn)

    def proven(self, conn: int) -> None:
        """``conn`` is past the handshake: no longer counted."""
        self.closed(conn)

    def closed(self, conn: int) -> None:
        addr = self._addr.pop(conn, None)
        if addr is None:
            return
        conns = self._pending[addr]
        conns.remove(conn)
        if not conns:
            del self._pending[addr]

    def over(self, addr: object) -> int | None:
        """The oldest unproven connection of ``addr`` while it has more than ``per_address`` (else None): the
        shell says whether it is past its handshake by now (``proven``) or shuts it (``shut``)."""
        conns = self._pending.get(addr, [])
        return conns[0] if len(conns) > self.per_address else None

    def shut(self, conn: int) -> None:
        """``conn`` is being shut: forgotten (its close follows)."""
        self.closed(conn)
        self.shut_total += 1


# -- authenticated connections per key -------------------------------------------------


BARRED_S = 10.0
"""How long a D key that went over its connection cap more than a restart explains is barred (``KeyConns``), and
the interval its connections shut over its cap are counted in."""


class KeyConns:
    """Authenticated connections to one P rank's side channel, per D key; beyond a key's cap its oldest go, and a
    key that keeps going over it is barred for a while.

    Each connection may make ZeroMQ hold ``RCVHWM`` + 1 frames before the engine drains them, so the
    connections one key may open bound what its frames can cost P while they wait (unbounded, 192
    connections of one key sending 8 MiB frames took P to 1.5 GB). A D rank needs one connection to a P
    rank, so a key's cap is its names cap (``names_cap``: twice its declared ranks, else ``default_ranks``).
    When a key proves itself on one connection more than its cap, its oldest connection is shut, not the
    new one: the oldest of a real D is the one most likely dead without P knowing (a restarted D's
    connection replaces a half-open one of its previous life), and a key holder that opens more only
    loses its own. No other key's connection is touched.

    A key whose client reconnects each connection P shuts (ZeroMQ does, unasked) would make P authenticate
    and shut connections without end: one handshake and one shut per reconnection, all of it free work for
    the key holder. So within ``barred_s`` a key may have at most its cap of connections shut over its cap:
    enough for a restarted D to replace every connection of two previous lives (its names cap is twice its
    ranks). A handshake that would shut one more *bars* the key: that handshake and every other of the key
    for ``barred_s`` are refused before the key is admitted (``handshake``), so a barred key costs P no
    connection, no shut and, refused in the handshake, no reconnection of a ZeroMQ client. Its connections
    already admitted stay, and no other key is barred with it.

    Events in (``handshake``: a handshake proves ``key``, admitted or not; ``tied``: an admitted one's
    connection; ``closed``), the time passed in; connections to shut and refusals out. The shell answers
    each handshake, ties it to its connection and shuts what it is told to.
    """

    def __init__(self, cap: Callable[[str], int], barred_s: float = BARRED_S) -> None:
        self.cap = cap
        self.barred_s = barred_s
        self._key: dict[int, str] = {}  # connection -> the key it proved
        self._conns: dict[str, list[int]] = {}  # key -> its connections, oldest first
        self._shut_at: dict[str, list[float]] = {}  # key -> when its connections were shut over its cap, oldest first
        self._barred: dict[str, float] = {}  # key -> until when its handshakes are refused
        self.shut_total = 0
        self.barred_total = 0
        """Handshakes refused because their key was barred."""
        self.peak = 0
        """The most connections one key has held at once."""

    def count(self, key: str) -> int:
        return len(self._conns.get(key, ()))

    def key_of(self, conn: int) -> str | None:
        return self._key.get(conn)

    def barred(self, key: str, now: float) -> float:
        """Seconds ``key`` stays barred from ``now`` (0: it is not barred)."""
        return max(0.0, self._barred.get(key, now) - now)

    def handshake(self, key: str, now: float) -> str:
        """Why a handshake proving ``key`` at ``now`` is refused ("" if it is admitted, its ``tied`` to follow):
        the key is barred, or this handshake would have one more of its connections shut over its cap within
        ``barred_s`` than its cap, which bars it."""
        cap = max(1, self.cap(key))
        if self.barred(key, now) == 0.0:
            self._barred.pop(key, None)
            if self.count(key) < cap or len(self._recent(key, now)) < cap:
                return ""
            self._barred[key] = now + self.barred_s
            self._shut_at.pop(key, None)
        self.barred_total += 1
        return (
            f"D key {_short(key)} is barred for {self.barred(key, now):.1f} s more: it went over its connection "
            f"cap ({cap}) again and again ({cap} of its connections shut over it within {self.barred_s:g} s, and "
            "one more would have been; its connections open stay)"
        )

    def tied(self, conn: int, key: str, now: float) -> list[int]:
        """``conn`` proved ``key`` at ``now``: the connections of ``key`` to shut (its oldest beyond its cap)."""
        self.closed(conn)  # a descriptor number reused: whatever it was is gone
        self._key[conn] = key
        conns = self._conns.setdefault(key, [])
        conns.append(conn)
        cap = max(1, self.cap(key))
        shut = conns[: max(0, len(conns) - cap)]
        for c in shut:
            self.closed(c)
        if shut:
            self._shut_at[key] = self._recent(key, now) + [now] * len(shut)
        self.shut_total += len(shut)
        self.peak = max(self.peak, len(conns))
        return shut

    def closed(self, conn: int) -> None:
        key = self._key.pop(conn, None)
        if key is None:
            return
        conns = self._conns[key]
        conns.remove(conn)
        if not conns:
            del self._conns[key]

    def _recent(self, key: str, now: float) -> list[float]:
        """When ``key``'s connections were shut over its cap within the last ``barred_s`` (older ones dropped)."""
        times = [t for t in self._shut_at.get(key, ()) if t > now - self.barred_s]
        if times:
            self._shut_at[key] = times
        else:
            self._shut_at.pop(key, None)
        return times
