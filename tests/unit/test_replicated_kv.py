"""Replicated KV (MLA's latent, more TP ranks than KV heads), the pure rules on both sides.

Every P rank holds the KV; ``kvpush.core.topology`` picks one writer per D rank
(spread over P ranks), so some P ranks write into no D rank of an instance.
D registers with its writers and tells those idle ranks at once that their
copy is not needed; P releases a prefill nobody will take as a success,
whether the word comes before or after the prefill finishes.
"""

from __future__ import annotations

import pytest

from kvpush.core import protocol
from kvpush.core.outcome import Cause, Failed, Stage
from kvpush.core.topology import targets_for, writers_for
from kvpush.decode.fencing import Fencing
from kvpush.decode.fencing_actions import Cancel, Report, SendRegister
from kvpush.decode.incoming import Asked
from kvpush.prefill.decisions import Prefill, Release
from kvpush.prefill.rendezvous import Rendezvous


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 1), (4, 2), (1, 2), (2, 2), (8, 3)])
def test_one_writer_per_d_rank_spread_and_the_rest_idle(p_tp: int, d_tp: int) -> None:
    """One head slot (MLA): each D rank has exactly one writer, D ranks spread over P ranks, and the P ranks
    that write to no D rank are exactly the ones with no targets."""
    writers = {d: writers_for(d, d_tp, p_tp, 1) for d in range(d_tp)}
    assert all(len(w) == 1 for w in writers.values()), writers
    assert len({w[0] for w in writers.values()}) == min(p_tp, d_tp)  # spread
    used = {w[0] for w in writers.values()}
    assert {p for p in range(p_tp) if not targets_for(p, p_tp, d_tp, 1)} == set(range(p_tp)) - used


def test_d_registers_with_its_writer_and_tells_idle_ranks_it_does_not_need_them() -> None:
    book = Fencing(nregions=2, transfer_timeout_s=30.0, peer_dead_s=5.0)
    asked = Asked("t", "r", ((0, 1),), 20)
    out = book.register(asked, {0: ("h", 100)}, 0.0, bystanders={1: ("h", 101), 3: ("h", 103)})
    assert [a.p_rank for a in out if isinstance(a, SendRegister)] == [0]
    cancels = [a for a in out if isinstance(a, Cancel)]
    assert sorted(c.conn for c in cancels) == [("h", 101), ("h", 103)] and all(c.transfer_id == "t" for c in cancels)
    inc = book.current["t"]
    book.register_sent(inc, 0, None, None, 100, True, 0.0)
    done = book.completion(protocol.Completion("t", "r", 0, region_start=0, region_end=2), 1.0)
    reports = [a.result for a in done if isinstance(a, Report)]
    assert len(reports) == 1 and reports[0].ok  # the writer's completion alone reports: nothing from the others


@pytest.mark.parametrize("prefill_first", [True, False])
def test_p_releases_a_prefill_no_d_rank_takes_as_a_success(prefill_first: bool) -> None:
    rendezvous = Rendezvous(prefill_lease_s=60.0)
    prefill = Prefill("t", "r", ((0, 1),), 20)
    why = Failed(Stage.RENDEZVOUS, Cause.NOT_NEEDED, "not needed by D")
    out = rendezvous.on_prefill(prefill, 0.0) if prefill_first else []
    assert not out
    out = rendezvous.cancel("t", 1.0, why)
    if not prefill_first:
        assert not out  # remembered until the prefill finishes
        out = rendezvous.on_prefill(prefill, 2.0)
    assert len(out) == 1 and isinstance(out[0], Release) and out[0].cause is Cause.NOT_NEEDED
    assert out[0].prefill is prefill
