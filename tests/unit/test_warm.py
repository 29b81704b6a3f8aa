"""Which P ranks D says hello to at start (``kvpush.decode.warm``): the entries it reads, the ranks it picks."""

from __future__ import annotations

import pytest

from kvpush.core.errors import ConfigError
from kvpush.decode.allow import Allowed
from kvpush.decode.warm import parse_peer, warm_links


def test_entries_are_read_and_bad_ones_named() -> None:
    assert parse_peer("10.0.0.1:5600") == ("10.0.0.1", 5600, 1)
    assert parse_peer("p-0.prefill.svc:5600/4") == ("p-0.prefill.svc", 5600, 4)
    assert parse_peer("[fd00::1]:5600/2") == ("fd00::1", 5600, 2)
    for bad in ("10.0.0.1", "10.0.0.1:0", "10.0.0.1:99999", "h:5600/0", "h:5600/x", "h:56a0", "h:5600/2/3", "h: 5600"):
        with pytest.raises(ConfigError, match="prefill_peers entry"):
            parse_peer(bad)
    with pytest.raises(ConfigError, match="prefill_peers entry"):
        parse_peer("h:٥٦٠٠")  # a port in another script's digits is not one


def test_d_says_hello_to_the_p_ranks_that_write_it_and_that_it_may_dial() -> None:
    # P TP 2 over 8 heads, D TP 1: both P ranks write D rank 0, at port and port + 1; a duplicate entry adds none.
    keys, skipped = warm_links(("p:5600/2", "p:5600/2"), 0, 1, 8, Allowed())
    assert keys == [("p", 5600), ("p", 5601)] and not skipped
    # P TP 1, D TP 2: P rank 0 writes both D ranks.
    assert warm_links(("p:5600",), 1, 2, 8, Allowed())[0] == [("p", 5600)]
    keys, skipped = warm_links(("p:5600/2", "q:7000"), 0, 1, 8, Allowed.parse(("p",)))
    assert keys == [("p", 5600), ("p", 5601)] and len(skipped) == 1 and "q:7000" in skipped[0]
