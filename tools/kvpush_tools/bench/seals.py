"""``kvpush bench seals``: what a seal costs one NIXL notification, on each side, in one process.

P's side: a part's Completion frame as P builds it, then sealed (``Sealer.seal``: one keyed BLAKE2b and one
more msgpack encode) against left as it is. D's side: the frame decoded and checked as D's receiver does it
(``protocol.decode`` of the notification, ``LinkSeals.check``: the MAC, the replay window, the decode of what
the seal carries) against the unsealed frame decoded and passed by a link of an older protocol. The four are
timed in rounds, interleaved, so that each sees the same machine; the medians and the 10th to 90th
percentile of the per-call times of the rounds are reported. *Warm*: calls back to back, each round's time
divided by its calls. *Cold*: each call timed alone after a pause and a sweep through 32 MiB, as an engine
thread woken by a notification meets it (its caches evicted: the costs then are several times a loop's).
The engine-level cost (whole transfers, sealed or not) is ``kvpush bench transfer --tree`` against a tree
without seals (docs/results.md, section 7).

Writes ``seals.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _cases() -> dict[str, Callable[[], Any]]:
    """The four calls, each on a fresh notification (sequence numbers move on, as they do on the wire)."""
    from kvpush.core import protocol, seal
    from kvpush.core.outcome import PlanKind
    from kvpush.decode.seals import NOTIFICATIONS, LinkSeals
    from kvpush.prefill.seals import Sealer

    done = protocol.Completion(
        "cmpl-5f0c3b9a2e7d4c1b8a6f0e9d7c5b3a1f-0",
        "cmpl-5f0c3b9a2e7d4c1b8a6f0e9d7c5b3a1f",
        3,
        PlanKind.STAGED,
        1 << 24,
        1,
        protocol.StagingGrant(1 << 26, 1 << 27),
        1,
        region_start=16,
        region_end=32,
    )
    key = bytes(range(seal.KEY_BYTES))
    sealer = Sealer(key, 1)
    sealer.checks(1)
    d_sealed, d_plain = LinkSeals(), LinkSeals()
    d_sealed.offer(1, key)
    d_sealed.answered(1, protocol.SEALS_VERSION)
    d_plain.answered(1, protocol.ROUNDS_VERSION)
    kinds = (*NOTIFICATIONS, protocol.Sealed)  # what D's receiver decodes a notification as
    frame = protocol.encode(done)
    sealed_frames: list[bytes] = []

    def p_plain() -> bytes:
        return protocol.encode(done)

    def p_sealed() -> bytes:
        out = sealer.seal(protocol.encode(done))
        sealed_frames.append(out)
        return out

    def d_plain_check() -> Any:
        return d_plain.check(protocol.decode(frame, expected=kinds))

    def d_sealed_check() -> Any:
        verdict = d_sealed.check(protocol.decode(sealed_frames.pop(), expected=kinds))
        assert verdict.__class__.__name__ == "Accepted", verdict
        return verdict

    return {"p_unsealed": p_plain, "p_sealed": p_sealed, "d_unsealed": d_plain_check, "d_sealed": d_sealed_check}


def measure(rounds: int, per_round: int, cold: int) -> dict[str, Any]:
    """Per-call seconds of each case: warm, ``per_round`` calls a round, the cases taking turns round by round;
    then ``cold`` calls of each, one at a time after evicting the caches, the cases taking turns (P's sealed
    calls make the frames D's sealed calls check)."""
    import numpy as np

    cases = _cases()
    order = ("p_unsealed", "p_sealed", "d_unsealed", "d_sealed")
    warm: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name in order:
            fn = cases[name]
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            warm[name].append((time.perf_counter() - t0) / per_round)
    evict = np.zeros(32 << 20, np.uint8)
    chilled: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(cold):
        for name in order:
            evict[::64] += 1
            time.sleep(0.0005)
            t0 = time.perf_counter()
            cases[name]()
            chilled[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"rounds": rounds, "per_round": per_round, "cold_calls": cold, "warm": {}, "cold": {}}
    for mode, samples in (("warm", warm), ("cold", chilled)):
        for name, v in samples.items():
            if not v:
                continue
            q = statistics.quantiles(v, n=10) if len(v) >= 2 else [v[0]] * 9
            out[mode][name] = {"median_us": 1e6 * statistics.median(v), "p10_us": 1e6 * q[0], "p90_us": 1e6 * q[-1]}
        c = out[mode]
        if c:
            c["p_cost_us"] = c["p_sealed"]["median_us"] - c["p_unsealed"]["median_us"]
            c["d_cost_us"] = c["d_sealed"]["median_us"] - c["d_unsealed"]["median_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush bench seals", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50, help="warm rounds")
    ap.add_argument("--per-round", type=int, default=2000, help="warm calls per round")
    ap.add_argument("--cold", type=int, default=400, help="cold calls of each case (0: none)")
    ap.add_argument("--out", type=Path, default=Path("results/seals"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.per_round < 1 or args.cold < 0:
        print("--rounds and --per-round must be >= 1, --cold >= 0", file=sys.stderr)
        return 2
    result = measure(args.rounds, args.per_round, args.cold)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seals.json").write_text(json.dumps(result, indent=1) + "\n")
    for mode in ("warm", "cold"):
        c = result[mode]
        if not c:
            continue
        for name in ("p_unsealed", "p_sealed", "d_unsealed", "d_sealed"):
            r = c[name]
            print(f"{mode} {name:11s} {r['median_us']:6.2f} us (p10 {r['p10_us']:.2f}, p90 {r['p90_us']:.2f})")
        print(f"{mode}: a seal costs P {c['p_cost_us']:.2f} us and D {c['d_cost_us']:.2f} us a notification (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
