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


@pytest.mark.parametrize(("p", "d"), [("1.5.1", "1.5.2"), ("1.6.0", "1.5.1"), ("1.6.0", "1.7.0")])
def test_libfabric_of_different_versions_one_newer_than_tested_is_refused_naming_both(p: str, d: str) -> None:
    """Whether LIBFABRIC plugins of different versions talk to each other is known only for the versions kvpush
    tested (1.3.2 to 1.5.1): beyond, a pair of different versions is refused rather than lose notifications."""
    reason = peer_problem(p, LF, d, LF)
    assert f"P runs NIXL {p}" in reason and f"D runs NIXL {d}" in reason
    assert "is unknown" in reason and "NIXL 1.3.2 to 1.5.1" in reason


@pytest.mark.parametrize(("p", "pb", "d", "db"), [("1.6.0", LF, "1.6.0", LF), ("1.6.0", UCX, "1.5.1", UCX)])
def test_a_newer_nixl_of_one_version_or_over_ucx_is_not_refused(
    p: str, pb: tuple[str, ...], d: str, db: tuple[str, ...]
) -> None:
    assert peer_problem(p, pb, d, db) == ""
