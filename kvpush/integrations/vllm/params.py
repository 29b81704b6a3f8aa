"""Reading a request's ``kv_transfer_params`` (pure, no vLLM import).

The router puts these on each request: on P ``{"do_remote_decode": true,
"transfer_id": ...}``; on D ``{"do_remote_prefill": true, "transfer_id": ...,
"remote_host": ..., "remote_port": ..., "remote_tp_size": ...}``. A request
without them is not disaggregated and passes through untouched. Bad values
are errors naming the field, raised where the request enters, not deep in a
transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.engine.types import PeerAddress
from kvpush.errors import ConfigError


@dataclass(frozen=True)
class PrefillSide:
    """This request runs its prefill here and D will pull nothing: we push."""

    transfer_id: str


@dataclass(frozen=True)
class DecodeSide:
    """This request's prompt KV comes from a P instance."""

    transfer_id: str
    peer: PeerAddress


def parse(params: dict[str, Any] | None, request_id: str) -> PrefillSide | DecodeSide | None:
    """What role a request plays; ``None`` when it is not disaggregated."""
    if not params:
        return None
    if params.get("do_remote_decode"):
        return PrefillSide(_tid(params, request_id))
    if params.get("do_remote_prefill"):
        tid = _tid(params, request_id)
        host = params.get("remote_host")
        port = params.get("remote_port")
        tp = params.get("remote_tp_size", 1)
        if not isinstance(host, str) or not host:
            raise ConfigError(f"request {request_id}: kv_transfer_params.remote_host missing or not a string")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"request {request_id}: kv_transfer_params.remote_port {port!r} is not a port")
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"request {request_id}: kv_transfer_params.remote_tp_size {tp!r} must be >= 1")
        return DecodeSide(tid, PeerAddress(host, port, tp))
    return None


def _tid(params: dict[str, Any], request_id: str) -> str:
    tid = params.get("transfer_id")
    if tid is None:
        # No router-assigned id: fall back to the request id, which the
        # router must then send identically to P and D (X-Request-Id).
        return request_id
    if not isinstance(tid, str) or not 0 < len(tid) <= 256:
        raise ConfigError(f"request {request_id}: kv_transfer_params.transfer_id must be a 1-256 char string")
    return tid
