"""Checks that need a NIXL agent, run inside a worker process (``Worker.op_check``).

Importing NIXL costs seconds (it imports torch) and a NIXL agent's start more,
slower still when several processes start at once; the P worker has paid both
already. So the in-process registration contracts run there, and the test
process never imports NIXL. Each check raises ``AssertionError`` with a
message that stands alone, because it reaches the test as text.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kvpush.backends.base import Backend, MemRegistration
from kvpush.conformance.model import Geom, payload
from kvpush.conformance.target import Target

_names = itertools.count()


def _fill(backend: Backend, kv: dict[str, Any], geom: Geom, seed: int) -> np.ndarray:
    data = payload(geom, seed)
    for i, t in enumerate(kv.values()):
        backend.write_bytes(t, data[i].reshape(-1))
    return data


def _agent(target: Target) -> Any:
    from kvpush.transport.nixl_agent import Agent

    return Agent(f"conformance-check-{next(_names)}", target.nixl_backends)


def register_deregister_round_trip(target: Target, geom: Geom) -> None:
    """registrations() register with a real agent, deregister to zero, register again; staging too; close frees all."""
    backend = target.make()
    kv = backend.make_test_cache(geom.spec(), geom.layers, geom.num_blocks, target.p_device)
    agent = None
    try:
        _fill(backend, kv, geom, 2)
        layout = backend.describe(kv, geom.spec())
        regs = backend.registrations(layout)
        bad = [g for g in regs if not (isinstance(g, MemRegistration) and g.size > 0 and g.addr > 0)]
        assert not bad, f"registrations() gave malformed entries: {bad}"
        staging = backend.alloc_staging(1 << 20, layout.regions[0].device_id)
        assert staging.size >= 1 << 20 and staging.addr > 0, f"alloc_staging(1 MiB) gave {staging}"
        agent = _agent(target)
        kinds = len({g.mem for g in regs})
        for round_ in range(2):
            agent.register(regs)
            agent.register([MemRegistration(staging.addr, staging.size, staging.device_id, staging.mem)])
            assert agent.registered == kinds + 1, f"round {round_}: {agent.registered} registrations held"
            agent.deregister_all()
            assert agent.registered == 0, f"round {round_}: {agent.registered} registrations left after deregister"
        agent.register(regs)
        agent.close()
        assert agent.registered == 0, "closing the agent left registrations"
        agent = None
    finally:
        if agent is not None:
            agent.close()
        backend.free_test_cache(kv)
        backend.close()


def reregistration_after_free(target: Target, geom: Geom) -> None:
    """A cache deregistered and freed, then a new one (maybe at the same addresses): described and registered afresh."""
    backend = target.make()
    agent = _agent(target)
    try:
        for seed in (3, 4):
            kv = backend.make_test_cache(geom.spec(), geom.layers, geom.num_blocks, target.p_device)
            data = _fill(backend, kv, geom, seed)
            layout = backend.describe(kv, geom.spec())
            agent.register(backend.registrations(layout))
            got = np.stack([np.asarray(backend.read_bytes(t), np.uint8).reshape(-1) for t in kv.values()])
            assert np.array_equal(got.reshape(geom.shape()), data), f"cache {seed}: read_bytes differs from write"
            agent.deregister_all()
            assert agent.registered == 0
            backend.free_test_cache(kv)
            del kv
    finally:
        agent.close()
        backend.close()


CHECKS = {f.__name__: f for f in (register_deregister_round_trip, reregistration_after_free)}
