"""When P seals its NIXL notifications to a D rank, and with what (sans-I/O).

One ``Sealer`` per D rank's session (the hello P answered ok): the session's
key, which P gave that D rank in its ``LinkKey``, and the hello's epoch. P
seals only once the D rank said it checks the seals of that very session
(``SealsChecked``): a D on an older protocol never says so, and it would
refuse a ``Sealed`` notification, so it keeps getting them as they were
(and no protection). A D rank says it before it registers anything on that
connection, so every Completion of its pushes is sealed.

The key is made by the shell (the operating system's randomness); the rule
of which sequence number comes next, and of whether to seal, is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.core import protocol, seal


@dataclass
class Sealer:
    """The seals of one D rank's session: ``key`` (``seal.KEY_BYTES``, secret) and the hello's ``epoch``."""

    key: bytes
    epoch: int
    checked: bool = False
    """The D rank said it checks this session's seals: notifications to it are sealed."""
    seq: int = 0
    """The sequence number of the last seal made (the first is 1)."""

    def __post_init__(self) -> None:
        self._key = seal.Key(self.key)  # raises on a key of the wrong size

    def __repr__(self) -> str:  # never show the key
        return f"Sealer(epoch={self.epoch}, checked={self.checked}, seq={self.seq})"

    def checks(self, epoch: int) -> bool:
        """The D rank says it checks the seals of the session of hello ``epoch``; True if that is this session
        (one for another session changes nothing)."""
        if epoch == self.epoch:
            self.checked = True
        return epoch == self.epoch

    def seal(self, notif: bytes) -> bytes:
        """What to send for notification ``notif`` (a frame): sealed once the D rank checks seals, else as is."""
        if not self.checked:
            return notif
        self.seq += 1
        return protocol.encode(self._key.seal(self.epoch, self.seq, notif))
