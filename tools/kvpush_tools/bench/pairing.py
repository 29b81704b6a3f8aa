"""``kvpush bench pairing``: P's work between D's registration and its first pack, per kvpush tree.

When P finishes first (a sequential router), D's registration pairs with a
parked prefill and P plans on the request's critical path. This measures
that planning alone, for one request of many small pieces, in one process
per kvpush tree (``--tree PATH``, repeatable: e.g. this checkout and main),
the trees taking turns round by round:

- ``plan``: ``build_plan`` of a staged push as pairing calls it, with the
  pack list built ahead when the tree builds one at hand-over
  (``kvpush.core.payload``), else building it;
- ``plan_no_ahead``: the same plan building the pack list itself (a
  registration the list built ahead does not fit);
- ``pack_ahead``: building the list at hand-over (off the path).

Block ids are tuples of ints, as the engine holds them (``--plan auto``: the
cost model chooses, as by default; ``staged``: forced).

No NIXL, no copies: the layouts describe zero-filled host caches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_WORKER = r"""
import json, sys, time
import numpy as np
import kvpush
from kvpush.backends.base import CacheSpec
from kvpush.backends.host import HostBackend
from kvpush.config import Config
from kvpush.core.layout import heads_overlap
from kvpush.core.plan import build_plan, staged_bytes
try:
    from kvpush.core.payload import pack_pieces
except ImportError:
    pack_pieces = None
tokens, layers, bs, hd, seed = (int(x) for x in sys.argv[1:6])
mode = sys.argv[6]
blocks = -(-tokens // bs)
pool = 2 * blocks
spec = CacheSpec(bs, 1, hd, "bfloat16")
arr = np.zeros((layers, 2, pool, bs, 1, hd), dtype=np.uint8)
be = HostBackend()
lay = be.describe({f"layer{i}": arr[i] for i in range(layers)}, spec)
rng = np.random.default_rng(seed)
# Block ids as the engine holds them: tuples of ints (the prefill's, and the Register's off the wire).
sb, db = (tuple(int(b) for b in rng.permutation(pool)[:blocks]) for _ in range(2))
try:  # a tree whose pack list at hand-over keeps P's block ids as an array plans from that array
    from kvpush.prefill.transfer import PackAhead
    keeps_array = "blocks" in PackAhead.__dataclass_fields__
except ImportError:
    keeps_array = False
cfg = Config.of(plan=mode, staging_bytes=1)
nbytes = staged_bytes(lay, lay, tokens, 0)
kw = dict(staging_local=(1 << 40, 0), staging_remote=(1 << 41, nbytes, 0))
print(json.dumps({"kvpush": kvpush.__file__, "protocol": kvpush.PROTOCOL_VERSION, "ahead": pack_pieces is not None}))
sys.stdout.flush()
for line in sys.stdin:
    out = {}
    if pack_pieces is not None:
        t0 = time.perf_counter()
        src = np.asarray(sb, dtype=np.int64) if keeps_array else sb
        pack = pack_pieces(lay, heads_overlap(lay, lay), src, tokens, 0)
        out["pack_ahead_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = build_plan(cfg, lay, lay, sb, db, tokens, 0, **kw)
    out["plan_no_ahead_s"] = time.perf_counter() - t0
    if pack_pieces is not None:
        t0 = time.perf_counter()
        plan = build_plan(cfg, lay, lay, src, db, tokens, 0, pack=pack, **kw)
        out["plan_s"] = time.perf_counter() - t0
    else:
        out["plan_s"] = out["plan_no_ahead_s"]
    out["kind"], out["pieces"] = str(plan.kind), int(plan.pieces)
    print(json.dumps(out))
    sys.stdout.flush()
"""

KEYS = ("plan_s", "plan_no_ahead_s", "pack_ahead_s")


def _start(tree: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [str(a) for a in (args.tokens, args.layers, args.block_size, args.head_dim * 2, args.seed, args.plan)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tree,  # ``python -c`` puts the working directory first on sys.path
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start one worker per tree, then let them measure one round each in turn."""
    workers = [(tree, *_start(tree, args)) for tree in args.tree]
    samples: dict[str, list[dict[str, Any]]] = {str(t): [] for t in args.tree}
    load0 = os.getloadavg()[0]
    try:
        for i in range(args.warmup + args.rounds):
            for tree, proc, _ in workers if i % 2 else workers[::-1]:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                got = json.loads(proc.stdout.readline())
                if i >= args.warmup:
                    samples[str(tree)].append(got)
    finally:
        for _, proc, _ in workers:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=30)
    rows = []
    for tree, _, info in workers:
        got = samples[str(tree)]
        row: dict[str, Any] = {"tree": str(tree), **info, "pieces": got[0]["pieces"], "plan_kind": got[0]["kind"]}
        for k in KEYS:
            vals = [g[k] for g in got if k in g]
            if vals:
                row[f"{k}_median"] = statistics.median(vals)
                row[k] = vals
        rows.append(row)
    return {
        "benchmark": "kvpush bench pairing",
        "command": "kvpush bench pairing " + " ".join(args.argv),
        "plan_setting": args.plan,
        "shape": {"tokens": args.tokens, "layers": args.layers, "block_size": args.block_size, "kv_heads": 1},
        "rounds": args.rounds,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m": [load0, os.getloadavg()[0]],
        },
        "time_unix": time.time(),
        "results": rows,
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"{'tree':<40} {'proto':>5} {'pieces':>7} {'plan ms':>8} {'no-ahead ms':>11} {'hand-over ms':>12}"]
    for r in report["results"]:
        ms = [f"{1e3 * r[k + '_median']:.2f}" if k + "_median" in r else "-" for k in KEYS]
        lines.append(f"{r['tree']:<40} {r['protocol']:>5} {r['pieces']:>7} {ms[0]:>8} {ms[1]:>11} {ms[2]:>12}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(KEYS)
    labels = ["plan at pairing", "plan, list built at pairing", "list at hand-over (off the path)"]
    for j, (k, label) in enumerate(zip(KEYS, labels, strict=True)):
        xs = [i + (j - 1) * width for i in range(len(rows))]
        ax.bar(xs, [1e3 * r.get(k + "_median", 0.0) for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [f"{Path(r['kvpush']).parent.parent.name} (v{r['protocol']})" for r in rows])
    s = report["shape"]
    ax.set_title(
        f"P's planning for one staged request: {s['tokens']} tokens x {s['layers']} layers x K/V, "
        f"{rows[0]['pieces']} pieces",
        fontsize=9,
    )
    ax.set_ylabel(f"median of {report['rounds']} rounds, ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpush bench pairing``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="kvpush bench pairing", description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, action="append", default=[], help="a kvpush checkout (repeatable)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128, help="bf16 elements per head")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan", choices=("staged", "auto"), default="staged", help="the plan setting (auto: cost model)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_pairing"))
    args = ap.parse_args(argv)
    args.argv = argv
    if not args.tree:
        args.tree = [Path(__file__).resolve().parents[3]]
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pairing.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "pairing.png")
    print(table(report))
    print(f"wrote {args.out / 'pairing.json'} and {args.out / 'pairing.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
