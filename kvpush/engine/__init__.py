"""The threaded engine: P's push sender and D's receiver."""

from kvpush.engine.receiver import Receiver
from kvpush.engine.sender import Sender
from kvpush.engine.types import PeerAddress

__all__ = ["PeerAddress", "Receiver", "Sender"]
