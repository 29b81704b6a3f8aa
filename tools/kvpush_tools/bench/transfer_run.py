"""The run of ``kvpush bench transfer``: every (transport, tree, pattern, plan, order, GIL mode) case in its pair of
processes, the cases taking turns round-robin so that load from other processes on a shared host spreads over
every case; one more transfer per case into a zeroed cache, compared with P's bytes; the report."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kvpush_tools.bench import busy_gil, transfer_plans
from kvpush_tools.bench.transfer_shape import Shape, block_ids
from kvpush_tools.bench.transfer_side import Proc


def _one(p: Proc, d: Proc, case: tuple[str, str], tid: str, sblocks: list[int], dblocks: list[int], addr: Any) -> dict:
    """One measured transfer of ``case`` (plan, order); times are seconds, ``total_s`` from the order's
    start (P's hand-over, D's register call, or P's KV ready) to D's result."""
    plan, order = case
    timeout = 120.0
    if plan == "per-block":
        d.send("wait_notif", tid, timeout)
        ps = p.call("raw_push", tid, sblocks, dblocks, timeout)
        ds = d.recv()
    elif order == "finished":
        p.call("park", plan, tid, sblocks, timeout)
        t0 = d.call("register", plan, tid, addr, dblocks)
        d.send("wait", plan, tid, timeout)
        ps = {"t0": t0, **p.call("released", plan, tid, timeout)}
        ds = d.recv()
    else:
        d.call("register", plan, tid, addr, dblocks)
        d.send("wait", plan, tid, timeout)
        ps = p.call("push", plan, tid, sblocks, timeout, order)
        try:
            ds = d.recv()
        except RuntimeError as exc:  # D saw nothing: what P said of the same push
            keep = ("ok", "reason", "plan", "parts", "descriptors", "bytes")
            raise RuntimeError(f"{exc}\nP's result: { ({k: ps.get(k) for k in keep}) }") from None
    if not (ps["ok"] and ds["ok"]):
        raise RuntimeError(f"{tid} failed: P: {ps.get('reason')!r}, D: {ds.get('reason')!r}")
    return {
        "plan_chosen": str(ps.get("plan", "?")),
        "bytes": int(ps["bytes"]),
        "pieces": int(ps["pieces"]),
        "descriptors_posted": int(ps["descriptors"]),
        "parts": int(ps.get("parts") or 0),
        "prep_s": ps.get("plan_s", 0.0),
        "pack_s": ps.get("pack_s", 0.0),
        "post_s": ps.get("post_s", 0.0),
        "complete_s": ps.get("complete_s", 0.0),
        "unpack_s": ds.get("unpack_s", 0.0),
        # finished: D's work from its register call to the Register leaving (on the path in that order only)
        "register_s": max(0.0, ds["t_sent"] - ps["t0"]) if order == "finished" and ds.get("t_sent") else 0.0,
        "total_s": ds["t_done"] - ps["t0"],
        # CPU time of P's engine thread (from the hand-over, the registration, or the announce, to the
        # release) and D's (from the register call to the result): host work, not waiting
        "p_cpu_s": ps.get("cpu", 0.0),
        "d_cpu_s": ds.get("cpu", 0.0),
        # P's and D's stage times after the order's start (the H200 bench's ``timeline_median``)
        **{f"at_{k}_s": v - ps["t0"] for k, v in {**ps.get("times", {}), **ds.get("times", {})}.items()},
    }


def _summary(pattern: str, case: tuple[str, str], runs: list[dict], shape: Shape, verified: bool) -> dict[str, Any]:
    keys = dict.fromkeys(k for r in runs for k in r if k.endswith("_s"))
    med = {k: statistics.median(r[k] for r in runs if k in r) for k in keys}
    total = med["total_s"]
    blocks_layers = shape.blocks * shape.layers * 2
    return {
        "pattern": pattern,
        "plan": case[0],
        "order": case[1],
        "plan_chosen": runs[-1]["plan_chosen"],
        "bytes": runs[-1]["bytes"],
        "descriptors_before": blocks_layers,
        "descriptors_after": runs[-1]["descriptors_posted"],
        "pieces": runs[-1]["pieces"],
        "parts": runs[-1].get("parts", 0),
        **{f"{k}_median": v for k, v in med.items()},
        "total_s_min": min(r["total_s"] for r in runs),
        "total_s_max": max(r["total_s"] for r in runs),
        "gbps": runs[-1]["bytes"] / total / 1e9 if total > 0 else float("inf"),
        # the run whose total is the median: its phases add up, unlike per-phase medians
        "median_run": sorted(runs, key=lambda r: r["total_s"])[(len(runs) - 1) // 2],
        "verified": verified,
        "iters": runs,
    }


def _progress(total: int, quiet: bool) -> Any:
    """A tqdm bar when tqdm is installed, else a one-line counter on stderr."""
    if quiet:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="xfer", file=sys.stderr, leave=False)
    except ImportError:

        class _Line:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"\r{self.n}/{total} transfers", end="", file=sys.stderr, flush=True)

            def set_description(self, s: str) -> None:
                pass

            def close(self) -> None:
                print(file=sys.stderr)

        return _Line()


def transports(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The NIXL backend sets to compare: one per ``--nixl-backend``, else the agents' ``--nixl-backends``."""
    return [(b,) for b in args.nixl_backend] if args.nixl_backend else [tuple(args.nixl_backends)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (transport, pattern, plan) case, each transport in its own two fresh processes; return the report.

    Cases are interleaved round-robin (transports, patterns, plans, GIL modes), so that load from other
    processes on a shared host spreads over every case instead of biasing whichever ran then."""
    pool = 2.0 if args.pool_factor is None else args.pool_factor
    shape = Shape(args.tokens, args.layers, args.kv_heads, args.head_dim, args.dtype_bytes, args.block_size, pool)
    rng = np.random.default_rng(args.seed)
    patterns = {
        pat: (block_ids(pat, shape.blocks, shape.pool, rng), block_ids(pat, shape.blocks, shape.pool, rng))
        for pat in args.patterns
    }
    nets = transports(args)
    knobs = {"push_parts": args.push_parts, "min_part_bytes": args.min_part_bytes, "part_cost_us": args.part_cost_us}
    knobs |= {"ring_bytes": args.ring_bytes, "ring_slots": args.ring_slots, "peer_dead_s": args.peer_dead_s}
    modes = busy_gil.modes(args)
    # A lane: one transport in one kvpush tree (``--tree``: this checkout's engine against another's, side by side)
    lanes = [(tree, t) for tree in (args.tree or [None]) for t in nets]
    load_start = os.getloadavg()
    pairs = {
        (tree, t): (Proc("P", shape, args.seed, t, knobs, tree), Proc("D", shape, None, t, knobs, tree))
        for tree, t in lanes
    }
    kinds = [(plan, "") if plan == "per-block" else (plan, o) for plan in args.plans for o in args.orders]
    ms = modes or [None]
    cases = [(t, pat, kind, m) for t in lanes for pat in patterns for kind in dict.fromkeys(kinds) for m in ms]
    bar = _progress(len(cases) * (args.iters + args.warmup + 1), args.quiet)
    runs: dict[tuple[Any, str, tuple[str, str], Any], list[dict[str, Any]]] = {c: [] for c in cases}
    addrs: dict[tuple[Any, str], Any] = {}
    now: dict[Any, busy_gil.Mode] = {}  # each lane's GIL mode
    p_digests: dict[tuple[Any, str], str] = {}
    try:
        for p, d in pairs.values():
            p.recv(300.0)
            d.recv(300.0)
        for t, (p, d) in pairs.items():
            for plan in args.plans:
                addrs[t, plan] = p.call("start", plan)
                d_start = d.call("start", plan)
                if plan == "per-block":
                    d.send("pump", 1.0)
                    p.call("raw_peer", *d_start)
                    d.recv()
        for i in range(args.warmup + args.iters):
            for t, pat, kind, m in cases:
                p, d = pairs[t]
                sblocks, dblocks = patterns[pat]
                name = "-".join(x for x in (*kind, pat, m.label if m else "") if x)
                if bar is not None:
                    bar.set_description(f"{_lane(t)} {name}")
                busy_gil.switch((p, d), now, t, m)
                r = _one(p, d, kind, f"{name}-{i}", sblocks, dblocks, addrs[t, kind[0]])
                if i >= args.warmup:
                    runs[t, pat, kind, m].append(r)
                if bar is not None:
                    bar.update(1)
        # One more, unmeasured transfer per case into a zeroed cache, then
        # compare: a plan that is fast because it moved the wrong bytes fails.
        for t, pat, kind, m in cases:
            p, d = pairs[t]
            sblocks, dblocks = patterns[pat]
            busy_gil.switch((p, d), now, t, m)
            d.call("clear")
            name = "-".join(x for x in (*kind, pat, m.label if m else "") if x)
            _one(p, d, kind, f"{name}-verify", sblocks, dblocks, addrs[t, kind[0]])
            if (t, pat) not in p_digests:
                p_digests[t, pat] = p.call("digest", sblocks)
            if d.call("digest", dblocks) != p_digests[t, pat]:
                raise RuntimeError(f"{_lane(t)} {name}: D's bytes differ from P's after the transfer")
            if bar is not None:
                bar.update(1)
        for p, d in pairs.values():
            p.call("stop")
            d.call("stop")
    finally:
        if bar is not None:
            bar.close()
        for p, d in pairs.values():
            p.close()
            d.close()
    results = [
        {"nixl": _lane(t), **(m.fields() if m else {}), **_summary(pat, kind, runs[t, pat, kind, m], shape, True)}
        for t, pat, kind, m in cases
    ]
    order_ratios(results)
    return {
        "benchmark": "kvpush bench transfer",
        "command": " ".join(["kvpush bench transfer", *args.argv]),
        "shape": {**asdict(shape), "blocks": shape.blocks, "pool_blocks": shape.pool, "bytes": shape.request_bytes},
        "iters": args.iters,
        "warmup": args.warmup,
        "nixl_backends": list(dict.fromkeys(b for t in nets for b in t)),
        "transports": ["+".join(t) for t in nets],
        "trees": {_lane(lane): os.path.abspath(lane[0]) for lane in lanes if lane[0]},
        "push_parts": args.push_parts,
        "min_part_bytes": args.min_part_bytes,
        "ring_bytes": args.ring_bytes or transfer_plans.RING_BYTES,
        "peer_dead_s": args.peer_dead_s,
        "gil_modes": [m.label for m in modes or []],
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "nixl": _version("nixl"),
            "note": "P and D are two processes per transport on one host (loopback); NIXL progress thread off",
            # other work on the host skews every number: say how busy it was
            "loadavg_1m_start": load_start[0],
            "loadavg_1m_end": os.getloadavg()[0],
        },
        "time_unix": time.time(),
        "results": results,
    }


def _lane(lane: tuple[str | None, tuple[str, ...]]) -> str:
    """A lane's label: its transport, and the kvpush tree it runs when several are compared."""
    tree, t = lane
    return "+".join(t) + (f"@{Path(tree).resolve().name}" if tree else "")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def order_ratios(results: list[dict[str, Any]]) -> None:
    """Mark each ``finished`` case with its total over the ``ahead`` case of the same transport, pattern, plan
    and GIL mode."""
    ahead = {
        (r.get("nixl"), r["pattern"], r["plan"], r.get("gil")): r["total_s_median"]
        for r in results
        if r.get("order") == "ahead"
    }
    for r in results:
        key = (r.get("nixl"), r["pattern"], r["plan"], r.get("gil"))
        if r.get("order") == "finished" and ahead.get(key):
            r["x_ahead"] = r["total_s_median"] / ahead[key]
