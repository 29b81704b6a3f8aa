"""Which traits kvpush drives each NIXL backend with, per NIXL version (no NIXL needed).

The measured versions get their measured traits; any other version gets, per trait, the most cautious
value any measured version needed, so a NIXL nobody measured is driven safely
(kvpush/core/nixl_backends.py, docs/libfabric.md "NIXL versions").
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.core.nixl_backends import LIBFABRIC, UCX, VERIFIED, backend_traits, told, traits, verified
from kvpush.transport.nixl_agent import Agent


def test_libfabric_reloads_a_live_peer_on_1_3_2_only() -> None:
    """NIXL 1.3.2's plugin handshakes on the first WRITE; 1.4.1 and 1.5.1 on load, which a live peer never
    answers twice (measured with tools/libfabric/probe_traits.py)."""
    assert backend_traits("LIBFABRIC", "1.3.2").reloads_live_peer is True
    for v in ("1.4.1", "1.5.1"):
        assert backend_traits("LIBFABRIC", v).reloads_live_peer is False, v
    for v in ("1.3.2", "1.4.1", "1.5.1"):
        t = backend_traits("LIBFABRIC", v)
        assert t.drain_calls == 32 and t.peer_errors_isolated is False, (v, t)
        assert verified("LIBFABRIC", v)


def test_libfabric_ends_writes_to_a_dead_peer_from_1_5_only() -> None:
    """Before NIXL 1.5 the plugin leaves WRITEs to a killed peer in progress while that peer is loaded."""
    assert [backend_traits("LIBFABRIC", v).dead_peer_writes_end for v in ("1.3.2", "1.4.1", "1.5.1")] == [
        False,
        False,
        True,
    ]


def test_libfabric_connects_on_load_from_1_4_only() -> None:
    """NIXL 1.3.2's plugin connects inside a peer's first post, retrying without limit while the peer does not
    accept; 1.4.1 and 1.5.1 connect as the peer is loaded (docs/libfabric.md, difference 12)."""
    assert [backend_traits("LIBFABRIC", v).connects_on_load for v in ("1.3.2", "1.4.1", "1.5.1")] == [
        False,
        True,
        True,
    ]
    assert UCX.connects_on_load is True


@pytest.mark.parametrize("version", ["1.5.2", "1.4.0", "unknown", None])
def test_an_unmeasured_version_gets_the_most_cautious_traits(version: str | None) -> None:
    got = backend_traits("LIBFABRIC", version)
    assert got == LIBFABRIC and not verified("LIBFABRIC", version)
    for measured in VERIFIED["LIBFABRIC"].values():
        assert got.drain_calls >= measured.drain_calls
        assert got.peer_errors_isolated <= measured.peer_errors_isolated
        assert got.reloads_live_peer <= measured.reloads_live_peer
        assert got.dead_peer_writes_end <= measured.dead_peer_writes_end
        assert got.connects_on_load <= measured.connects_on_load


def test_ucx_and_unknown_backends() -> None:
    for v in ("1.3.2", "1.5.2", None):
        assert backend_traits("UCX", v) == UCX and verified("UCX", v)
        assert backend_traits("GDS", v) == UCX and not verified("GDS", v)


def test_an_agent_with_several_backends_takes_the_most_cautious_of_each() -> None:
    both = traits(["UCX", "LIBFABRIC"], "1.3.2")
    assert both.descriptor_cost_us == UCX.descriptor_cost_us  # the first backend's costs
    assert (both.drain_calls, both.peer_errors_isolated, both.reloads_live_peer) == (32, False, True)
    assert both.dead_peer_writes_end is False and both.connects_on_load is False
    assert traits(["UCX", "LIBFABRIC"], "1.4.1").reloads_live_peer is False
    assert traits(["UCX", "LIBFABRIC"], "1.4.1").connects_on_load is True
    assert traits([], "1.5.1") == UCX


def test_traits_told_on_any_version_for_ucx_and_libfabric_only() -> None:
    """UCX and LIBFABRIC have traits on a NIXL nobody measured (UCX's, LIBFABRIC's most cautious); another
    backend is driven as UCX only on a measured NIXL version, a guess ``check_nixl`` does not make beyond."""
    for v in ("1.3.2", "1.5.1", "1.6.0", "unknown", None):
        assert told("UCX", v) and told("LIBFABRIC", v)
        assert not told("GDS", v)


class _Inner:
    """NIXL's agent as far as ``Agent.over``/``add_peer``/``remove_peer``/``prepare_write``/``release`` use it."""

    def __init__(self, send_fails: bool = False) -> None:
        self.unloaded: list[str] = []
        self.sent: list[tuple[str, bytes]] = []
        self.send_fails = send_fails

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return ["DRAM_SEG"]

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata.split(b":")[0]

    def remove_remote_agent(self, name: str) -> None:
        self.unloaded.append(name)

    def send_notif(self, name: str, msg: bytes) -> None:
        if self.send_fails:
            raise RuntimeError("NIXL_ERR_BACKEND")
        self.sent.append((name, msg))

    def get_xfer_descs(self, rows: object, mem: str) -> object:
        return rows

    def initialize_xfer(self, *args: object) -> object:
        return object()

    def release_xfer_handle(self, handle: object) -> None:
        pass


def _agent(version: str, inner: _Inner | None = None) -> tuple[Agent, _Inner]:
    inner = inner or _Inner()
    return Agent.over("P", inner, ("LIBFABRIC",), version), inner


@pytest.mark.parametrize("version", ["1.3.2", "1.4.1", "1.5.1", "1.5.2"])
def test_a_peer_given_up_with_writes_in_flight_is_unloaded_where_they_would_not_end(version: str) -> None:
    """Where a dead peer's WRITEs do not end by themselves, a peer given up with unreleased WRITEs is unloaded
    (they then end, failed); one given up with none stays loaded where a live peer cannot be reloaded."""
    t = backend_traits("LIBFABRIC", version)
    agent, inner = _agent(version)
    assert agent.traits == t
    rows = np.zeros((1, 3), np.int64)
    for peer in ("D1", "D2"):
        assert agent.add_peer(f"{peer}:meta".encode(), peer) == peer
    handle = agent.prepare_write(rows, "DRAM", rows, "DRAM", "D1", b"n")
    agent.remove_peer("D1")
    agent.remove_peer("D2")
    expect = [p for p in ("D1", "D2") if t.reloads_live_peer or (p == "D1" and not t.dead_peer_writes_end)]
    assert inner.unloaded == expect, (version, t)
    agent.release(handle)
    assert agent.unreleased_writes() == 0


@pytest.mark.parametrize("version", ["1.3.2", "1.4.1", "1.5.1", "1.5.2"])
def test_a_peer_is_greeted_as_it_is_loaded_where_loading_does_not_connect(version: str) -> None:
    """Where the plugin connects in the first post (NIXL 1.3.2), the greeting is sent at load, while the peer is
    known to progress, so a WRITE never has to connect; a peer taken back from those kept loaded is not greeted
    again (its connection is there), and a peer loaded without a greeting gets none."""
    t = backend_traits("LIBFABRIC", version)
    agent, inner = _agent(version)
    assert agent.traits == t
    agent.add_peer(b"D1:meta", "D1", b"hi")
    agent.add_peer(b"D2:meta", "D2")
    assert inner.sent == ([] if t.connects_on_load else [("D1", b"hi")]), (version, t)
    agent.remove_peer("D1")
    inner.sent.clear()
    agent.add_peer(b"D1:meta", "D1", b"hi")
    assert inner.sent == ([] if t.connects_on_load or not t.reloads_live_peer else [("D1", b"hi")])


def test_a_failed_greeting_unloads_the_peer_and_raises() -> None:
    agent, inner = _agent("1.3.2", _Inner(send_fails=True))
    with pytest.raises(RuntimeError):
        agent.add_peer(b"D1:meta", "D1", b"hi")
    assert inner.unloaded == ["D1"] and agent.peers() == ()


@pytest.mark.parametrize("version", ["1.3.2", "1.4.1", "1.5.1", "1.5.2"])
def test_a_peer_given_up_with_writes_that_would_not_end_stays_loaded_for_the_grace(version: str) -> None:
    """Given up with a time (the engine's way), a peer whose WRITEs would not end if it died stays loaded for
    ``stuck_grace_s``, whether or not a live peer can be reloaded (a peer cut off by the network and healed
    within the grace must not get the queued bytes of WRITEs P failed by unloading it): taken back at once if
    it says hello again with the same metadata, unloaded when the grace runs out with its WRITEs still
    unreleased (they then end, failed), and given up as any peer (unloaded where a live peer can be
    reloaded, else kept retired) if they ended first."""
    t = backend_traits("LIBFABRIC", version)
    rows = np.zeros((1, 3), np.int64)
    for case in ("back", "dead", "ended"):
        agent, inner = _agent(version)
        agent.stuck_grace_s = 3.0
        agent.add_peer(b"D1:meta", "D1")
        handle = agent.prepare_write(rows, "DRAM", rows, "DRAM", "D1", b"n")
        agent.remove_peer("D1", 10.0)
        assert inner.unloaded == [], (version, case)  # even where a live peer could be loaded again
        if case == "back":
            assert agent.add_peer(b"D1:meta", "D1") == "D1" and agent.peers() == ("D1",)
            agent.expire(14.0)
        elif case == "ended":
            agent.release(handle)
            agent.expire(14.0)
        else:
            agent.expire(12.9)
            assert inner.unloaded == []
            agent.expire(13.0)
        # given up with its WRITEs ended, it goes as any peer given up does: unloaded where it can be reloaded
        unloaded = (case == "dead" and not t.dead_peer_writes_end) or (case == "ended" and t.reloads_live_peer)
        assert inner.unloaded == (["D1"] if unloaded else []), (version, case, t)
