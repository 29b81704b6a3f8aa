"""Asynchronous pack/unpack (``Backend.start_pack``/``start_unpack``) through real NIXL UCX agents.

Both workers run ``DeferredHostBackend``, whose copies land 0.25 s after they
are started. So a P that posted a part before its pack landed sends stale
staging bytes, a D that reported a transfer before its unpack landed hands
back blocks still holding the sentinel, and a D that gave up on a transfer
while an unpack was running must not report it until that unpack is done
(else the blocks change after vLLM got them back).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
from helpers_deferred_backend import DELAY_S
from procs import SENTINEL, Geom, Node, assert_same, make_cache
from test_push_nixl import _cfg, _key, assert_idle, by_rid, engines

from kvpush.conformance.model import Req, apply_push

DEFERRED = "helpers_deferred_backend:DeferredHostBackend"
SMALL_PARTS = {"min_part_bytes": 0, "part_cost_us": 0}
"""Test caches are small: cut a staged push into exactly ``push_parts`` parts whatever its size."""


@contextmanager
def deferred(p: Node, d: Node) -> Iterator[None]:
    for n in (p, d):
        n.call("use_backend", DEFERRED)
    try:
        yield
    finally:
        for n in (p, d):
            n.call("use_backend", None)


def _reqs(k: str, rng: np.random.Generator, count: int) -> list[Req]:
    return [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", rng.permutation(64)[:8].tolist(), [3 * i, 3 * i + 1, 50 + i], 90)
        for i in range(count)
    ]


@pytest.mark.parametrize(("announced", "busy_poll"), [(False, 1e-3), (True, 1e-3), (True, 5e-6)])
def test_parts_are_posted_and_reported_only_once_copied(
    nodes: tuple[Node, Node], announced: bool, busy_poll: float
) -> None:
    """``announced``: P learns of the prefill before its KV exists (``prefill_started``), so it builds the
    parts' WRITEs when it pairs and posts those handles once the KV is reported ready. ``busy_poll`` 5 us:
    low-latency mode (tight polls while WRITEs fly; waiting for the KV, P's thread still sleeps)."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32, order="HND")
    k = _key("async")
    reqs = _reqs(k, np.random.default_rng(5), 3)
    with (
        deferred(p, d),
        engines(
            p,
            "sender",
            [(k + "p", pg, _cfg(plan="staged", push_parts=3, busy_poll_max_s=busy_poll, **SMALL_PARTS), "P" + k)],
        ) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="staged", staged_min_descriptors=1), "D" + k)]),
    ):
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
            if announced:
                p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            else:
                p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        if announced:
            assert p.call("wait_stat", k + "p", "in_flight", len(reqs), 20.0)  # paired: WRITEs built
            # Waiting for the KV, P's thread sleeps until woken, in low-latency mode too: polling from
            # Python would take the GIL from the forward's launches (kvpush/engine/waiter.py).
            loops = p.call("loops", k + "p")
            time.sleep(0.3)
            loops = p.call("loops", k + "p") - loops
            assert loops < 30, loops
            p.call("layer_written", k + "p", [r.tid for r in reqs], pg.layers - 1)
        first = d.call("results", k + "d", 1, 20.0)
        got = d.call("snapshot", k + "d")  # right away: a result reported before its unpack landed shows here
        d_res = by_rid(first + d.call("results", k + "d", len(reqs) - 1, 20.0))
        p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
        assert len(d_res) == len(p_res) == len(reqs)
        assert all(x.ok for x in [*d_res.values(), *p_res.values()]), [*d_res.values(), *p_res.values()]
        for r in reqs:
            assert p_res[r.p_rid].stats.parts == 3 and d_res[r.d_rid].stats.parts == 3
        src = p.call("snapshot", k + "p")
        exp = make_cache(dg, None)
        apply_push(exp, dg, src, pg, next(r for r in reqs if r.d_rid == first[0].request_id))
        done = next(r for r in reqs if r.d_rid == first[0].request_id)
        mask = np.zeros(dg.num_blocks, bool)
        mask[done.d_blocks] = True
        np.testing.assert_array_equal(got[:, :, mask], exp[:, :, mask], "D reported before its unpack landed")
        for r in reqs:
            apply_push(exp, dg, src, pg, r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        assert p.call("stats", k + "p").get("parts_prebuilt_total", 0) == (3 * len(reqs) if announced else 0)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_abort_while_unpacking_waits_for_the_unpack(nodes: tuple[Node, Node]) -> None:
    """D gives up while an unpack writes into the blocks: the result comes only after the unpack.

    The push is layer-wise and only its first layer is ready, so P cancels
    the rest and answers the abort while D's unpack of that layer still runs:
    D's writer ends on P's answer, not on the unpack, and must wait for it.
    """
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32)
    k = _key("async-abort")
    [r] = _reqs(k, np.random.default_rng(6), 1)
    with (
        deferred(p, d),
        engines(
            p,
            "sender",
            [(k + "p", pg, _cfg(plan="staged", layerwise_min_part_bytes=0, layerwise_lead_layers=1000), "P" + k)],
        ) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="staged", staged_min_descriptors=1), "D" + k)]),
    ):
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        p.call("layer_written", k + "p", [r.tid], 0)  # layer 0 (K and V) of 3
        # The part arrived and its unpack started (it lands DELAY_S later): give up now.
        assert d.call("wait_stat", k + "d", "parts_total", 1, 20.0)
        d.call("abort", k + "d", r.tid, "client went away")
        [res] = d.call("results", k + "d", 1, 20.0)
        after = d.call("snapshot", k + "d")
        assert res.request_id == r.d_rid and not res.ok
        time.sleep(DELAY_S + 0.1)
        np.testing.assert_array_equal(d.call("snapshot", k + "d"), after, "D's blocks changed after it let go")
        assert (after[0, :, r.d_blocks] != SENTINEL).any(), "the unpack that was running did not land"
        assert len(p.call("results", k + "p", 1, 10.0)) == 1
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


@pytest.mark.parametrize("busy_poll", [1e-3, 5e-6])
def test_p_sleeps_while_a_layer_packs_and_the_waiter_wakes_it(nodes: tuple[Node, Node], busy_poll: float) -> None:
    """A layer's pack runs on the device while later layers still compute: P's engine thread does not
    poll for it (each poll would take the GIL from the forward's launches); the waiter thread blocks on
    the pack's marker and wakes it, and the layer is posted."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32)
    k = _key("async-waiter")
    [r] = _reqs(k, np.random.default_rng(7), 1)
    cfg = _cfg(plan="staged", layerwise_min_part_bytes=0, layerwise_lead_layers=1000, busy_poll_max_s=busy_poll)
    with (
        deferred(p, d),
        engines(p, "sender", [(k + "p", pg, cfg, "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="staged", staged_min_descriptors=1), "D" + k)]),
    ):
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        assert p.call("wait_stat", k + "p", "in_flight", 1, 20.0)
        p.call("layer_written", k + "p", [r.tid], 0)  # layer 0 of 3: its pack lands DELAY_S later
        loops = p.call("loops", k + "p")
        time.sleep(DELAY_S * 0.6)
        loops = p.call("loops", k + "p") - loops
        assert loops < 30, f"P polled {loops} times while the pack ran"
        assert d.call("wait_stat", k + "d", "parts_total", 1, 20.0), "layer 0 never reached D"
        assert p.call("stats", k + "p")["marker_waits"] >= 1
        p.call("layer_written", k + "p", [r.tid], pg.layers - 1)
        d_res = by_rid(d.call("results", k + "d", 1, 20.0))
        p_res = by_rid(p.call("results", k + "p", 1, 10.0))
        assert d_res[r.d_rid].ok and p_res[r.p_rid].ok, (d_res, p_res)
        exp = make_cache(dg, None)
        apply_push(exp, dg, p.call("snapshot", k + "p"), pg, r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_pack_at_hand_over_on_the_device_is_waited_for(nodes: tuple[Node, Node]) -> None:
    """Parked prefills are packed at hand-over by a copy that lands ``DELAY_S`` later. D registers at once:
    each push posts only once that pack landed (stale staging bytes otherwise). A prefill aborted while its
    pack runs gives its slot back only when the pack has landed (the copy still writes it until then)."""
    p, d = nodes
    pg, dg = Geom(num_blocks=64), Geom(num_blocks=96, block_size=32, order="HND")
    k = _key("handover")
    reqs = _reqs(k, np.random.default_rng(9), 3)
    with (
        deferred(p, d),
        engines(p, "sender", [(k + "p", pg, _cfg(plan="staged", push_parts=2, **SMALL_PARTS), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="staged", staged_min_descriptors=1), "D" + k)]),
    ):
        for r in reqs:
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        d_res = by_rid(d.call("results", k + "d", len(reqs), 20.0))
        p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
        assert all(x.ok for x in [*d_res.values(), *p_res.values()]), [*d_res.values(), *p_res.values()]
        exp = make_cache(dg, None)
        for r in reqs:
            apply_push(exp, dg, p.call("snapshot", k + "p"), pg, r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        st = p.call("stats", k + "p")
        assert st.get("packs_at_hand_over_used_total") == len(reqs) and st.get("parts_total") == 2 * len(reqs), st

        gone = Req(f"{k}-x", f"{k}-px", f"{k}-dx", [40, 41, 42, 43, 44, 45], [0, 1, 2], 90)
        p.call("prefill", k + "p", gone.tid, gone.p_rid, gone.p_blocks, gone.n)
        p.call("abort", k + "p", gone.tid, "client went away")
        [res] = p.call("results", k + "p", 1, 5.0)
        assert not res.ok, res
        st = p.call("stats", k + "p")
        assert (st["parked_staging_slots"], st["staging_slots_in_use"]) == (0, 1), st  # set aside, not freed
        time.sleep(DELAY_S + 0.2)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


PART_LAYERS = 10
"""Layers of the parts test: 20 regions (K and V of each layer), enough for 16 parts."""


@pytest.mark.parametrize("copies", ["sync", "deferred"])
@pytest.mark.parametrize("parts", [1, 4, 16])
def test_a_push_in_overlapping_parts_lands_byte_exact(nodes: tuple[Node, Node], parts: int, copies: str) -> None:
    """A staged push cut into exactly ``parts`` WRITEs (P and D: ``push_parts``, no minimum size, no cost per
    part) lands byte-exact, each part unpacked on its own, on the host backend's synchronous copies and on
    ``DeferredHostBackend``'s late ones, whose copies keep running after the call: then the parts overlap,
    seen on the backends' clocks (``_overlapped``)."""
    p, d = nodes
    pg = Geom(layers=PART_LAYERS, num_blocks=64)
    dg = Geom(layers=PART_LAYERS, num_blocks=96, block_size=32, order="HND")
    k = _key(f"parts{parts}{copies}")
    [r] = _reqs(k, np.random.default_rng(11), 1)
    cut = {"push_parts": parts, **SMALL_PARTS}
    use = deferred(p, d) if copies == "deferred" else nullcontext()
    with (
        use,
        engines(p, "sender", [(k + "p", pg, _cfg(plan="staged", **cut), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _cfg(plan="staged", staged_min_descriptors=1, **cut), "D" + k)]),
    ):
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        # The registration waits at P when the prefill finishes, so the push packs part by part (a prefill
        # that finished first is packed whole at hand-over).
        assert p.call("wait_stat", k + "p", "waiting_registrations", 1, 20.0)
        p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        [d_res] = d.call("results", k + "d", 1, 20.0)
        [p_res] = p.call("results", k + "p", 1, 10.0)
        assert d_res.ok and p_res.ok, (d_res, p_res)
        assert p_res.stats.plan == d_res.stats.plan == "staged", (p_res.stats, d_res.stats)
        assert p_res.stats.parts == d_res.stats.parts == parts, (p_res.stats, d_res.stats)
        assert p.call("stats", k + "p")["parts_total"] == parts
        exp = make_cache(dg, None)
        apply_push(exp, dg, p.call("snapshot", k + "p"), pg, r)
        assert_same(d.call("snapshot", k + "d"), exp, dg)
        if copies == "deferred":
            _overlapped(p.call("copies", k + "p"), d.call("copies", k + "d"), parts)
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def _most_at_once(copies: list[tuple[int, float, float]]) -> int:
    """The most of these copies (staging address, started, landed) running at one time."""
    edges = sorted([(t0, 1) for _, t0, _ in copies] + [(t1, -1) for _, _, t1 in copies])
    most = running = 0
    for _, step in edges:  # a landing sorts before a start at the same instant
        running += step
        most = max(most, running)
    return most


def _overlapped(p_copies: list, d_copies: list, parts: int) -> None:
    """One pack on P and one unpack on D per part (told apart by their place in the slot); with several parts,
    P had more than one pack running at once (it packs the next part while the one before is still being
    packed, then posted) and D more than one unpack (it starts each part's on its own notification and does not
    wait for the one before)."""
    packs = sorted((addr, t0, t1) for kind, addr, t0, t1 in p_copies if kind == "pack")
    unpacks = sorted((addr, t0, t1) for kind, addr, t0, t1 in d_copies if kind == "unpack")
    assert len(packs) == len(unpacks) == parts, (packs, unpacks)
    assert len({a for a, _, _ in packs}) == len({a for a, _, _ in unpacks}) == parts, "two parts at one place"
    assert all(t1 is not None for _, _, t1 in packs + unpacks), "a copy never landed"
    want = min(parts, 2)
    assert _most_at_once(packs) >= want, f"P packed the parts one after another: {packs}"
    assert _most_at_once(unpacks) >= want, f"D unpacked the parts one after another: {unpacks}"
    if parts > 1:
        # The wire and D's unpacks overlap P's packing: D starts the first part's unpack before P's last pack
        # lands (P drives the flying WRITEs while it waits for its packs, instead of blocking on them).
        assert unpacks[0][1] < packs[-1][2], f"D unpacked nothing until P had packed everything: {packs} {unpacks}"
