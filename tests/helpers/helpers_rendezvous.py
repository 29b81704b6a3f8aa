"""What the rendezvous' state machine tests check alike: the per-rank holdings equal what the entries hold."""

from __future__ import annotations

from collections.abc import Iterable

from kvpush.prefill.rendezvous import Rendezvous


def check_holdings(rv: Rendezvous, tids: Iterable[str], ranks: Iterable[tuple[str, int]]) -> None:
    """``rv.holdings`` counts, per D rank, exactly the registrations and block ids its entries hold."""
    expected: dict[object, list[int]] = {}
    for tid in tids:
        for k, (n, ids) in rv.holding(tid).items():
            h = expected.setdefault(k, [0, 0])
            h[0] += n
            h[1] += ids
    for k in {*expected, *ranks}:
        assert rv.holdings.held(k) == tuple(expected.get(k, (0, 0))), k
