"""kvpush: push-based KV-cache transfer for prefill/decode disaggregation."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 9
