"""Plain data the engine hands to and returns from its callers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerAddress:
    """Where D finds a P instance's side channel: rank r listens on ``port + r``."""

    host: str
    port: int
    tp_size: int = 1
