"""Two kvpush trees side by side from one ``kvpush bench transfer --tree A --tree B`` JSON.

Per cell (pattern, plan, order): each tree's median total and quartiles over
the iterations, and the ratio of the medians (second tree over first); at the
end the geometric mean of the ratios. A tree given twice (``--tree A --tree B
--tree B --tree A``, to even out position) has its lanes merged under one label.
``--metric`` compares another per-transfer figure of the report (``p_cpu_s``,
``d_cpu_s``: the CPU time of P's and D's engine threads per transfer).

    python -m kvpush_tools.bench.ab_trees results/bench_transfer/transfer_16384tok.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def table(path: Path, metric: str = "total_s") -> list[str]:
    """The lines of the comparison of ``metric`` for one JSON."""
    d = json.loads(path.read_text())
    rows = d["results"]
    trees = sorted({r["nixl"] for r in rows})
    if len(trees) != 2:
        raise SystemExit(f"{path}: {len(trees)} lanes ({trees}); two trees are compared")
    by = {(r["nixl"], r["pattern"], r["plan"], r["order"]): r for r in rows}
    cells = sorted({(r["pattern"], r["plan"], r["order"]) for r in rows})
    what = "total" if metric == "total_s" else metric.removesuffix("_s")
    out, ratios = [f"{path.name}: {trees[1]} over {trees[0]}, {what} ms median [quartiles]"], []
    for c in cells:
        q = [np.percentile([i[metric] * 1e3 for i in by[(t, *c)]["iters"]], [25, 50, 75]) for t in trees]
        ratios.append(q[1][1] / q[0][1])
        cols = "  ".join(
            f"{t.split('@')[-1]:8s} {a[1]:7.1f} [{a[0]:6.1f},{a[2]:6.1f}]" for t, a in zip(trees, q, strict=True)
        )
        out.append(f"{'/'.join(c):34s} {cols}  ratio {ratios[-1]:.2f}")
    out.append(f"geometric mean of the ratios: {float(np.exp(np.mean(np.log(ratios)))):.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush_tools.bench.ab_trees", description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", type=Path, help="transfer_<tokens>tok.json of a --tree run")
    ap.add_argument("--metric", action="append", default=[], help="total_s (default), p_cpu_s, d_cpu_s (repeatable)")
    args = ap.parse_args(argv)
    for path in args.json:
        for metric in args.metric or ["total_s"]:
            print("\n".join(table(path, metric)), end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
