"""The soak's rules, pure: which failed request a fault explains, the counts, the memory slope and its window,
and the verdict that names every acceptance condition that failed.

Nothing here starts a process or opens a socket, so the rules the soak's exit status rests on are tested
without servers (``tests/bench/test_bench_soak.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

OK, MISMATCH, ABORTED, FAILED = "ok", "mismatch", "aborted", "failed"
"""A request's outcome: its text equals the reference's, differs from it, the client closed it on purpose
before its end, or it ended without a text (an HTTP error, an error in the stream, a client timeout)."""


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the start of the load."""

    index: int
    prompt: int
    kind: str
    """``plain`` (one answer), ``stream`` (read to its end), ``abort-early`` or ``abort-mid`` (closed by the
    client after a delay, or after the first chunk with text)."""
    start: float
    end: float = 0.0
    outcome: str = FAILED
    error: str = ""
    timed_out: bool = False
    """The client gave up waiting (its timeout): never explained by a fault (:func:`explained`)."""


@dataclass
class Window:
    """A fault, from its start to when the stack served again (``recovered``; None: it never did)."""

    name: str
    start: float
    recovered: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def until(self, grace_s: float) -> float:
        """Where failures stop being this fault's: ``grace_s`` after recovery (never, unrecovered)."""
        return float("inf") if self.recovered is None else self.recovered + grace_s


def explained(rec: Record, windows: Sequence[Window], grace_s: float) -> Window | None:
    """The fault that explains a failed request, or None.

    Rule: a failure is a fault's when the request was in flight at some time between the fault's start and
    ``grace_s`` after its recovery (it started before that end and ended after the start). Why in flight and
    not started-in: a request paired with a P that is then killed was sent before the kill and fails after
    it. Why a grace: the router and D find a server again only at their next look (health checks, D's
    hello), a few seconds after the server itself is up. A client timeout is never explained: every fault
    here ends within a few ``peer_dead_s``, far inside the client's patience, so a request that waited that
    long hung, and a hang is a bug whatever else happened. In flight during two faults (the second began
    within the first's grace), the failure is the later fault's: the earlier one's stack was serving again.
    """
    if rec.outcome != FAILED or rec.timed_out:
        return None
    mine = [w for w in windows if rec.start <= w.until(grace_s) and rec.end >= w.start]
    return max(mine, key=lambda w: w.start, default=None)


def tally(records: Iterable[Record], windows: Sequence[Window], grace_s: float) -> dict[str, Any]:
    """Counts by kind of ending: ``ok``, ``aborted``, ``mismatched``, ``failed_explained`` (with ``by_fault``),
    ``failed_unexplained``; ``requests`` is their sum, each request counted once."""
    counts: dict[str, Any] = {
        "requests": 0,
        "ok": 0,
        "aborted": 0,
        "mismatched": 0,
        "failed_explained": 0,
        "failed_unexplained": 0,
        "by_fault": {w.name: 0 for w in windows},
    }
    for rec in records:
        counts["requests"] += 1
        if rec.outcome == OK:
            counts["ok"] += 1
        elif rec.outcome == ABORTED:
            counts["aborted"] += 1
        elif rec.outcome == MISMATCH:
            counts["mismatched"] += 1
        else:
            w = explained(rec, windows, grace_s)
            if w is None:
                counts["failed_unexplained"] += 1
            else:
                counts["failed_explained"] += 1
                counts["by_fault"][w.name] += 1
    return counts


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through the points: (slope, intercept). Raises ValueError for fewer than two
    distinct x values (no slope exists)."""
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"{n} x values for {len(ys)} y values")
    if n < 2:
        raise ValueError("a slope needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def slope_window(load_start: float, load_end: float, last_up: float | None) -> tuple[float, float]:
    """The span a server's memory slope is fitted over: the last half of what it ran of the load after it
    last came up (``last_up``: when the server last became healthy, None if it never restarted).

    Why after the last restart: a restart resets the process, so a fit across it measures the restart, not
    a leak. Why the last half: the first requests a fresh server serves grow its memory for reasons that
    stop (allocator pools, caches, lazily built kernels); a leak keeps growing to the end.
    """
    begin = load_start if last_up is None else max(load_start, last_up)
    return begin + (load_end - begin) / 2, load_end


def memory_slope(
    samples: Sequence[tuple[float, float, float | None]], window: tuple[float, float], min_points: int = 5
) -> dict[str, Any]:
    """Fit one server's memory over ``window`` from samples (time s, requests ended, RSS MB or None).

    Returns ``mb_per_1k_requests`` (RSS against requests ended), ``mb_per_min`` (against time), the points
    and the span; an ``error`` instead when fewer than ``min_points`` samples fall in the window (too short
    a run to say whether memory is flat)."""
    pts = [(t, n, mb) for t, n, mb in samples if window[0] <= t <= window[1] and mb is not None]
    out: dict[str, Any] = {"window_s": [round(window[0], 1), round(window[1], 1)], "points": len(pts)}
    if len(pts) < min_points:
        return {**out, "error": f"{len(pts)} samples in the window (at least {min_points} needed)"}
    ts, ns, mbs = [p[0] for p in pts], [p[1] for p in pts], [float(p[2]) for p in pts]  # type: ignore[arg-type]
    try:
        per_req, _ = fit(ns, mbs)
        out["mb_per_1k_requests"] = per_req * 1000
    except ValueError as exc:
        out["error"] = f"no requests ended in the window ({exc})"
    per_s, at0 = fit(ts, mbs)
    out["mb_per_min"] = per_s * 60
    out["fit_line"] = [[round(t, 1), round(at0 + per_s * t, 2)] for t in (ts[0], ts[-1])]
    out["rss_mb_first_last"] = [round(mbs[0], 1), round(mbs[-1], 1)]
    out["requests_in_window"] = ns[-1] - ns[0]
    return out


@dataclass(frozen=True)
class Limits:
    """What the verdict demands (the soak's options)."""

    requests: int
    max_slope_mb_per_1k: float
    faults: tuple[str, ...]


def verdict(summary: dict[str, Any], limits: Limits) -> list[str]:
    """Every acceptance condition the run failed, each named (empty: it passed).

    Conditions: at least ``requests`` requests sent; no unexplained failure; no output that differs from
    the single instance's; every fault recovered, with a request served after it; each server's memory slope
    over its window at most ``max_slope_mb_per_1k`` (not judged when that is infinite: a run too short for a
    slope to mean anything); KV usage (and D's withheld blocks) back to zero on P and
    D after the load stopped."""
    bad: list[str] = []
    c = summary["counts"]
    if c["requests"] < limits.requests:
        bad.append(f"requests: {c['requests']} sent, {limits.requests} asked for")
    if c["failed_unexplained"]:
        bad.append(f"unexplained failures: {c['failed_unexplained']}")
    if c["mismatched"]:
        bad.append(f"outputs differing from the single instance: {c['mismatched']}")
    done = {f["name"]: f for f in summary["faults"]}
    for name in limits.faults:
        f = done.get(name)
        if f is None:
            bad.append(f"fault {name}: never ran (the load ended before its point)")
        elif f.get("recovered") is None:
            bad.append(f"fault {name}: the stack never served again")
        elif not f.get("served_after"):
            bad.append(f"fault {name}: no request completed after the recovery")
    judged = limits.max_slope_mb_per_1k != float("inf")  # inf: memory reported, not judged (a short run)
    for side, m in summary["memory"].items():
        if not judged:
            continue
        if "error" in m:
            bad.append(f"memory {side}: {m['error']}")
        elif m["mb_per_1k_requests"] > limits.max_slope_mb_per_1k:
            bad.append(
                f"memory {side}: {m['mb_per_1k_requests']:.1f} MB per 1,000 requests over the last half"
                f" (at most {limits.max_slope_mb_per_1k:g})"
            )
    for side, end in summary["kv_at_end"].items():
        if not end.get("zero"):
            bad.append(f"KV usage {side}: not back to zero after the load ({end.get('last')})")
    return bad
