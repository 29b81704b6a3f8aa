"""Which NIXL peers an agent keeps loaded, as a sans-I/O machine (shared: P gives up D ranks, D gives up P ranks).

A peer is *loaded* from the metadata it sent in its hello, *in use* while
anything may be written to it or read from it, and *given up* when its side
forgets it (declared dead, said hello again, fenced). What giving up does to
the load depends on two traits of the NIXL backend
(``kvpush.core.nixl_backends.BackendTraits``):

- where a live peer can be loaded again (``reloads_live_peer``), a peer given up
  with no WRITE to it unreleased is unloaded at once;
- where it cannot (LIBFABRIC: the reload's handshake is never answered by a peer
  that holds a connection from this agent, and the first WRITE waits for it), the
  peer is kept loaded, *retired*, and taken back, not loaded, when the same
  metadata returns (the same peer, the same session). A retired peer whose name
  comes back with other metadata (it restarted) is unloaded before the new load;
  at most ``retired_max`` are kept, the oldest unloaded first;
- where a dead peer's WRITEs end by themselves (``dead_peer_writes_end``: UCX,
  LIBFABRIC from NIXL 1.5), a peer given up with WRITEs unreleased is *draining*:
  kept loaded, whatever the other trait, until those WRITEs end by themselves (the
  transport reports them written or failed), then unloaded or retired as above.
  Unloading would end them at once in NIXL's eyes, failed, but not on the wire: what
  the transport had queued for them is still sent (over TCP a closed socket's queue
  is sent all the same, and UCX resumes what it queued once the peer is loaded
  again). A peer cut off by the network gets it once the network heals, after its
  writer, seeing no WRITE of the peer's earlier session in flight, answered its
  fencing hello: the bytes land in blocks the peer gave back for reuse. Left to
  end by themselves they end only once the transport is done with them (written,
  or failed with the connection), so P answers that hello only then;
- where they would not (``dead_peer_writes_end`` False: LIBFABRIC before NIXL 1.5),
  a peer given up with WRITEs unreleased is *stuck*, whatever the other trait:
  kept loaded for ``grace_s`` only (a peer merely stalled, or cut off by the
  network for a while, is back within it, on its old connection, and its WRITEs
  end), then unloaded if they are still unreleased, which ends them, failed (and
  brings back the hazard above for a peer cut off for longer: not solved).
  Without a time or a grace it is unloaded at once.

Events in (``add``, ``loaded``, ``remove``, ``expire``, ``close``), ``Unload``
actions out; the shell (``kvpush.transport.nixl_agent.Agent``) carries them out
and tells which peers have WRITEs unreleased. Time is passed in.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

RETIRED_PEERS_MAX = 64
"""Most given-up peers kept loaded where a live peer cannot be reloaded; beyond it the oldest is unloaded."""


@dataclass(frozen=True)
class Unload:
    """Unload peer ``name`` from the agent (ends its WRITEs still in flight, failed)."""

    name: str


@dataclass(frozen=True)
class TakenBack:
    """``add``: the metadata is that of peer ``name``, still loaded: it is in use again, nothing is loaded."""

    name: str


@dataclass(frozen=True)
class LoadNew:
    """``add``: load the metadata (then ``loaded``), after carrying out ``unload_first``."""

    unload_first: tuple[Unload, ...] = ()


class PeerLoads:
    """The peers one agent has loaded: in use, retired, which retired ones drain, and until when a stuck one stays
    loaded."""

    def __init__(
        self,
        reloads_live_peer: bool,
        dead_peer_writes_end: bool,
        grace_s: float = 0.0,
        retired_max: int = RETIRED_PEERS_MAX,
    ) -> None:
        self.reloads_live_peer = reloads_live_peer
        self.dead_peer_writes_end = dead_peer_writes_end
        self.grace_s = grace_s
        """How long a stuck peer stays loaded for its WRITEs (the engine sets ``peer_dead_s``)."""
        self.retired_max = retired_max
        self.in_use: dict[str, bytes] = {}
        """Peers in use: name -> the metadata they were loaded from."""
        self.retired: dict[str, bytes] = {}
        """Peers given up but kept loaded, oldest first."""
        self.stuck_until: dict[str, float] = {}
        """Retired peers given up with WRITEs that would not end if they died: unloaded at this time."""
        self.draining: set[str] = set()
        """Retired peers given up with WRITEs that end by themselves: kept loaded until they have."""

    def loaded_names(self) -> set[str]:
        """Every peer the agent holds loaded (in use or retired)."""
        return {*self.in_use, *self.retired}

    def add(self, metadata: bytes, name: str) -> TakenBack | LoadNew:
        """A peer's hello brought ``metadata``, for the agent it says is named ``name``."""
        for known, meta in (*self.in_use.items(), *self.retired.items()):
            if meta == metadata:
                self._forget(known)
                self.in_use[known] = metadata
                return TakenBack(known)
        if name in self.retired:
            self._forget(name)  # it restarted: its old process, and the connection to it, are gone
            return LoadNew((Unload(name),))
        return LoadNew()

    def loaded(self, name: str, metadata: bytes) -> None:
        """The shell loaded ``metadata`` as peer ``name``: it is in use."""
        self.in_use[name] = metadata

    def remove(self, name: str, writing: bool, now: float | None) -> list[Unload]:
        """Give peer ``name`` up; ``writing``: WRITEs to it are unreleased; ``now``: None where the caller keeps
        no time (a stuck peer is then unloaded at once)."""
        metadata = self.in_use.pop(name, None)
        if metadata is None:
            return []
        draining = writing and self.dead_peer_writes_end
        stuck = writing and not self.dead_peer_writes_end and now is not None and self.grace_s > 0
        if not (draining or stuck) and (self.reloads_live_peer or writing):
            return [Unload(name)]
        self.retired[name] = metadata
        if draining:
            self.draining.add(name)
        if stuck:
            assert now is not None
            self.stuck_until[name] = now + self.grace_s
        out: list[Unload] = []
        # beyond the bound the oldest kept only for its metadata's return go; one kept for its WRITEs stays
        kept = [n for n in self.retired if n not in self.draining and n not in self.stuck_until]
        while len(kept) > self.retired_max:
            oldest = kept.pop(0)
            self._forget(oldest)
            out.append(Unload(oldest))
        return out

    def expire(self, now: float, writing: Collection[str]) -> list[Unload]:
        """Unload the stuck peers whose grace ran out with WRITEs still unreleased (``writing``: the peers that
        have some). A stuck or draining peer whose WRITEs ended first is given up as any other: unloaded where a
        live peer can be reloaded, else it stays retired."""
        out: list[Unload] = []
        for name in [n for n in self.draining if n not in writing]:
            self.draining.discard(name)
            if self.reloads_live_peer:
                del self.retired[name]
                out.append(Unload(name))
        for name, until in list(self.stuck_until.items()):
            if name not in writing:
                del self.stuck_until[name]
                if self.reloads_live_peer:
                    del self.retired[name]
                    out.append(Unload(name))
            elif now >= until:
                del self.stuck_until[name]
                del self.retired[name]
                out.append(Unload(name))
        return out

    def close(self) -> list[Unload]:
        """The agent closes: every loaded peer is unloaded."""
        out = [Unload(n) for n in (*self.in_use, *self.retired)]
        self.in_use.clear()
        self.retired.clear()
        self.stuck_until.clear()
        self.draining.clear()
        return out

    def waiting(self) -> bool:
        """Whether ``expire`` has anything to look at: a peer stuck or draining."""
        return bool(self.stuck_until or self.draining)

    def _forget(self, name: str) -> None:
        """``name`` is no longer retired (taken back, restarted or unloaded)."""
        self.retired.pop(name, None)
        self.stuck_until.pop(name, None)
        self.draining.discard(name)
