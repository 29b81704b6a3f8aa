"""Seals: a NIXL notification bound to the side-channel link it belongs to (pure).

NIXL names the sender of a notification by the agent name that sender chose,
and any process that holds D's NIXL metadata (every P of the fleet gets it
from D's hello) can make an agent under another P rank's name. So D cannot
believe a notification by its name: it believes one sealed with a key that
only the P rank D registered with knows. P makes a fresh random key for each
hello it answers ok and gives it to D over the side channel, where CURVE has
authenticated and encrypted the connection D dialed to that P rank
(``protocol.LinkKey``); each notification then travels as a ``protocol.Sealed``
carrying the session's epoch (the hello's), a sequence number and a MAC.

The MAC is keyed BLAKE2b cut to 128 bits over the epoch, the sequence number
and the notification's bytes, personalised with the direction it is for
(``P_TO_D``), so nothing sealed one way verifies the other. Why keyed BLAKE2b
and not HMAC-SHA256: it is one call of the standard library either way, and
BLAKE2b's is about three times cheaper on a notification's few hundred bytes;
128 bits are far beyond what an online forger can try.

``Window`` is the replay rule of one session: each sequence number is taken
once, and one ``WINDOW`` or more behind the newest taken is refused as too
old. Notifications of one session arrive out of order (NIXL orders neither
WRITEs nor their notifications), so the rule keeps a window, not a counter.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct

from kvpush.core import protocol

KEY_BYTES = protocol.LINK_KEY_BYTES
MAC_BYTES = protocol.SEAL_MAC_BYTES
P_TO_D = b"kvpush-seal-p2d"
"""What a MAC of P's notifications to D is personalised with (BLAKE2b's ``person``, at most 16 bytes)."""
WINDOW = 1 << 16
"""How far behind the newest sequence number D took one may still be taken. P seals a part's notification
when it builds its WRITE, at the earliest when the push is planned, so the notifications sealed between
that and the post are a forward's worth of other pushes' parts to the same D rank: far fewer than this."""
_HEAD = struct.Struct("<QQ")


def mac(key: bytes, epoch: int, seq: int, body: bytes, person: bytes = P_TO_D) -> bytes:
    """The MAC of notification ``body``, number ``seq`` of the session of hello ``epoch``, under ``key``."""
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=person)
    h.update(_HEAD.pack(epoch, seq))
    h.update(body)
    return h.digest()


def seal(key: bytes, epoch: int, seq: int, body: bytes) -> protocol.Sealed:
    """``body`` (a notification's frame) sealed as number ``seq`` of the session of hello ``epoch``."""
    return protocol.Sealed(epoch, seq, mac(key, epoch, seq, body), body)


def verifies(key: bytes, sealed: protocol.Sealed) -> bool:
    """Whether ``sealed`` was sealed with ``key`` (compared in constant time)."""
    return hmac.compare_digest(mac(key, sealed.epoch, sealed.seq, sealed.body), sealed.mac)


class Key:
    """A link key made ready once for the MACs of its session: ``mac``, ``seal`` and ``verifies`` above, each
    starting from a copy of the keyed hash instead of keying it again (a MAC is on every notification's path,
    on both sides)."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes, person: bytes = P_TO_D) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a link key is {KEY_BYTES} bytes, not {len(key)}")
        self._keyed = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=person)

    def __repr__(self) -> str:  # never show the key
        return "Key(...)"

    def mac(self, epoch: int, seq: int, body: bytes) -> bytes:
        h = self._keyed.copy()
        h.update(_HEAD.pack(epoch, seq))
        h.update(body)
        return h.digest()

    def seal(self, epoch: int, seq: int, body: bytes) -> protocol.Sealed:
        return protocol.Sealed(epoch, seq, self.mac(epoch, seq, body), body)

    def verifies(self, sealed: protocol.Sealed) -> bool:
        return hmac.compare_digest(self.mac(sealed.epoch, sealed.seq, sealed.body), sealed.mac)


class Fresh(enum.Enum):
    """What a session's replay window says of a sequence number."""

    NEW = "new"
    REPLAYED = "replayed"  # taken before
    TOO_OLD = "too old"  # ``WINDOW`` or more behind the newest taken: whether it was taken is no longer known


class Window:
    """The sequence numbers one session has taken: the newest, and one bit for each of the ``size`` before it.

    ``take`` is called only for a notification whose MAC verified, so nobody without the key can move it.
    A bit's slot is ``seq % size``; when the newest moves on, the slots it passes are cleared.
    """

    def __init__(self, size: int = WINDOW) -> None:
        if size < 8 or size % 8:
            raise ValueError(f"a replay window holds a multiple of 8 sequence numbers, not {size}")
        self.size = size
        self.newest = 0
        self._bits = bytearray(size // 8)

    def take(self, seq: int) -> Fresh:
        """Take ``seq`` if it is new and recent enough; say why not otherwise."""
        if seq <= self.newest - self.size:
            return Fresh.TOO_OLD
        if seq > self.newest:
            ahead = seq - self.newest
            if ahead >= self.size:
                self._bits[:] = bytes(len(self._bits))
            else:
                for s in range(self.newest + 1, seq):
                    self._clear(s)
            self.newest = seq
            self._set(seq)
            return Fresh.NEW
        i = seq % self.size
        if self._bits[i >> 3] & (1 << (i & 7)):
            return Fresh.REPLAYED
        self._set(seq)
        return Fresh.NEW

    def _set(self, seq: int) -> None:
        i = seq % self.size
        self._bits[i >> 3] |= 1 << (i & 7)

    def _clear(self, seq: int) -> None:
        i = seq % self.size
        self._bits[i >> 3] &= ~(1 << (i & 7)) & 0xFF
