"""What each NIXL backend is like where kvpush must drive it differently (plain data, no NIXL import).

The engine speaks to every backend through :class:`kvpush.transport.nixl_agent.Agent`;
the agent reads these traits, so the engine never names a backend. Each trait
is a difference found by running kvpush over the backend; docs/libfabric.md
lists all differences found (some are limits to know, not to drive), and
docs/benchmarks-log.md, section 7, has the measurements behind the numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvpush.core.surface import Versions

TESTED_NIXL = Versions("NIXL", (1, 3, 2), (1, 5, 1))
"""The NIXL versions kvpush was tested with (the CI lanes run 1.3.2, 1.4.1 and 1.5.1); 1.3.2 is also the oldest
it starts on. A newer NIXL starts with a warning (``nixl_agent.check_nixl``): its LIBFABRIC plugin is driven
with the cautious traits below, and a backend kvpush knows no traits of is refused there."""


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
    (docs/libfabric.md, difference 10). Where True, a peer given up is unloaded once no WRITE to it flies
    (``kvpush.core.peer_loads``)."""
    dead_peer_writes_end: bool = True
    """A WRITE in flight to a peer that dies ends by itself (failed). Not so on LIBFABRIC before NIXL 1.5
    when the failed completions are read by notification calls, as ``Agent._settle_errors`` does where
    errors are not isolated: they are then charged to no transfer, and the WRITEs stay in progress for as
    long as the peer is loaded; unloading it ends them (failed). Where False, the agent unloads a given-up
    peer that still has WRITEs unreleased even where a live peer cannot be reloaded: P holds those WRITEs'
    blocks until they end, and a peer given up with WRITEs in flight was declared dead (a fencing hello is
    refused while WRITEs fly) (docs/libfabric.md, difference 11): after ``peer_dead_s`` more, a stuck peer of
    ``kvpush.core.peer_loads``. Where True, such a peer stays loaded until they end: unloading would fail them
    in NIXL's eyes while what the transport queued for them still reaches a peer only cut off, once the
    network heals (docs/design.md, "Fencing and faults")."""
    connects_on_load: bool = True
    """Loading a peer's metadata connects to it, while the peer is known to progress (it just said hello).
    Not so on LIBFABRIC in NIXL 1.3.2: its plugin connects inside the first post to the peer, and over tcp
    retries that post without limit while the peer does not accept, so a peer that died after being loaded
    but before its first WRITE blocks the thread posting to it for ever. Where False, the agent sends the
    peer a greeting notification as it loads it, which makes the connection then (the send returns once the
    peer accepted) and spares the first WRITE the connect; a peer that died since is met by the first WRITE's
    post on its open connection, which fails. Not covered, on every version: once the agent was progressed
    after the peer's death, the connection is gone and the next post connects anew, blocking as above
    (docs/libfabric.md, difference 12)."""


UCX = BackendTraits(descriptor_cost_us=7.0)
LIBFABRIC = BackendTraits(
    descriptor_cost_us=11.0,
    drain_calls=32,
    peer_errors_isolated=False,
    reloads_live_peer=False,
    dead_peer_writes_end=False,
    connects_on_load=False,
)
"""LIBFABRIC's traits where the running NIXL's were not measured: for each, the most cautious value any
measured version needed, each harmless where the plugin does not need it (extra drain calls return at once,
settling reads no errors, a peer kept loaded is reused, a dead peer unloaded frees its connection, a
greeting to a peer already connected is one small message), so an unmeasured version is driven safely."""
LIBFABRIC_1_4 = replace(LIBFABRIC, connects_on_load=True)
"""LIBFABRIC on NIXL 1.4.1 (docs/libfabric.md, differences 1, 3, 10 and 11): its plugin handshakes when a
peer is loaded, so it needs no greeting."""
LIBFABRIC_1_3 = replace(LIBFABRIC, reloads_live_peer=True)
"""LIBFABRIC on NIXL 1.3.2, whose plugin connects on a peer's first WRITE, not when its metadata is loaded:
a live peer unloaded and loaded again is written to at once, so given-up peers are unloaded (their
connections freed) as on UCX, and a peer is greeted as it is loaded, so that a peer dead by its first WRITE
does not block that post (difference 12). Draining, error isolation and WRITEs to a dead peer as on 1.4.1."""
LIBFABRIC_1_5 = replace(LIBFABRIC_1_4, dead_peer_writes_end=True)
"""LIBFABRIC on NIXL 1.5.1: as on 1.4.1, except that WRITEs to a peer that died end (failed) by themselves."""

VERIFIED: dict[str, dict[str, BackendTraits]] = {
    "LIBFABRIC": {"1.3.2": LIBFABRIC_1_3, "1.4.1": LIBFABRIC_1_4, "1.5.1": LIBFABRIC_1_5},
}
"""Traits by backend and NIXL version, for the versions kvpush measured them on with
``tools/libfabric/probe_traits.py`` and the multi-process tests (docs/libfabric.md, "NIXL versions").
A backend's plugin is NIXL's own code and changes between releases (LIBFABRIC's handshake was rewritten
between 1.3.2 and 1.4.1), so what was measured on one version is claimed for that version only."""
DEFAULTS: dict[str, BackendTraits] = {"UCX": UCX, "LIBFABRIC": LIBFABRIC}
"""A backend's traits on a NIXL version it was not measured on (UCX: one call handles everything)."""


def backend_traits(backend: str, nixl_version: str | None = None) -> BackendTraits:
    """One backend's traits on ``nixl_version`` (None: the running version is not known): the measured ones
    where kvpush verified that version, else the backend's cautious default. Unknown backends: as UCX."""
    return VERIFIED.get(backend, {}).get(nixl_version or "", DEFAULTS.get(backend, UCX))


def verified(backend: str, nixl_version: str | None) -> bool:
    """Whether kvpush measured ``backend``'s traits on this NIXL version (UCX needs no measurement: it has
    none of the differences the traits describe)."""
    if backend not in VERIFIED:
        return backend in DEFAULTS
    return (nixl_version or "") in VERIFIED[backend]


def told(backend: str, nixl_version: str | None) -> bool:
    """Whether kvpush can tell how to drive ``backend`` on this NIXL version: measured there, or a backend with
    traits for versions it was not measured on (``DEFAULTS``: UCX, and LIBFABRIC's most cautious). Any other
    backend is driven as UCX (``backend_traits``): a guess kvpush makes on the NIXL versions it was tested
    with, not on a newer or unreadable one (``nixl_agent.check_nixl`` refuses it there)."""
    return backend in DEFAULTS or (nixl_version or "") in VERIFIED.get(backend, {})


def traits(backends: Iterable[str], nixl_version: str | None = None) -> BackendTraits:
    """The traits of an agent with these backends on ``nixl_version``: the first one's costs (NIXL prefers
    it) and the most cautious handling any of them needs."""
    known = [backend_traits(b, nixl_version) for b in backends] or [UCX]
    return BackendTraits(
        known[0].descriptor_cost_us,
        max(t.drain_calls for t in known),
        all(t.peer_errors_isolated for t in known),
        all(t.reloads_live_peer for t in known),
        all(t.dead_peer_writes_end for t in known),
        all(t.connects_on_load for t in known),
    )
