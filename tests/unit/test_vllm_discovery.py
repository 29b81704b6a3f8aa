"""Announcing an instance to a router's service discovery, as vLLM's connectors do (vllm-router's format)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvpush.config import Config
from kvpush.core.errors import ConfigError
from kvpush.integrations.vllm.discovery import Announcer, announcement
from kvpush_tools.demo.launcher import free_port


def test_payload_names_the_side_channel_and_asks_for_concurrent_dispatch() -> None:
    cfg = Config.from_dict(
        {"proxy_ip": "10.0.0.3", "proxy_ping_port": 30001, "http_port": 8100, "side_channel_host": "10.0.0.1"}
    )
    assert announcement(cfg.replace(side_channel_port=5600), True, 2) == {
        "type": "P",
        "http_address": "10.0.0.1:8100",
        "zmq_address": "10.0.0.1:5600",
        "tp_size": 2,
        "dp_size": 1,
        "transfer_mode": "WRITE",
    }
    assert announcement(cfg, False, 1)["type"] == "D"  # type: ignore[index]
    assert announcement(Config.from_dict({}), True, 1) is None


def test_discovery_without_its_ports_is_named() -> None:
    with pytest.raises(ConfigError, match="proxy_ping_port and http_port"):
        announcement(Config.from_dict({"proxy_ip": "10.0.0.3"}), True, 1)


def test_announcer_beats_reach_a_router_that_starts_later() -> None:
    ctx = zmq.Context.instance()
    # Probed with a plain socket (closed when the probe returns; a ZMQ socket's close ends later, on its I/O
    # thread, and its port was once found still held), below the ephemeral range. Nothing listens yet: beats
    # are dropped, not queued.
    port = free_port()
    payload = {"type": "D", "http_address": "h:1", "zmq_address": "h:2", "transfer_mode": "WRITE"}
    ann = Announcer(f"127.0.0.1:{port}", payload, period_s=0.05)
    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{port}")
        assert router.poll(5000), "no heartbeat within 5 s"
        _ident, frame = router.recv_multipart()
        assert msgspec.msgpack.decode(frame) == payload
        router.close()
    finally:
        ann.close()
