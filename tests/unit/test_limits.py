"""Per-peer read budgets (``kvpush.core.limits``), driven by hypothesis: no peer gets more than its rate plus
one burst in any window, a peer that waits gets in again, drops are all reported, peers tracked are bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.limits import Budgets, Throttle, Verdict

RATE_BYTES, RATE_MSGS, MIN_BURST = 1000.0, 10.0, 1500

events = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(min_value=0, max_value=2500),  # frame bytes, some over the burst
        st.floats(min_value=0.0, max_value=0.5, allow_nan=False),  # time since the previous event
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_no_peer_exceeds_rate_plus_burst_in_any_window(evs: list[tuple[str, int, float]]) -> None:
    b = Budgets(RATE_BYTES, RATE_MSGS, MIN_BURST)
    now = 0.0
    admitted: dict[str, list[tuple[float, int]]] = {}
    drops = 0
    for peer, nbytes, dt in evs:
        now += dt
        v = b.admit(peer, nbytes, now)
        if v is Verdict.ADMIT:
            admitted.setdefault(peer, []).append((now, nbytes))
        else:
            drops += 1
            assert v in (Verdict.OVER_BYTES, Verdict.OVER_MESSAGES)
            if nbytes > max(RATE_BYTES, MIN_BURST):
                assert v in (Verdict.OVER_BYTES, Verdict.OVER_MESSAGES)
    for frames in admitted.values():
        for i in range(len(frames)):
            for j in range(i, len(frames)):
                window = frames[j][0] - frames[i][0]
                got = sum(n for _, n in frames[i : j + 1])
                assert got <= b.burst_bytes + RATE_BYTES * window + 1e-6, (got, window)
                assert j - i + 1 <= RATE_MSGS + RATE_MSGS * window + 1e-6
    reported = sum(b.report(p, now + 1e9, 1.0) for p in ("a", "b", "c"))
    assert reported == drops


@settings(max_examples=200, deadline=None)
@given(events, st.integers(min_value=1, max_value=1500))
def test_a_peer_that_waits_gets_in(evs: list[tuple[str, int, float]], nbytes: int) -> None:
    """After one burst's worth of quiet, any frame within the burst is admitted, whatever came before."""
    b = Budgets(RATE_BYTES, RATE_MSGS, MIN_BURST)
    now = 0.0
    for peer, n, dt in evs:
        now += dt
        b.admit(peer, n, now)
    quiet = max(b.burst_bytes / RATE_BYTES, RATE_MSGS / RATE_MSGS)
    assert b.admit("a", nbytes, now + quiet) is Verdict.ADMIT


def test_frames_larger_than_a_burst_never_get_in_and_peers_are_bounded() -> None:
    b = Budgets(RATE_BYTES, RATE_MSGS, MIN_BURST, max_peers=8)
    assert b.admit("a", MIN_BURST + 1, 0.0) is Verdict.OVER_BYTES
    assert b.admit("a", MIN_BURST + 1, 1e6) is Verdict.OVER_BYTES
    for i in range(100):
        b.admit(f"p{i}", 1, float(i))
    assert len(b) == 8
    # one peer's flood does not spend another's budget
    for _ in range(50):
        b.admit("flood", 10, 200.0)
    assert b.admit("quiet", 10, 200.0) is Verdict.ADMIT


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.floats(min_value=0.0, max_value=0.7, allow_nan=False)),
        max_size=200,
    ),
    st.integers(min_value=1, max_value=4),
)
def test_throttle_writes_at_most_burst_lines_per_window_and_reports_every_held_one(
    evs: list[tuple[str, float]], burst: int
) -> None:
    """A log line per key: at most ``burst`` in a window of ``every_s`` from the window's first line, and
    every line held back is counted in the next line written for that key."""
    every = 1.0
    t = Throttle(every, burst)
    now = 0.0
    written: dict[str, list[float]] = {"a": [], "b": []}
    held = {"a": 0, "b": 0}
    reported = {"a": 0, "b": 0}
    for key, dt in evs:
        now += dt
        got = t.note(key, now)
        if got is None:
            held[key] += 1
            continue
        reported[key] += got
        written[key].append(now)
    for key, times in written.items():
        for i, start in enumerate(times):
            assert sum(1 for x in times[i:] if x - start < every) <= 2 * burst  # two windows may meet
        assert reported[key] <= held[key]
        if times:
            t2 = t.note(key, now + 2 * every)
            assert t2 == held[key] - reported[key]
