"""The run of ``kvpush bench post``: every (NIXL backend, layout, pattern, count, way) point in turn, the ways
in a new order at every point and the points in a new order every round, the first measured round of each
verified on D; the per-descriptor slopes fitted; the report with the tree and host it ran on."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kvpush_tools.bench.post_shape import Shape, block_ids
from kvpush_tools.bench.post_side import Proc

LIBFABRIC_PREFIX_ENV = "KVPUSH_LIBFABRIC_PREFIX"


def _libfabric_env() -> None:
    """Put the LIBFABRIC libraries ``tools/libfabric/setup.sh`` built first on ``LD_LIBRARY_PATH`` for the
    workers (a spawned interpreter reads it at start), where ``KVPUSH_LIBFABRIC_PREFIX`` names them."""
    prefix = os.environ.get(LIBFABRIC_PREFIX_ENV)
    if not prefix:
        return
    try:
        dirs = json.loads((Path(prefix) / "kvpush-libfabric.json").read_text()).get("library_path", [])
    except (OSError, ValueError):
        return
    old = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*[d for d in dirs if d not in old], *old])


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ``ys`` over ``xs``."""
    if len(xs) < 2:
        return float("nan"), float("nan")
    slope, icpt = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(slope), float(icpt)


def _stats(v: list[float]) -> dict[str, float]:
    q = np.percentile(v, [25, 50, 75]) if v else [float("nan")] * 3
    return {"median": float(q[1]), "p25": float(q[0]), "p75": float(q[2]), "min": min(v), "max": max(v)}


def _tree() -> str:
    """The kvpush checkout's commit (``+dirty`` with tracked files changed), or ``unknown``."""
    import kvpush

    here = Path(kvpush.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(  # results written into the checkout are not a change of the tree
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _host(device: str) -> dict[str, Any]:
    from kvpush.transport.nixl_agent import nixl_version

    out: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "nixl": nixl_version(),
    }
    if device == "cuda":
        import torch

        out["torch"] = torch.__version__
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def cuda_missing() -> str:
    """Why ``--device cuda`` cannot run here, or empty where it can."""
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every backend in its own pair of worker processes; points and ways taking turns; the report."""
    shape = Shape(args.regions, 2 * max(args.counts) // args.regions, args.block_bytes, args.kv)
    rng = np.random.default_rng(args.seed)
    points = [
        (n, pat, block_ids(pat, n // args.regions, shape.pool, rng), block_ids(pat, n // args.regions, shape.pool, rng))
        for n in args.counts
        for pat in args.patterns
    ]
    report: dict[str, Any] = {
        "command": "kvpush bench post " + " ".join(args.argv),
        "tree": _tree(),
        "shape": {**asdict(shape), "mib": shape.nbytes / 2**20},
        "device": args.device,
        "iters": args.iters,
        "warmup": args.warmup,
        "d_poll_us": args.d_poll_us,
        "loadavg_start": list(os.getloadavg()),
        "backends": {},
    }
    if "LIBFABRIC" in args.backends:
        _libfabric_env()
    for backend in args.backends:
        poll_s = args.d_poll_us * 1e-6
        p = Proc("P", shape, backend, args.device, args.seed, poll_s)
        d = Proc("D", shape, backend, args.device, args.seed, poll_s)
        try:
            d_meta, d_layout = d.recv()
            p.recv()
            prep = p.call("setup", d_meta, d_layout)
            samples: dict[tuple[int, str, str], list[dict[str, float]]] = {}
            info: dict[tuple[int, str], dict[str, Any]] = {}
            verified: dict[tuple[int, str, str], bool] = {}
            rounds = args.warmup + args.iters
            t_start = time.monotonic()
            for it in range(rounds):
                order = rng.permutation(len(points))
                for k, pi in enumerate(order):
                    n, pat, src, dst = points[pi]
                    info[n, pat] = p.call("point", src, dst, src.size * shape.block_size)
                    ways = list(args.ways)
                    shift = (it + k) % len(ways)
                    for way in ways[shift:] + ways[:shift]:
                        check = it == args.warmup
                        if check:
                            d.call("zero")
                        tag = f"{way}:{n}:{pat}:{it}".encode()
                        m = p.call("measure", way, tag)
                        if check:
                            verified[n, pat, way] = p.call("sums", src) == d.call("sums", dst, tag)
                        if it >= args.warmup:
                            samples.setdefault((n, pat, way), []).append(m)
                if not args.quiet:
                    print(f"{backend}: round {it + 1}/{rounds} ({time.monotonic() - t_start:.0f}s)", file=sys.stderr)
            host = _host(args.device) if not report.get("host") else report["host"]
            report["host"] = host
            report["backends"][backend] = _summarise(samples, info, verified, prep, args)
        finally:
            p.close()
            d.close()
    report["loadavg_end"] = list(os.getloadavg())
    return report


def _summarise(
    samples: dict[tuple[int, str, str], list[dict[str, float]]],
    info: dict[tuple[int, str], dict[str, Any]],
    verified: dict[tuple[int, str, str], bool],
    prep: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    rows, fits = [], []
    for (n, pat, way), ms in sorted(samples.items()):
        rows.append(
            {
                "descriptors": n,
                "pattern": pat,
                "way": way,
                "verified": verified.get((n, pat, way), False),
                **{f"{k}_ms": _stats([1e3 * m[k] for m in ms]) for k in ("build_s", "post_s", "write_s")},
                **info[n, pat],
            }
        )
    for pat in args.patterns:
        for way in args.ways:
            pts = [(n, samples[n, pat, way]) for n in args.counts if (n, pat, way) in samples]
            fit: dict[str, Any] = {"pattern": pat, "way": way}
            for key in ("build_s", "post_s", "write_s"):
                xs = [float(n) for n, _ in pts]
                slope, icpt = _fit(xs, [statistics.median(m[key] for m in ms) for _, ms in pts])
                per_round = [_fit(xs, [ms[i][key] for _, ms in pts])[0] for i in range(min(len(ms) for _, ms in pts))]
                name = key.removesuffix("_s")
                fit[f"{name}_us_per_descriptor"] = slope * 1e6
                fit[f"{name}_intercept_ms"] = icpt * 1e3
                fit[f"{name}_us_per_descriptor_rounds"] = [s * 1e6 for s in per_round]
            fits.append(fit)
    return {"lists": prep, "rows": rows, "fits": fits}
