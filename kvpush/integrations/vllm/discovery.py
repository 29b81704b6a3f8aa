"""Announcing a P or D instance to a router's service discovery (vLLM's conventions).

vllm-router (``--vllm-discovery-address``) and vLLM's P2P/MoRI-IO proxies
keep a registry of instances fed by heartbeats: every few seconds each
instance sends a msgpack map ``{"type": "P" | "D", "http_address",
"zmq_address", "transfer_mode", ...}`` over a ZMQ DEALER to
``proxy_ip:proxy_ping_port``; an entry not refreshed within five seconds is
dropped. The router names both instances' ``zmq_address`` in the request id
it sends both (``___prefill_addr_<P>___decode_addr_<D>_<uuid>``), which is
how D finds P's side channel there (``params``). A ``WRITE`` transfer mode
makes vllm-router send P and D their requests at once: D registers while P
computes, the overlap push is built for.

Enabled by ``proxy_ip``, ``proxy_ping_port`` and ``http_port`` in
``kv_connector_extra_config``, the names vLLM's connectors use.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import zmq

from kvpush.config import Config
from kvpush.core.errors import ConfigError

log = logging.getLogger(__name__)

ANNOUNCE_S = 1.0
"""Heartbeat period: well inside the router's five-second expiry, so one lost beat drops nothing."""


def announcement(cfg: Config, producer: bool, tp_size: int) -> dict[str, Any] | None:
    """The heartbeat payload of this instance, or ``None`` when no discovery is configured."""
    if not cfg.proxy_ip:
        return None
    missing = [k for k in ("proxy_ping_port", "http_port") if not getattr(cfg, k)]
    if missing:
        raise ConfigError(f"kvpush: proxy_ip {cfg.proxy_ip!r} is set but {' and '.join(missing)} is not")
    host = cfg.side_channel_host
    return {
        "type": "P" if producer else "D",
        "http_address": f"{host}:{cfg.http_port}",
        "zmq_address": f"{host}:{cfg.side_channel_port}",
        "tp_size": tp_size,
        "dp_size": 1,
        "transfer_mode": "WRITE",
    }


class Announcer:
    """A daemon thread sending this instance's heartbeat until ``close``.

    Beats are never queued for a router that is not there (``IMMEDIATE``):
    a router that starts later sees the next one, not a backlog.
    """

    def __init__(self, address: str, payload: dict[str, Any], period_s: float = ANNOUNCE_S) -> None:
        self.address = address
        self._frame = msgspec.msgpack.encode(payload)
        self._period = period_s
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="kvpush-announce", daemon=True)
        self._thread.start()
        log.info("kvpush: announcing %s to the router's discovery at %s", payload, address)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{self.address}")
        try:
            while not self._stop.is_set():
                try:
                    sock.send(self._frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no router connected yet
                self._stop.wait(self._period)
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def start_announcer(cfg: Config, producer: bool, tp_size: int) -> Announcer | None:
    """An ``Announcer`` for ``cfg``'s router discovery, if one is configured."""
    payload = announcement(cfg, producer, tp_size)
    if payload is None:
        return None
    return Announcer(f"{cfg.proxy_ip}:{cfg.proxy_ping_port}", payload)
