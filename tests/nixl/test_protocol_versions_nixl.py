"""A P and a D of different protocol versions pair: this kvpush against the last one before staging in rounds.

One side runs this tree, the other the kvpush of ``OLD`` (protocol v11), taken from the repository's own
history with ``git archive`` (its package and its test helpers, so its worker process is that version
whole). Pushes far larger than D's staging region, with D's blocks shuffled so D wants them staged, go
byte-exact both ways, with the plans v11 had (a slot for the whole payload where one is free, else direct):
the newer side offers rounds only to a peer that said it speaks them, and a v11 peer never does.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import helpers_libfabric as lf
import numpy as np
import pytest
from procs import Geom, Node, assert_same, make_cache
from test_push_nixl import _key, assert_idle, by_rid, engines

from kvpush.conformance.model import Req, apply_push

OLD = "b14f9b2"
"""The last kvpush before staging in rounds: protocol v11, no ``Features``, no ``Credit``, no ring grant."""
ROOT = Path(__file__).resolve().parents[2]
GEOM = Geom(layers=4, num_blocks=512, num_heads=8, head_dim=256)  # 16 KiB a token
CFG = {"plan": "staged", "staging_bytes": 2 << 20, "staged_min_descriptors": 1}  # keys both versions know
NEW_ONLY = {"min_part_bytes": 256 << 10, "ring_slots": 4}  # the newer side's ring: 1 MiB of its 2 MiB region


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``OLD``'s kvpush and test helpers, unpacked."""
    out = tmp_path_factory.mktemp("kvpush-v11")
    archive = out / "old.tar"
    got = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), OLD, "kvpush", "tests/helpers"],
        capture_output=True,
        text=True,
    )
    if got.returncode:
        pytest.fail(f"cannot take kvpush {OLD} from the repository's history (a full clone is needed): {got.stderr}")
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out


@contextmanager
def spawned_from(tree: Path) -> Iterator[None]:
    """Worker processes started inside run ``tree``'s kvpush and helpers: a spawned process takes this one's
    ``sys.path``, and finds those first."""
    saved = list(sys.path)
    sys.path[:0] = [str(tree), str(tree / "tests" / "helpers")]
    try:
        yield
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def mixed(nixl_backend: str, old_tree: Path) -> Iterator[dict[str, Node]]:
    """A worker of this kvpush and one of ``OLD``'s, over the module's NIXL backend."""
    with lf.spawn_env(nixl_backend):
        new = Node("new", nixl_backend)
        with spawned_from(old_tree):
            old = Node("old", nixl_backend)
    try:
        new.wait_ready()
        old.wait_ready()
        yield {"new": new, "old": old}
    finally:
        new.stop()
        old.stop()


def _requests(k: str, sizes: list[int]) -> list[Req]:
    rng = np.random.default_rng(11)
    bs = GEOM.block_size
    d_free = [int(b) for b in rng.permutation(GEOM.num_blocks)]
    out = []
    for i, n in enumerate(sizes):
        nb = -(-n // bs)
        p_blocks = [int(b) for b in rng.choice(GEOM.num_blocks, nb, replace=False)]
        d_blocks, d_free = d_free[:nb], d_free[nb:]
        out.append(Req(f"{k}-t{i}", f"{k}-p{i}", f"{k}-d{i}", p_blocks, d_blocks, n, 0))
    return out


def _cfg(node: str) -> dict[str, Any]:
    return {**CFG, **(NEW_ONLY if node == "new" else {})}


@pytest.mark.parametrize(("p_side", "d_side"), [("old", "new"), ("new", "old")])
def test_a_peer_before_rounds_still_pairs_with_its_plans(mixed: dict[str, Node], p_side: str, d_side: str) -> None:
    """Pushes of 256 KiB to 4 MiB, a 2 MiB region on each side (rounds would take the larger ones between
    two new sides): byte-exact, none in rounds, the larger ones direct and the others staged in one slot."""
    p, d = mixed[p_side], mixed[d_side]
    k = _key(f"v{p_side}{d_side}")
    reqs = _requests(k, [16, 64, 192, 256])  # 256 KiB .. 4 MiB: the last two larger than the region
    with (
        engines(p, "sender", [(k + "p", GEOM, _cfg(p_side), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", GEOM, _cfg(d_side), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            [res] = d.call("results", k + "d", 1, 60.0)
            assert res.ok, res
        p_res = by_rid(p.call("results", k + "p", len(reqs), 30.0))
        assert all(x.ok for x in p_res.values()), p_res
        src, got = p.call("snapshot", k + "p"), d.call("snapshot", k + "d")
        exp = make_cache(GEOM, None)
        for r in reqs:
            apply_push(exp, GEOM, src, GEOM, r)
        assert_same(got, exp, GEOM)
        st = p.call("stats", k + "p")
        plans = {str(key): v for key, v in st.items() if str(key).startswith("plan_")}
        assert plans.get("plan_rounds_total", 0) == 0, plans
        assert (plans.get("plan_staged_total", 0), plans.get("plan_direct_total", 0)) == (2, 2), plans
        if d_side == "old":  # it is the older kvpush: it dropped P's Features, naming the version
            d.wait_logged(["peer speaks v12"])
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_the_same_pushes_between_two_new_sides_go_in_rounds(mixed: dict[str, Node]) -> None:
    """The control: the very same pushes between two sides of this tree put the larger ones in rounds, so the
    cases above show what the older peer changes."""
    node = mixed["new"]
    k = _key("vnewnew")
    reqs = _requests(k, [16, 64, 192, 256])
    with (
        engines(node, "sender", [(k + "p", GEOM, _cfg("new"), "P" + k)]) as [addr],
        engines(node, "receiver", [(k + "d", GEOM, _cfg("new"), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:
            node.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
            node.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            [res] = node.call("results", k + "d", 1, 60.0)
            assert res.ok, res
        st = node.call("stats", k + "p")
        assert st.get("plan_rounds_total", 0) == 2, st
