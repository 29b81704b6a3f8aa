"""What the router sends P and D in each mode (pure: request bodies in, request bodies out).

Modes (``--mode``), i.e. which KV connector the vLLM instances run:

``kvpush`` (default)
    P and D are sent their requests *concurrently*: D allocates blocks and
    registers them with P while P is still prefilling, and P pushes the KV
    as soon as both meet. P gets ``max_tokens=1`` and
    ``kv_transfer_params={"do_remote_decode": true, "transfer_id": tid}``;
    D gets the client's body plus ``{"do_remote_prefill": true,
    "transfer_id": tid, "remote_host", "remote_port", "remote_tp_size"}``
    (P's kvpush side channel).
``vllm-pull`` (vLLM's ``NixlConnector``)
    P first; D then gets the ``kv_transfer_params`` P returned and pulls.
``vllm-push`` (vLLM's ``NixlPushConnector``)
    Concurrent like kvpush, in vLLM's conventions only: vLLM 0.32 pairs P
    and D by request id (its random suffix stripped), so both get the same
    ``X-Request-Id`` and no transfer id; D also gets P's NIXL engine id,
    side-channel address and TP size. The engine id comes from
    ``--prefill-engine-id`` (set ``"engine_id"`` in P's
    ``kv_transfer_config``); when it is unknown, the first request to that P
    runs P first and learns it from P's response (push pairing works in
    either order), later requests are concurrent. kvpush's connector speaks
    these conventions too, so this mode drives kvpush servers unchanged.

Capabilities (``kvpush.core.capability``): with the P fleet's capability key
(``--capability-key``), the router mints each transfer's capability and
sends it to D with the transfer id (kvpush, and vllm-push where it then also
sends both sides ``transfer_id``, which vLLM's connectors ignore); in
vllm-pull D gets P's answer, which carries P's own. Without the key, D gets
none, and P must run with ``"capability": "optional"``.

A client's own ``kv_transfer_params`` never reach P or D unless the router
is told to trust them (``client_params``): they would let a client choose
transfer ids, hosts and ports.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from kvpush.core.capability import mint
from kvpush.integrations.router.pool import Instance

MODES = ("kvpush", "vllm-pull", "vllm-push")
CLIENT_PARAMS = ("reject", "strip", "trust")
"""What the router does with a client's ``kv_transfer_params``: answer 400, drop them, or let them override."""


def client_params_error(body: dict[str, Any], policy: str) -> str | None:
    """Why a client's body is refused under ``policy`` (``None``: it may go on); ``strip`` removes the field."""
    if "kv_transfer_params" not in body or policy == "trust":
        return None
    if policy == "strip":
        body.pop("kv_transfer_params")
        return None
    return (
        "kv_transfer_params is set by the router, not by clients (it names transfer ids, hosts and ports); "
        "remove it, or start the router with --client-kv-params trust"
    )


def with_client_params(params: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``params`` overridden by a trusted client's own ``kv_transfer_params`` (none: unchanged)."""
    client = body.get("kv_transfer_params")
    return {**params, **client} if isinstance(client, dict) else params


def new_transfer_id() -> str:
    """A fresh id naming one P/D transfer (also sent as ``X-Request-Id``)."""
    return uuid.uuid4().hex


def capability_of(key: bytes | None, tid: str) -> str:
    """The capability the router gives D for transfer ``tid`` ("" without the key)."""
    return mint(key, tid) if key is not None else ""


def prefill_body(body: dict[str, Any], mode: str, tid: str, bound: bool = False) -> dict[str, Any]:
    """The request P gets: the client's, cut to one output token, not streamed,
    tagged so P keeps (kvpush, vllm-push) or offers (vllm-pull) its KV."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out or "messages" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # vLLM rejects these on a non-streamed / one-token request.
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    if mode == "kvpush":
        out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
    elif mode in ("vllm-pull", "vllm-push"):
        # vLLM's proxy conventions only: its push connector pairs by X-Request-Id, not a transfer id.
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        if mode == "vllm-push" and bound:
            # The id the capability is minted for; vLLM's connectors ignore the field.
            out["kv_transfer_params"]["transfer_id"] = tid
    else:
        raise ValueError(f"unknown router mode {mode!r}; expected one of {MODES}")
    return out


def decode_params(
    mode: str, tid: str, prefill: Instance, prefill_response: dict[str, Any] | None = None, capability: str = ""
) -> dict[str, Any]:
    """``kv_transfer_params`` for D.

    kvpush and vllm-push know everything up front (P's coordinates); vllm-pull
    needs ``prefill_response``, P's response JSON, whose ``kv_transfer_params``
    say where P's blocks are (and carry P's capability). ``capability``: the router's for ``tid``
    (``capability_of``), sent in kvpush and vllm-push modes with the id it is for. Raises ``ValueError``
    when a needed piece is missing, so a misconfigured router fails loudly, not with a stuck D.
    """
    if mode == "kvpush":
        if prefill.kv_host is None or prefill.kv_port is None:
            raise ValueError(f"{prefill.name}: no KV side-channel address (--prefill-kv) for mode kvpush")
        out = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": prefill.kv_host,
            "remote_port": prefill.kv_port,
            "remote_tp_size": prefill.tp_size,
        }
        return {**out, "capability": capability} if capability else out
    if mode == "vllm-pull":
        params = (prefill_response or {}).get("kv_transfer_params")
        if not isinstance(params, dict) or not params:
            raise ValueError(f"{prefill.name} returned no kv_transfer_params (is it running NixlConnector?)")
        return params
    if mode == "vllm-push":
        engine_id = prefill.engine_id
        if engine_id is None and prefill_response is not None:
            engine_id = (prefill_response.get("kv_transfer_params") or {}).get("remote_engine_id")
        if engine_id is None:
            raise ValueError(f"{prefill.name}: NIXL engine id unknown (--prefill-engine-id)")
        if prefill.kv_host is None or prefill.kv_port is None:
            raise ValueError(f"{prefill.name}: no NIXL side-channel address (--prefill-kv) for mode vllm-push")
        p_cap = ((prefill_response or {}).get("kv_transfer_params") or {}).get("capability")
        bound = {"transfer_id": tid, "capability": capability or p_cap} if capability or p_cap else {}
        return {
            **bound,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            # P's internal id carries a random suffix we cannot know; vLLM
            # pairs push requests by the suffix-stripped X-Request-Id, and
            # uses this only for lease heartbeats.
            "remote_request_id": tid,
            "remote_host": prefill.kv_host,
            "remote_port": prefill.kv_port,
            "tp_size": prefill.tp_size,
        }
    raise ValueError(f"unknown router mode {mode!r}; expected one of {MODES}")


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The request D gets: the client's body unchanged plus ``params``."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = params
    return out


def concurrent(mode: str, prefill: Instance) -> bool:
    """Whether P and D run at the same time for this P (else P first)."""
    return mode == "kvpush" or (mode == "vllm-push" and prefill.engine_id is not None)
