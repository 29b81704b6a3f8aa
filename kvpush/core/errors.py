"""Exceptions. Messages name the peer, request and stage where known, because
an operator reads them in a log of thousands of transfers."""


class KVPushError(Exception):
    """Base of every kvpush error."""


class ConfigError(KVPushError, ValueError):
    """Bad or unknown configuration keys or values."""


class ProtocolError(KVPushError):
    """A message that cannot be decoded or fails validation."""


class LayoutError(KVPushError, ValueError):
    """A KV layout that is inconsistent, or two that cannot exchange KV."""


class BackendError(KVPushError):
    """A backend cannot describe, register or order the given memory."""


class MemoryKindError(ConfigError):
    """No NIXL backend of an agent registers a memory kind the KV or staging lives in."""
