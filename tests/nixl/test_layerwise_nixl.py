"""Layer-wise and multi-part pushes end to end: real NIXL UCX agents in two processes.

P announces a prefill (``prefill_started``) before its KV exists, then a
stand-in forward writes the layers one by one (``compute_layers``) and reports
each with ``layer_written``. The checks: D holds exactly what P computed (a layer
pushed before it was computed would carry stale bytes), D reports nothing
until every region arrived, layers not yet computed never reach D, a late
registration gets the computed layers at once, and aborts in the middle of
the layers release everything on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from procs import SENTINEL, Geom, Node, assert_same, make_cache
from test_push_nixl import _cfg, _key, assert_idle, by_rid, engines

from kvpush.conformance.model import Req, apply_push

LAYERS = 6
RPL = 2  # regions per layer: the host backend lists K and V of each layer


STREAM = 1000
"""``layerwise_lead_layers`` for streaming: each group goes as soon as it is ready (the default holds
every layer back until two are left)."""


def _p_cfg(plan: str, **kw: Any) -> dict[str, Any]:
    """P posts every ready layer on its own (the engine groups layers under 16 MiB by default)."""
    return _cfg(plan=plan, layerwise_min_part_bytes=0, layerwise_lead_layers=STREAM, **kw)


def _d_cfg(plan: str) -> dict[str, Any]:
    return _cfg(plan=plan, staged_min_descriptors=1)


def _wait_layers(d: Node, key: str, dg: Geom, req: Req, layers: int, timeout: float = 20.0) -> np.ndarray:
    """Poll D's cache until layers ``[0, layers)`` of ``req``'s first block are no longer the sentinel."""
    deadline = time.monotonic() + timeout
    blk = req.d_blocks[0]
    while True:
        got = d.call("snapshot", key)
        if all((got[i, :, blk] != SENTINEL).any() for i in range(layers)) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def _pushed_intact(
    p: Node, d: Node, k: str, pg: Geom, dg: Geom, reqs: list[Req]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every request's result on both sides (all ok), D's cache equal to the reference built from P's,
    and both sides idle; returns D's and P's results by request id for the test's own checks."""
    d_res = by_rid(d.call("results", k + "d", len(reqs), 20.0))
    p_res = by_rid(p.call("results", k + "p", len(reqs), 10.0))
    assert all(x.ok for x in d_res.values()) and len(d_res) == len(reqs), d_res
    assert all(x.ok for x in p_res.values()) and len(p_res) == len(reqs), p_res
    src = p.call("snapshot", k + "p")
    exp = make_cache(dg, None)
    for r in reqs:
        apply_push(exp, dg, src, pg, r)
    assert_same(d.call("snapshot", k + "d"), exp, dg)
    assert_idle(p, k + "p")
    assert_idle(d, k + "d")
    return d_res, p_res


def _wait_paired(p: Node, key: str, count: int, timeout: float = 20.0) -> None:
    """Until P has paired ``count`` registrations with its started prefills (they reached P)."""
    deadline = time.monotonic() + timeout
    while p.call("stats", key)["in_flight"] < count:
        assert time.monotonic() < deadline, "registrations never reached P"
        time.sleep(0.02)


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_layers_reach_d_as_they_are_computed(nodes: tuple[Node, Node], plan: str) -> None:
    p, d = nodes
    pg, dg = Geom(layers=LAYERS, num_blocks=64), Geom(layers=LAYERS, num_blocks=96, block_size=32, order="HND")
    k = _key("lw" + plan)
    reqs = [
        Req(f"{k}-a", f"{k}-pa", f"{k}-da", [5, 9, 2, 40, 41, 7], [3, 60, 17], 90),
        Req(f"{k}-b", f"{k}-pb", f"{k}-db", [11, 12, 13], [70, 8], 40, 8),
    ]
    with (
        engines(p, "sender", [(k + "p", pg, _p_cfg(plan), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _d_cfg(plan), "D" + k)]),
    ):
        peer = (addr[0], addr[1], 1)
        for r in reqs:
            p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
            d.call("register", k + "d", r.tid, r.d_rid, peer, r.d_blocks, r.n, r.start)
        tids = [r.tid for r in reqs]
        _wait_paired(p, k + "p", len(reqs))
        for layer in range(LAYERS):
            p.call("compute_layers", k + "p", layer, layer + 1, 7000 + layer)
            p.call("layer_written", k + "p", tids, layer)
            _wait_layers(d, k + "d", dg, reqs[1], layer + 1)  # so that each layer is its own WRITE
            if layer == 2:
                # Layers 0-2 arrive; 3-5 are not computed yet and must not be on D.
                got = _wait_layers(d, k + "d", dg, reqs[0], 3)
                for r in reqs:
                    for i in range(3):
                        assert (got[i, :, r.d_blocks[-1]] != SENTINEL).any(), f"layer {i} of {r.tid} missing"
                    assert (got[3:, :, r.d_blocks] == SENTINEL).all(), "a layer reached D before it was computed"
                assert d.call("results", k + "d", 1, 0.2) == [], "D reported before every layer arrived"
        d_res, p_res = _pushed_intact(p, d, k, pg, dg, reqs)
        for r in reqs:
            # One WRITE per layer, counted by D region by region.
            assert p_res[r.p_rid].stats.parts == LAYERS, p_res[r.p_rid].stats
            assert d_res[r.d_rid].stats.parts == LAYERS
            assert p_res[r.p_rid].stats.plan == plan


def test_late_registration_gets_computed_layers_at_once(nodes: tuple[Node, Node]) -> None:
    p, d = nodes
    pg, dg = Geom(layers=LAYERS, num_blocks=64), Geom(layers=LAYERS, num_blocks=64)
    k = _key("late")
    r = Req(f"{k}-a", f"{k}-p", f"{k}-d", [1, 2, 3, 4], [9, 8, 7, 6], 60)
    with (
        engines(p, "sender", [(k + "p", pg, _p_cfg("direct"), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _d_cfg("direct"), "D" + k)]),
    ):
        p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        p.call("compute_layers", k + "p", 0, 4, 11)
        p.call("layer_written", k + "p", [r.tid], 3)
        time.sleep(0.2)
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        got = _wait_layers(d, k + "d", dg, r, 4)
        assert (got[4:] == SENTINEL).all()
        p.call("compute_layers", k + "p", 4, LAYERS, 12)
        p.call("layer_written", k + "p", [r.tid], LAYERS - 1)
        d_res, p_res = _pushed_intact(p, d, k, pg, dg, [r])
        dres, pres = d_res[r.d_rid], p_res[r.p_rid]
        # Layers 0-3 went in the first WRITE, layers 4-5 in a second one.
        assert pres.stats.parts == 2 and dres.stats.parts == 2, pres.stats


@contextmanager
def _grouped_push(
    p: Node, d: Node, name: str, plan: str, layers_a_part: int, lead: int = STREAM
) -> Iterator[tuple[str, Req, Geom, Geom]]:
    """One request pushed layer-wise with ``layers_a_part`` layers a part (once ``lead`` layers are left),
    registered and paired on P before any layer is reported; yields the engines' key, the request and
    both geometries."""
    pg, dg = Geom(layers=LAYERS, num_blocks=64), Geom(layers=LAYERS, num_blocks=64)
    k = _key(name)
    r = Req(f"{k}-a", f"{k}-p", f"{k}-d", [1, 2, 3, 4], [9, 8, 7, 6], 60)
    layer_bytes = RPL * r.n * pg.local_heads * pg.head_bytes
    cfg = _cfg(plan=plan, layerwise_min_part_bytes=layers_a_part * layer_bytes, layerwise_lead_layers=lead)
    with (
        engines(p, "sender", [(k + "p", pg, cfg, "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _d_cfg(plan), "D" + k)]),
    ):
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        _wait_paired(p, k + "p", 1)
        yield k, r, pg, dg


@pytest.mark.parametrize("plan", ["direct", "staged"])
def test_small_layers_are_grouped_into_parts(nodes: tuple[Node, Node], plan: str) -> None:
    """``layerwise_min_part_bytes``: a part waits until that many bytes of layers are ready, except the last."""
    p, d = nodes
    with _grouped_push(p, d, "group" + plan, plan, 2) as (k, r, pg, dg):
        p.call("compute_layers", k + "p", 0, 1, 21)
        p.call("layer_written", k + "p", [r.tid], 0)
        time.sleep(0.3)
        assert (d.call("snapshot", k + "d") == SENTINEL).all(), "one layer was posted alone"
        p.call("compute_layers", k + "p", 1, 3, 22)
        p.call("layer_written", k + "p", [r.tid], 1)
        got = _wait_layers(d, k + "d", dg, r, 2)
        assert (got[2:] == SENTINEL).all()
        p.call("layer_written", k + "p", [r.tid], 2)  # layer 2: one layer, held back
        time.sleep(0.3)
        assert (d.call("snapshot", k + "d")[2:] == SENTINEL).all(), "one layer was posted alone"
        p.call("compute_layers", k + "p", 3, LAYERS, 23)
        p.call("layer_written", k + "p", [r.tid], LAYERS - 2)  # layers 2-4: a part
        p.call("layer_written", k + "p", [r.tid], LAYERS - 1)  # the last layer goes alone
        d_res, p_res = _pushed_intact(p, d, k, pg, dg, [r])
        dres, pres = d_res[r.d_rid], p_res[r.p_rid]
        # [0, 2), then [2, 5) and [5, 6), or [2, 6) when both reports are read in one step: never a layer alone
        # before the last.
        assert pres.stats.parts in (2, 3) and dres.stats.parts == pres.stats.parts, pres.stats


def test_the_group_before_the_last_layer_is_posted_so_the_last_layer_goes_alone(nodes: tuple[Node, Node]) -> None:
    """When one layer is left, the layers held back for a larger part go at once (the tail is one layer)."""
    p, d = nodes
    with _grouped_push(p, d, "tail", "staged", 3) as (k, r, pg, dg):
        p.call("compute_layers", k + "p", 0, LAYERS, 31)
        for layer in range(1, LAYERS):
            p.call("layer_written", k + "p", [r.tid], layer - 1)
        # Layers [0, 3) made a part; 3 and 4 are two layers, short of a part, but only one layer is left.
        got = _wait_layers(d, k + "d", dg, r, LAYERS - 1)
        arrived = [i for i in range(LAYERS) if (got[i, :, r.d_blocks[0]] != SENTINEL).any()]
        assert arrived == list(range(LAYERS - 1)), f"layers on D: {arrived}, {p.call('stats', k + 'p')}"
        assert (got[LAYERS - 1] == SENTINEL).all()
        p.call("layer_written", k + "p", [r.tid], LAYERS - 1)
        d_res, p_res = _pushed_intact(p, d, k, pg, dg, [r])
        # 3 parts ([0, 3), [3, 5), [5]), or 2 where P's thread woke late and read the reports of layers 0-4
        # at once ([0, 5), [5]): either way the held-back layers went before the last layer was written.
        pres, dres = p_res[r.p_rid], d_res[r.d_rid]
        assert pres.stats.parts in (2, 3) and dres.stats.parts == pres.stats.parts, pres.stats


def _first_report(p: Node, k: str, r: Req) -> int:
    """Write every layer (the stand-in forward), report layer 0 and let P read it (whether that report
    wakes P or not); returns P's wake-up count after it."""
    p.call("compute_layers", k + "p", 0, LAYERS, 41)
    p.call("layer_written", k + "p", [r.tid], 0)
    time.sleep(0.2)
    return p.call("wakeups", k + "p")


def test_reports_that_cannot_start_a_part_do_not_wake_the_push_thread(nodes: tuple[Node, Node]) -> None:
    """Layers grouped four a part: after the first report, those of layers 1 and 2 are read later without
    a wake-up (each would take the GIL from the forward); the fourth wakes P and the part goes."""
    p, d = nodes
    with _grouped_push(p, d, "quiet", "staged", 4) as (k, r, pg, dg):
        _first_report(p, k, r)
        quiet = p.call("stats", k + "p")["quiet_reports"]  # layer 0's report may be quiet too
        woken = p.call("wakeups", k + "p")
        p.call("layer_written", k + "p", [r.tid], 1)
        p.call("layer_written", k + "p", [r.tid], 2)
        time.sleep(0.2)
        assert p.call("wakeups", k + "p") == woken, "a report that cannot start a part woke P"
        assert (d.call("snapshot", k + "d") == SENTINEL).all(), "a part went before four layers were ready"
        p.call("layer_written", k + "p", [r.tid], 3)
        got = _wait_layers(d, k + "d", dg, r, 4)
        assert all((got[i, :, r.d_blocks[0]] != SENTINEL).any() for i in range(4)), "layers 0-3 never came"
        assert p.call("stats", k + "p")["quiet_reports"] - quiet == 2
        for layer in range(5, LAYERS + 1):
            p.call("layer_written", k + "p", [r.tid], layer - 1)
        _pushed_intact(p, d, k, pg, dg, [r])


@pytest.mark.parametrize("lead", [1, 2])
def test_layers_are_held_back_until_lead_layers_are_left(nodes: tuple[Node, Node], lead: int) -> None:
    """The default schedule (``layerwise_lead_layers``): even with parts of any size allowed, no layer goes
    while more than ``lead`` layers are left, those reports do not wake P, and then every ready layer
    goes in one part; the rest follow one by one."""
    p, d = nodes
    with _grouped_push(p, d, f"hold{lead}", "staged", 0, lead=lead) as (k, r, pg, dg):
        woken = _first_report(p, k, r)
        held = LAYERS - lead
        for layer in range(2, held):
            p.call("layer_written", k + "p", [r.tid], layer - 1)
        time.sleep(0.3)
        assert p.call("wakeups", k + "p") == woken, "a held-back report woke P"
        assert (d.call("snapshot", k + "d") == SENTINEL).all(), "a layer went before the lead was reached"
        p.call("layer_written", k + "p", [r.tid], held - 1)
        got = _wait_layers(d, k + "d", dg, r, held)
        arrived = [i for i in range(LAYERS) if (got[i, :, r.d_blocks[0]] != SENTINEL).any()]
        assert arrived == list(range(held)), arrived
        for layer in range(held + 1, LAYERS + 1):
            p.call("layer_written", k + "p", [r.tid], layer - 1)
            if layer < LAYERS:  # landed before the next is reported (a P slow to wake would take both at once)
                _wait_layers(d, k + "d", dg, r, layer)
        d_res, p_res = _pushed_intact(p, d, k, pg, dg, [r])
        # [0, held) at once, then each of the lead layers alone.
        assert p_res[r.p_rid].stats.parts == d_res[r.d_rid].stats.parts == 1 + lead, p_res[r.p_rid].stats


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_in_the_middle_of_the_layers_releases_both_sides(nodes: tuple[Node, Node], side: str) -> None:
    p, d = nodes
    pg, dg = Geom(layers=LAYERS, num_blocks=64), Geom(layers=LAYERS, num_blocks=64)
    k = _key("ab" + side)
    r = Req(f"{k}-a", f"{k}-p", f"{k}-d", [1, 2, 3], [4, 5, 6], 40)
    with (
        engines(p, "sender", [(k + "p", pg, _p_cfg("staged"), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, _d_cfg("staged"), "D" + k)]),
    ):
        p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        _wait_paired(p, k + "p", 1)
        p.call("compute_layers", k + "p", 0, 2, 21)
        p.call("layer_written", k + "p", [r.tid], 1)
        _wait_layers(d, k + "d", dg, r, 2)
        if side == "decode":
            d.call("abort", k + "d", r.tid, "client went away")
        else:
            p.call("abort", k + "p", r.tid, "request aborted on P")
        [dres] = d.call("results", k + "d", 1, 20.0)
        [pres] = p.call("results", k + "p", 1, 10.0)
        assert not dres.ok and not pres.ok
        assert ("client went away" if side == "decode" else "aborted on P") in dres.reason, dres.reason
        # The forward goes on after the abort; later layers are not pushed.
        p.call("compute_layers", k + "p", 2, LAYERS, 22)
        p.call("layer_written", k + "p", [r.tid], LAYERS - 1)
        time.sleep(0.3)
        got = d.call("snapshot", k + "d")
        assert (got[2:] == SENTINEL).all(), "a layer was written after the abort"
        assert d.call("results", k + "d", 1, 0.1) == [] and p.call("results", k + "p", 1, 0.1) == []
        assert_idle(p, k + "p")
        assert_idle(d, k + "d")


def test_large_staged_push_is_pipelined_in_parts(nodes: tuple[Node, Node]) -> None:
    """A whole-request staged push cut into ``push_parts`` WRITEs lands byte-exact, each part unpacked on its own."""
    p, d = nodes
    pg, dg = Geom(layers=LAYERS, num_blocks=64), Geom(layers=LAYERS, num_blocks=64, block_size=32, order="HND")
    k = _key("parts")
    rng = np.random.default_rng(5)
    reqs = [
        Req(f"{k}-{i}", f"{k}-p{i}", f"{k}-d{i}", rng.permutation(64)[:8].tolist(), [2 * i, 2 * i + 1, 40 + i], 80)
        for i in range(3)
    ]
    with (
        engines(
            p, "sender", [(k + "p", pg, _p_cfg("staged", push_parts=5, min_part_bytes=0, part_cost_us=0), "P" + k)]
        ) as [addr],
        engines(d, "receiver", [(k + "d", dg, _d_cfg("staged"), "D" + k)]),
    ):
        for r in reqs:
            d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
            p.call("prefill", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        d_res, p_res = _pushed_intact(p, d, k, pg, dg, reqs)
        for r in reqs:
            assert p_res[r.p_rid].stats.parts == 5 and d_res[r.d_rid].stats.parts == 5


@pytest.mark.parametrize("muted", [False, True])
def test_d_polls_slowly_until_p_says_it_writes(nodes: tuple[Node, Node], muted: bool) -> None:
    """With a GPU host's 5 us busy poll, D does not spin while its registration waits for P's prefill
    (each poll would take the GIL from D's decode loop): it polls NIXL every ``WARM_POLL_S`` until P's
    ``Posting`` says the push starts. Without the heads-up (``muted``: as if it were lost) the push
    still completes, found by the slow poll."""
    p, d = nodes
    pg = dg = Geom(layers=LAYERS, num_blocks=64)
    k = _key("warm" + "muted" * muted)
    r = Req(f"{k}-a", f"{k}-p", f"{k}-d", [1, 2, 3, 4], [9, 8, 7, 6], 60)
    fast = {"busy_poll_max_s": 5e-6, "idle_poll_max_s": 0.02}
    with (
        engines(p, "sender", [(k + "p", pg, _p_cfg("staged", **fast), "P" + k)]) as [addr],
        engines(d, "receiver", [(k + "d", dg, {**_d_cfg("staged"), **fast}, "D" + k)]),
    ):
        if muted:
            p.call("mute_posting", k + "p")
        d.call("register", k + "d", r.tid, r.d_rid, (addr[0], addr[1], 1), r.d_blocks, r.n, r.start)
        p.call("prefill_started", k + "p", r.tid, r.p_rid, r.p_blocks, r.n)
        _wait_paired(p, k + "p", 1)
        loops = d.call("loops", k + "d")
        time.sleep(0.5)
        loops = d.call("loops", k + "d") - loops
        # ~500 at one poll a millisecond (plus timers); a busy poll at 5-20 us makes tens of thousands.
        assert loops < 1500, f"D looped {loops} times in 0.5 s while nothing was being written"
        p.call("compute_layers", k + "p", 0, LAYERS, 51)
        p.call("layer_written", k + "p", [r.tid], LAYERS - 1)
        _pushed_intact(p, d, k, pg, dg, [r])
        # The Posting travels on the side channel, the completion on NIXL's path: on a busy host the
        # completion may come first, and the Posting a moment after the transfer was reported.
        deadline = time.monotonic() + 5.0
        while (seen := d.call("stats", k + "d").get("postings_total", 0)) < 1 and not muted:
            assert time.monotonic() < deadline, "D never received P's Posting"
            time.sleep(0.05)
        assert seen == (0 if muted else 1)
