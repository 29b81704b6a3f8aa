"""A P engine and a D engine in this process, over real NIXL UCX agents, on host caches.

For tests that need real transfers but not two processes (metrics, timeline):
the engines, agents and side channel are the production ones; only the
process boundary is missing. ``tests/nixl/test_push_nixl.py`` covers two processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backends.base import CacheSpec
from kvpush.backends.host import HostBackend
from kvpush.config import Config
from kvpush.core.outcome import Result
from kvpush.engine import PeerAddress, Receiver, Sender
from kvpush.transport import key_set

SPEC = CacheSpec(block_size=16, num_heads=4, head_dim=64, dtype="float16")
LAYERS = 2
NUM_BLOCKS = 64
TOKEN_BYTES = LAYERS * 2 * SPEC.num_heads * SPEC.head_dim * 2
"""Bytes of one token over all layers, K and V (float16), computed here, not from kvpush.core.layout."""


@dataclass
class Pair:
    sender: Sender
    receiver: Receiver
    p_kv: dict[str, Any]
    d_kv: dict[str, Any]
    layout: Any

    @property
    def peer(self) -> PeerAddress:
        return PeerAddress(self.sender.address[0], self.sender.address[1], 1)

    def push(self, tid: str, num_tokens: int, p_blocks: list[int], d_blocks: list[int], prefill: bool = True) -> None:
        """Register D's blocks, then (unless ``prefill`` is False) hand P's finished prefill over."""
        cap = key_set.session_capability(tid)
        self.receiver.register(tid, f"d-{tid}", self.peer, [d_blocks], num_tokens, capability=cap)
        if prefill:
            self.sender.prefill_finished(tid, f"p-{tid}", [p_blocks], num_tokens)

    def wait(self, engine: Sender | Receiver, count: int, timeout: float = 30.0) -> list[Result]:
        out: list[Result] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{engine.name}: {len(out)} of {count} results after {timeout}s")
            out += engine.poll()
            time.sleep(0.001)
        return out


@contextmanager
def local_pair(**cfg: Any) -> Iterator[Pair]:
    be = HostBackend()
    p_kv = be.make_test_cache(SPEC, LAYERS, NUM_BLOCKS)
    d_kv = be.make_test_cache(SPEC, LAYERS, NUM_BLOCKS)
    rng = np.random.default_rng(0)
    for t in p_kv.values():
        be.write_bytes(t, rng.integers(0, 256, t.nbytes, dtype=np.uint8))
    config = Config.from_dict({"side_channel_port": 0, **cfg})
    layout = be.describe(p_kv, SPEC)
    sender = Sender(config, be, layout, "test-p")
    receiver = Receiver(config, be, be.describe(d_kv, SPEC), "test-d")
    try:
        yield Pair(sender, receiver, p_kv, d_kv, layout)
    finally:
        receiver.close()
        sender.close()
