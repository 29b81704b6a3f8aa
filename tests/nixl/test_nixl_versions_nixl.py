"""P and D on different NIXL versions: NIXL 1.3.2 (vLLM-Neuron's, from the ``neuron`` CI lane's interpreter)
against this interpreter's NIXL, each side a real agent in its own process.

Over UCX the two versions interoperate: pushes both ways are byte-exact. Their LIBFABRIC plugins do not
(``kvpush.core.interop``): P refuses D at the hello, and D's transfer fails with a reason naming both
versions, instead of a WRITE whose notification never arrives. The old side skips, naming the command that
installs it, where the lane is absent. Both sides use the host's network device for UCX: on one host, UCX of
the two versions finds no common transport over loopback or shared memory (test_e2e_cross_version says why).
"""

from __future__ import annotations

from collections.abc import Iterator

import helpers_libfabric as lf
import pytest
from helpers_lanes import lane_python, spawning_with, ucx_over_network, version_of
from procs import Geom, Node, assert_same, make_cache
from test_push_nixl import _cfg, _key, assert_idle, engines

from kvpush.conformance.model import Req, apply_push
from kvpush.transport.nixl_agent import nixl_version

OLD_LANE = "neuron"


@pytest.fixture(scope="module")
def sides(nixl_backend: str) -> Iterator[tuple[Node, Node, str, str]]:
    """``(new, old, new_version, old_version)``: a worker of this interpreter's NIXL and one of the old
    lane's; each hosts P and D engines."""
    old_python = lane_python(OLD_LANE)
    if old_python is None:
        pytest.skip(f"the {OLD_LANE!r} lane is not installed: bash .ci/lane install {OLD_LANE}")
    old_v, new_v = version_of(old_python, "nixl"), nixl_version()
    if old_v.split(".")[:2] == new_v.split(".")[:2]:
        pytest.skip(f"this interpreter's NIXL {new_v} is the {OLD_LANE} lane's ({old_v})")
    mp = ucx_over_network()
    with lf.spawn_env(nixl_backend):
        new = Node("new", nixl_backend)
        with spawning_with(old_python):
            old = Node("old", nixl_backend)
    try:
        new.wait_ready()
        old.wait_ready(timeout=300)
        yield new, old, new_v, old_v
    finally:
        new.stop()
        old.stop()
        mp.undo()


def directions(sides: tuple[Node, Node, str, str]) -> list[tuple[Node, Node, str, str]]:
    """``(p, d, p_version, d_version)`` both ways."""
    new, old, new_v, old_v = sides
    return [(new, old, new_v, old_v), (old, new, old_v, new_v)]


def test_versions_are_what_the_lanes_say(sides: tuple[Node, Node, str, str]) -> None:
    new, old, new_v, old_v = sides
    assert new.call("nixl_traits")[0] == new_v and old.call("nixl_traits")[0] == old_v


def test_push_between_nixl_versions(sides: tuple[Node, Node, str, str], nixl_backend: str) -> None:
    """UCX: byte-exact both ways. LIBFABRIC: refused at the hello, naming both versions, and nothing held."""
    g = Geom(num_blocks=64)
    for p, d, p_v, d_v in directions(sides):
        k = _key("nv")
        with (
            engines(p, "sender", [(k + "p", g, _cfg(), "P" + k)]) as [addr],
            engines(d, "receiver", [(k + "d", g, _cfg(), "D" + k)]),
        ):
            req = Req("t", "r1", "d1", [1, 2, 3, 4], [10, 20, 30, 40], 60)
            p.call("prefill", k + "p", req.tid, req.p_rid, req.p_blocks, req.n)
            d.call("register", k + "d", req.tid, req.d_rid, (addr[0], addr[1], 1), req.d_blocks, req.n, 0)
            [dr] = d.call("results", k + "d", 1, 30.0)
            if nixl_backend == "LIBFABRIC":
                assert not dr.ok and "refused the handshake" in dr.reason, (p_v, d_v, dr)
                assert f"P runs NIXL {p_v}" in dr.reason and f"D runs NIXL {d_v}" in dr.reason, dr
                assert_idle(d, k + "d")
                p.call("abort", k + "p", req.tid, "D refused")
                assert not p.call("results", k + "p", 1, 10.0)[0].ok
                assert_idle(p, k + "p")
                continue
            assert dr.ok, (p_v, d_v, dr)
            exp = make_cache(g, None)
            apply_push(exp, g, p.call("snapshot", k + "p"), g, req)
            assert_same(d.call("snapshot", k + "d"), exp, g)
            assert_idle(p, k + "p")
