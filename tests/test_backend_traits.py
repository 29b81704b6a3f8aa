"""Which traits kvpush drives each NIXL backend with, per NIXL version (no NIXL needed).

The measured versions get their measured traits; any other version gets, per trait, the most cautious
value any measured version needed, so a NIXL nobody measured is driven safely
(kvpush/transport/backends.py, docs/libfabric.md "NIXL versions").
"""

from __future__ import annotations

import pytest

from kvpush.transport.backends import LIBFABRIC, UCX, VERIFIED, backend_traits, traits, verified
from kvpush.transport.nixl_agent import supported


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


@pytest.mark.parametrize("version", ["1.5.2", "1.4.0", "unknown", None])
def test_an_unmeasured_version_gets_the_most_cautious_traits(version: str | None) -> None:
    got = backend_traits("LIBFABRIC", version)
    assert got == LIBFABRIC and not verified("LIBFABRIC", version)
    for measured in VERIFIED["LIBFABRIC"].values():
        assert got.drain_calls >= measured.drain_calls
        assert got.peer_errors_isolated <= measured.peer_errors_isolated
        assert got.reloads_live_peer <= measured.reloads_live_peer


def test_ucx_and_unknown_backends() -> None:
    for v in ("1.3.2", "1.5.2", None):
        assert backend_traits("UCX", v) == UCX and verified("UCX", v)
        assert backend_traits("GDS", v) == UCX and not verified("GDS", v)


def test_an_agent_with_several_backends_takes_the_most_cautious_of_each() -> None:
    both = traits(["UCX", "LIBFABRIC"], "1.3.2")
    assert both.descriptor_cost_us == UCX.descriptor_cost_us  # the first backend's costs
    assert (both.drain_calls, both.peer_errors_isolated, both.reloads_live_peer) == (32, False, True)
    assert traits(["UCX", "LIBFABRIC"], "1.4.1").reloads_live_peer is False
    assert traits([], "1.5.1") == UCX


def test_supported_versions() -> None:
    """pyproject.toml's range: nixl>=1.3.2,<1.6."""
    assert [supported(v) for v in ("1.3.2", "1.4.1", "1.5.2", "1.5.99")] == [True] * 4
    assert [supported(v) for v in ("1.3.1", "1.6.0", "2.0.0", "unknown", "")] == [False] * 5
