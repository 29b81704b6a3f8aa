"""Which NIXL versions of P and D can push KV to each other (``kvpush.core.interop``)."""

from __future__ import annotations

import pytest

from kvpush.core.interop import libfabric_wire, peer_problem

LF, UCX = ("LIBFABRIC",), ("UCX",)


@pytest.mark.parametrize(
    ("version", "wire"),
    [("1.3.2", 0), ("1.3.0", 0), ("1.4.1", 1), ("1.5.1", 1), ("1.5.2", 1), ("2.0.0", 1), ("unknown", None)],
)
def test_wire_generations(version: str, wire: int | None) -> None:
    assert libfabric_wire(version) == wire


@pytest.mark.parametrize(("p", "d"), [("1.5.1", "1.3.2"), ("1.3.2", "1.4.1"), ("1.3.2", "1.5.2")])
def test_libfabric_across_the_1_4_break_is_refused_naming_both(p: str, d: str) -> None:
    reason = peer_problem(p, LF, d, LF)
    assert f"P runs NIXL {p}" in reason and f"D runs NIXL {d}" in reason and "LIBFABRIC" in reason


@pytest.mark.parametrize(
    ("p", "pb", "d", "db"),
    [
        ("1.5.1", LF, "1.4.1", LF),  # one generation
        ("1.3.2", LF, "1.3.2", LF),
        ("1.5.1", UCX, "1.3.2", UCX),  # UCX interoperates
        ("1.5.1", LF, "1.3.2", UCX),  # no LIBFABRIC in common: NIXL cannot pick it
        ("1.5.1", LF, "", LF),  # a D that does not say (unknown): not refused on a guess
    ],
)
def test_pairs_that_interoperate_are_not_refused(p: str, pb: tuple[str, ...], d: str, db: tuple[str, ...]) -> None:
    assert peer_problem(p, pb, d, db) == ""
