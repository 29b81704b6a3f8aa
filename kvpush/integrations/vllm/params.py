"""A request's ``kv_transfer_params``: what role it gives the request, and what P answers (pure, no vLLM import).

Routers written for vLLM's NIXL connectors and for kvpush speak slightly
different dialects; both are read here, in one place, so a router drives
kvpush with only the connector name changed:

* P gets ``{"do_remote_decode": true, ...}``; any other field is optional
  (vllm-router sends ``remote_*: null``).
* D gets ``{"do_remote_prefill": true, ...}`` with P's side channel as
  ``remote_host``/``remote_port`` (P rank r listens on ``remote_port + r``),
  P's TP size as ``tp_size`` (vLLM) or ``remote_tp_size`` (kvpush), and the
  transfer id as ``transfer_id``. vLLM's own fields (``remote_engine_id``,
  ``remote_request_id``, ``remote_block_ids``, ``transfer_mode``, ...) are
  accepted and not needed: push pairs by transfer id, not by P's blocks.
* ``capability``: the transfer's capability (``kvpush.core.capability``), from P's
  answer (a sequential router passes it on untouched) or from the router
  (concurrent dispatch). D sends it with its registration; P refuses a
  registration or abort without it unless P's ``capability`` is "optional".
* Without ``transfer_id`` the pair is named by the request id, as vLLM's push
  connector does: the router sends P and D the same ``X-Request-Id`` and each
  side drops what vLLM appended (``cmpl-``, the prompt index, the random
  suffix). vllm-router's service-discovery modes name P in the request id
  (``___prefill_addr_HOST:PORT___decode_addr_...``); D takes P's side channel
  from there when ``remote_host``/``remote_port`` are absent.

One request, several prompts: vLLM splits a completions request with a list
of prompts (and ``n > 1``) into sub-requests that share the request's one
``kv_transfer_params``. Each sub-request gets its own transfer, derived the
same way on P and D from the shared id and the sub-request's place in the
request (``cmpl-<id>-<prompt>-<suffix>``, children ``<child>_<parent>``); the
first keeps the shared id, so single-prompt requests carry the router's id
unchanged. P's answer names the shared id, which is what a sequential router
hands D for every sub-request.

Bad values raise ``ConfigError`` naming the field, where the request enters
vLLM, not deep in a transfer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvpush.core.capability import CAPABILITY_CHARS, mint, sub_request_id
from kvpush.core.errors import ConfigError
from kvpush.engine.types import PeerAddress

MAX_TRANSFER_ID = 256
"""Longest transfer id the wire protocol carries."""

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z", re.IGNORECASE)
_CHILD = re.compile(r"([0-9]+)_(.+)")
_PROMPT_INDEX = re.compile(r"cmpl-(.+)-([0-9]+)")
_PREFILL_ADDR = re.compile(r"___prefill_addr_(?:tcp://)?(\[[^\]]+\]|[^_:/]+):([0-9]+)___decode_addr_")
"""vLLM writes its indexes and ports in ASCII digits, so only those are read as such (``\\d`` also matches other
scripts' digits, which ``int`` reads too); the id patterns match whole ids (``fullmatch``; ``$`` lets a newline
follow)."""


@dataclass(frozen=True)
class SubRequest:
    """Where vLLM's request id puts a sub-request: the id the router gave, the prompt and the child index."""

    base: str
    prompt: int = 0
    child: int = 0

    def transfer_id(self, shared: str) -> str:
        """The sub-request's own transfer id, derived from the request's ``shared`` one (``sub_request_id``)."""
        return sub_request_id(shared, self.prompt, self.child)


def sub_request(request_id: str) -> SubRequest:
    """Undo what vLLM's front end does to a request id (pure string rules, as vLLM applies them).

    ``<child>_`` prefixes the children of ``n > 1``; ``-<8 hex>`` is the
    random suffix vLLM appends to every id; completions name sub-request i
    ``cmpl-<id>-<i>``. Chat and other endpoints have one prompt (index 0).
    """
    child = 0
    m = _CHILD.fullmatch(request_id)
    if m:
        child, request_id = int(m.group(1)), m.group(2)
    rid = _RANDOM_SUFFIX.sub("", request_id)
    m = _PROMPT_INDEX.fullmatch(rid)
    if m:
        return SubRequest(f"cmpl-{m.group(1)}", int(m.group(2)), child)
    return SubRequest(rid, 0, child)


@dataclass(frozen=True)
class PrefillSide:
    """This request runs its prefill here and D will pull nothing: we push.

    ``shared_id`` is the request's transfer id before the sub-request's part
    was added: what P tells a sequential router.
    """

    transfer_id: str
    shared_id: str = ""


@dataclass(frozen=True)
class DecodeSide:
    """This request's prompt KV comes from a P instance."""

    transfer_id: str
    peer: PeerAddress
    capability: str = field(default="", repr=False)


def parse(params: dict[str, Any] | None, request_id: str) -> PrefillSide | DecodeSide | None:
    """What role a request plays; ``None`` when it is not disaggregated."""
    if not params:
        return None
    if not isinstance(params, dict):
        raise ConfigError(f"request {request_id}: kv_transfer_params must be a JSON object, got {params!r}")
    decode = _flag(params, "do_remote_decode", request_id)
    prefill = _flag(params, "do_remote_prefill", request_id)
    if not decode and not prefill:
        return None
    sub = sub_request(request_id)
    shared = _shared_id(params, sub, request_id)
    tid = sub.transfer_id(shared)
    if len(tid) > MAX_TRANSFER_ID:
        raise ConfigError(
            f"request {request_id}: kv_transfer_params.transfer_id {shared[:40]!r}... is too long "
            f"({len(tid)} characters with the sub-request's part; at most {MAX_TRANSFER_ID})"
        )
    if decode:
        return PrefillSide(tid, shared)
    return DecodeSide(tid, _peer(params, request_id), _capability(params, request_id))


def _flag(params: dict[str, Any], key: str, request_id: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"request {request_id}: kv_transfer_params.{key} must be true or false, got {value!r}")
    return value


def _shared_id(params: dict[str, Any], sub: SubRequest, request_id: str) -> str:
    tid = params.get("transfer_id")
    if tid is None:
        # No id from the router: name the pair by the request id, which the
        # router must then send identically to P and D (X-Request-Id).
        return sub.base
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID:
        raise ConfigError(
            f"request {request_id}: kv_transfer_params.transfer_id must be a string of 1-{MAX_TRANSFER_ID} "
            f"characters, got {tid!r}"
        )
    return tid


def _capability(params: dict[str, Any], request_id: str) -> str:
    cap = params.get("capability")
    if cap is None:
        return ""
    if not isinstance(cap, str) or len(cap) != CAPABILITY_CHARS:
        # The value is not echoed: it is a secret, even when malformed.
        raise ConfigError(
            f"request {request_id}: kv_transfer_params.capability must be a string of {CAPABILITY_CHARS} characters "
            "(as P's answer or the router gives it)"
        )
    return cap


def _peer(params: dict[str, Any], request_id: str) -> PeerAddress:
    host, port = params.get("remote_host"), params.get("remote_port")
    if host is None and port is None:
        hint = _PREFILL_ADDR.search(request_id)
        if hint is None:
            raise ConfigError(
                f"request {request_id}: kv_transfer_params.remote_host and remote_port are missing "
                "(P's side channel; a router that sends P first passes on the kv_transfer_params P returned)"
            )
        host, port = hint.group(1).strip("[]"), int(hint.group(2))
    if not isinstance(host, str) or not host:
        raise ConfigError(f"request {request_id}: kv_transfer_params.remote_host must be a host name, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"request {request_id}: kv_transfer_params.remote_port must be a port 1-65535, got {port!r}")
    return PeerAddress(host, port, _tp_size(params, request_id))


def _tp_size(params: dict[str, Any], request_id: str) -> int:
    sizes = {k: params[k] for k in ("tp_size", "remote_tp_size") if params.get(k) is not None}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"request {request_id}: kv_transfer_params.{key} must be an integer >= 1, got {value!r}")
    if len(set(sizes.values())) > 1:
        raise ConfigError(
            f"request {request_id}: kv_transfer_params.tp_size {sizes['tp_size']} and remote_tp_size "
            f"{sizes['remote_tp_size']} disagree (both name P's tensor-parallel size)"
        )
    for key in ("pp_size", "dcp_size"):
        value = params.get(key)
        if value is not None and value != 1:
            raise ConfigError(
                f"request {request_id}: kv_transfer_params.{key} {value!r} is not supported (kvpush pushes from "
                "P instances without pipeline or decode-context parallelism: 1)"
            )
    return next(iter(sizes.values()), 1)


@dataclass(frozen=True)
class PrefillAdvert:
    """What P tells D about itself in its answer: its engine id, side channel and parallel sizes."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    capability_key: bytes | None = field(default=None, repr=False)
    """The P fleet's capability key (``kvpush.core.capability``); None: P's answer carries no capability."""


def prefill_answer(advert: PrefillAdvert, role: PrefillSide, request_id: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` P returns with its one-token answer (vLLM's field names).

    A sequential router hands them to D unchanged, so they hold everything
    D's connector needs; ``transfer_id`` is the shared id (each of D's
    sub-requests derives its own from it, as P's did).
    """
    shared = role.shared_id or role.transfer_id
    out = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": advert.engine_id,
        "remote_request_id": request_id,
        "remote_host": advert.host,
        "remote_port": advert.port,
        "tp_size": advert.tp_size,
        "transfer_id": shared,
    }
    if advert.capability_key is not None:
        out["capability"] = mint(advert.capability_key, shared)
    return out
