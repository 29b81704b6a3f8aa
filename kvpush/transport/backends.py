"""What each NIXL backend is like where kvpush must drive it differently (plain data, no NIXL import).

The engine speaks to every backend through :class:`kvpush.transport.nixl_agent.Agent`;
the agent reads these traits, so the engine never names a backend. Each trait
is a difference found by running kvpush over the backend; docs/libfabric.md
lists all differences found (some are limits to know, not to drive), and
docs/benchmarks.md has the measurements behind the numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BackendTraits:
    """How kvpush drives one NIXL backend."""

    descriptor_cost_us: float
    """Default of ``Config.descriptor_cost_us`` over this backend: what one more descriptor adds to a
    direct push, for the cost model that chooses between direct and staged plans."""
    drain_calls: int = 1
    """NIXL calls per poll while a transfer is in flight: P's poll of a WRITE, and D's poll for
    notifications while a transfer is being written to it (after P's ``Posting``). kvpush runs no
    NIXL progress thread, so these calls are what moves data and reaps completions. UCX handles
    everything pending in one call. LIBFABRIC reaps at most 16 completions per call (one per
    descriptor on each side), and over libfabric's tcp provider moves about one message: with one
    call per poll, D spends a poll interval per descriptor of a direct push and P learns late that a
    large WRITE has ended, holding its blocks meanwhile (docs/libfabric.md, difference 1)."""
    peer_errors_isolated: bool = True
    """A failed completion fails only its own transfer. Not so on LIBFABRIC driven without its
    progress thread: the plugin returns a failed completion from whichever call reads it, and NIXL
    keeps that as the polled transfer's final state, so a dead peer can fail transfers to live ones
    (cleanly: each ends once and holds nothing). Its progress thread would charge each completion to
    its own transfer, but stalled live peers' transfers behind a dead peer's writes (docs/libfabric.md)."""
    reloads_live_peer: bool = True
    """A peer's metadata unloaded and loaded again, the peer living on meanwhile, can be written to at
    once. Not so on LIBFABRIC: loading sends the plugin's handshake, and a peer that already holds a
    connection from this agent never answers it, while the plugin's first WRITE to the reloaded peer
    waits (inside the post) for that answer up to its handshake timeout. Where False, the agent keeps
    an unloaded peer's metadata loaded and reuses it when the same metadata comes back
    (docs/libfabric.md, difference 10)."""


UCX = BackendTraits(descriptor_cost_us=7.0)
LIBFABRIC = BackendTraits(descriptor_cost_us=11.0, drain_calls=32, peer_errors_isolated=False, reloads_live_peer=False)
TRAITS: dict[str, BackendTraits] = {"UCX": UCX, "LIBFABRIC": LIBFABRIC}


def traits(backends: Iterable[str]) -> BackendTraits:
    """The traits of an agent with these backends: the first one's costs (NIXL prefers it) and the
    most draining any of them needs. Backends kvpush has not measured are driven like UCX."""
    known = [TRAITS.get(b, UCX) for b in backends] or [UCX]
    return BackendTraits(
        known[0].descriptor_cost_us,
        max(t.drain_calls for t in known),
        all(t.peer_errors_isolated for t in known),
        all(t.reloads_live_peer for t in known),
    )
