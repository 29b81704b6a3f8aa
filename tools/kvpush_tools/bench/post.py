"""``kvpush bench post``: what P's post of a direct WRITE costs against its descriptor count, three ways.

One request's direct WRITE from P to D, two processes over real NIXL agents, for
descriptor counts (block x region pieces) from 1k to 128k, D's and P's blocks
``fragmented`` (random ids on each side: one descriptor per block and region)
or ``contiguous`` (one run on each side), posted

- ``per-request``: kvpush's WRITE built for the request (``plan.part_descriptors``
  and ``Agent.prepare_write``: NIXL's descriptor lists made and checked per WRITE);
- ``by-index``: kvpush's post by index into the prepared lists made once
  (``kvpush.core.indexed``: the part split, its indices, ``Agent.prepare_by_index``),
  taken whatever ``choose`` would (its choice, the way the engine posts, is reported);
- ``kvpush`` (not by default): what the engine does, whichever of today's, the
  strips' or by index ``choose`` picks (``kvpush.engine.by_index.build_direct``);
- ``vllm``: the way vLLM's NixlPushConnector posts the same blocks, written again
  here from reading its source: a prepared list per side with one entry per block of
  each of its KV regions (a layer's K and V apart, or one K|V region a layer for a
  blocks-first cache), made once, and per request the entries' ids
  (region offset + block id, region by region) to ``make_prepped_xfer`` and
  ``transfer``.

The same full-block request goes each way (no partial block: every way moves the
same bytes, and a partial block cannot be named by index). P's *post* is the time
from the request's blocks known (the plan made) to the post call's return: what
the way builds per request, plus the call; the *WRITE* runs on to NIXL's DONE on
P. The ways take turns in a new order at every point, the points in a new order
every round; the first measured round of each point and way is verified (D's
destination zeroed first; once the WRITE's notification reached D, which is when
its bytes are in place, each block's weighted byte sums on D compared with P's).
Per way and pattern the per-descriptor slope of the post is fitted (least squares
on the medians, and once per round for its spread).

``--device cuda`` puts both caches in GPU memory (torch tensors, VRAM
registrations; P on GPU 0, D on GPU 1 when there are two), UCX only. Needs only
torch, NIXL and kvpush; without matplotlib the PNG is skipped (``--plot-only
FILE.json`` draws it later on a host that has it).

JSON and a PNG in ``--out``; a table on stdout. This module is the command (options, table, figure); the
caches and requests are :mod:`~kvpush_tools.bench.post_shape`'s, the processes
:mod:`~kvpush_tools.bench.post_side`'s, the run :mod:`~kvpush_tools.bench.post_run`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpush_tools.bench.post_run import cuda_missing, run
from kvpush_tools.bench.post_shape import KV, PATTERNS

WAYS = ("per-request", "by-index", "vllm", "kvpush")
COUNTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def table(report: dict[str, Any]) -> str:
    out = []
    for backend, res in report["backends"].items():
        out.append(
            f"\n{backend}: P's post (ms, median [p25, p75]; of which built for the request) and the whole WRITE (ms)"
        )
        out.append(
            f"{'descriptors':>11} {'pattern':>10} {'way':>11} {'post':>26} {'built':>7} {'WRITE':>9} {'named':>7} ok"
        )
        for r in res["rows"]:
            p, w = r["post_s_ms"], r["write_s_ms"]
            named = {  # rows or entries P hands NIXL (NIXL merges consecutive entries of a dense list)
                "per-request": r["per_request_descriptors"],
                "by-index": r["by_index_indices"],
                "vllm": r["vllm_indices"],
                "kvpush": r["kvpush_chooses"],
            }[r["way"]]
            out.append(
                f"{r['descriptors']:>11} {r['pattern']:>10} {r['way']:>11} "
                f"{p['median']:>9.3f} [{p['p25']:>6.3f}, {p['p75']:>6.3f}] {r['build_s_ms']['median']:>7.3f} "
                f"{w['median']:>9.3f} {named:>7} "
                f"{'yes' if r['verified'] else 'NO'}"
            )
        out.append(f"{backend}: per-descriptor slope of P's post, us (least squares on medians; rounds min..max)")
        for f in res["fits"]:
            rounds = f["post_us_per_descriptor_rounds"]
            spread = f"{min(rounds):.3f}..{max(rounds):.3f}" if rounds else "-"
            out.append(
                f"  {f['pattern']:>10} {f['way']:>11}: {f['post_us_per_descriptor']:.3f} us/desc "
                f"(intercept {f['post_intercept_ms']:.3f} ms; rounds {spread}); "
                f"built {f['build_us_per_descriptor']:.3f}, WRITE {f['write_us_per_descriptor']:.3f} us/desc"
            )
        lists = res["lists"]
        out.append(
            f"{backend}: lists prepared once: kvpush own {1e3 * lists['kvpush_local_s']:.1f} ms, D's "
            f"{1e3 * lists['kvpush_remote_s']:.1f} ms (strided: {lists['strided_lists']}); vLLM's "
            f"{1e3 * lists['vllm_local_s']:.1f} / {1e3 * lists['vllm_remote_s']:.1f} ms"
        )
    return "\n".join(out)


COLORS = {"per-request": "#0072b2", "by-index": "#d55e00", "vllm": "#009e73", "kvpush": "#cc79a7"}
MARKERS = {"UCX": "o", "LIBFABRIC": "s"}


def plot(report: dict[str, Any], path: Path) -> bool:
    """Post and WRITE time against descriptors, log-log, one column per pattern; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pats = list(dict.fromkeys(r["pattern"] for res in report["backends"].values() for r in res["rows"]))
    fig, axes = plt.subplots(2, len(pats), figsize=(6 * len(pats), 8), squeeze=False)
    for backend, res in report["backends"].items():
        for j, pat in enumerate(pats):
            for way in WAYS:
                rows = [r for r in res["rows"] if r["pattern"] == pat and r["way"] == way]
                if not rows:
                    continue
                xs = [r["descriptors"] for r in rows]
                for i, key in enumerate(("post_s_ms", "write_s_ms")):
                    ax = axes[i][j]
                    med = [r[key]["median"] for r in rows]
                    err = [[m - r[key]["p25"] for m, r in zip(med, rows, strict=True)]]
                    err.append([r[key]["p75"] - m for m, r in zip(med, rows, strict=True)])
                    fit = next(f for f in res["fits"] if f["pattern"] == pat and f["way"] == way)
                    slope = fit[f"{key.removesuffix('_s_ms')}_us_per_descriptor"]
                    ax.errorbar(
                        xs,
                        med,
                        yerr=err,
                        color=COLORS[way],
                        marker=MARKERS.get(backend, "^"),
                        ms=4,
                        lw=1,
                        capsize=2,
                        ls="-" if backend == "UCX" else "--",
                        label=f"{backend} {way} ({slope:.2f} us/desc)",
                    )
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_title(f"{pat}: P's {'post' if i == 0 else 'WRITE (post to DONE)'}", fontsize=9)
                    ax.set_xlabel("descriptors (blocks x regions)")
                    ax.set_ylabel("ms (median, p25-p75)")
                    ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        for ax in row:
            ax.legend(fontsize=7)
    sh, h = report["shape"], report.get("host", {})
    fig.suptitle(
        f"kvpush bench post: {sh['regions']} regions ({sh['kv']}), {sh['block_bytes']} B blocks, "
        f"{report['device']}, NIXL {h.get('nixl', '?')}, tree {report['tree']}; medians of {report['iters']} "
        f"rounds, load {report['loadavg_start'][0]:.1f} -> {report['loadavg_end'][0]:.1f} on {h.get('cpus')} CPUs",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _choice(kind: tuple[str, ...]) -> Any:
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in kind]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(kind)} (got {s!r})")
        return items

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpush bench post", description=__doc__.split("\n")[0].split(": ", 1)[1])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both caches live")
    ap.add_argument(
        "--backends",
        type=_choice(("UCX", "LIBFABRIC")),
        default=None,
        help="NIXL backends, each in its own processes (default UCX; LIBFABRIC reads KVPUSH_LIBFABRIC_PREFIX or "
        "LD_LIBRARY_PATH: tools/libfabric/setup.sh)",
    )
    ap.add_argument("--counts", type=_ints, default=list(COUNTS), help="descriptor counts (blocks x regions)")
    ap.add_argument("--patterns", type=_choice(PATTERNS), default=list(PATTERNS))
    ap.add_argument("--ways", type=_choice(WAYS), default=list(WAYS[:3]), help="(default: all but kvpush)")
    ap.add_argument(
        "--kv",
        type=_choice(KV),
        default=["split"],
        help="a layer's K and V apart, blocks first (K|V), or both in turn (split,blocks-first)",
    )
    ap.add_argument("--regions", type=int, default=128, help="KV regions, layers x K/V (Qwen3-32B: 128)")
    ap.add_argument(
        "--block-bytes", type=int, default=None, help="bytes of one block of one region (default: 4096 cuda, 256 cpu)"
    )
    ap.add_argument(
        "--d-poll-us",
        type=float,
        default=50.0,
        help="D progresses its agent this often (a D engine's busy poll; 0: spins against P for the CPU)",
    )
    ap.add_argument("--iters", type=int, default=5, help="measured rounds (medians reported)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/bench_post"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--plot-only", type=Path, default=None, metavar="JSON", help="draw a report's PNG and stop")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpush bench post``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.plot_only is not None:
        report = json.loads(args.plot_only.read_text())
        png = args.plot_only.with_suffix(".png")
        if not plot(report, png):
            print("matplotlib is not importable: no plot", file=sys.stderr)
            return 2
        print(f"wrote {png}")
        return 0
    args.argv = argv
    args.backends = args.backends or ["UCX"]
    args.block_bytes = args.block_bytes or (4096 if args.device == "cuda" else 256)
    bad = [n for n in args.counts if n % args.regions or n < args.regions]
    if bad or args.iters < 1:
        print(f"--counts must be multiples of --regions ({args.regions}): {bad}; --iters >= 1")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    kvs = args.kv
    if args.device == "cuda":
        why = cuda_missing()
        if why:
            msg = f"--device cuda: {why}; nothing measured (run --device cpu here, or on a GPU host)"
            error = {"error": msg, "command": "kvpush bench post " + " ".join(argv)}
            for kv in kvs:
                (args.out / f"post_cuda_{kv}.json").write_text(json.dumps(error))
            print(msg, file=sys.stderr)
            return 2
        if "LIBFABRIC" in args.backends:
            print("--device cuda runs over UCX only (LIBFABRIC over tcp registers no GPU memory)", file=sys.stderr)
            return 2
    bad = []
    for kv in kvs:  # each layout in its own processes, one after the other
        args.kv = kv
        stem = args.out / f"post_{args.device}_{kv}"
        report = run(args)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        print(f"\n=== {kv} ===\n{table(report)}")
        bad += [
            (kv, b, r["descriptors"], r["pattern"], r["way"])
            for b, res in report["backends"].items()
            for r in res["rows"]
            if not r["verified"]
        ]
        print(f"\nwrote {stem.with_suffix('.json')}", end="")
        if not args.no_plot:
            drawn = plot(report, stem.with_suffix(".png"))
            print(
                f", {stem.with_suffix('.png')}" if drawn else " (no matplotlib: no plot; --plot-only draws it)", end=""
            )
        print()
    if bad:
        print(f"NOT VERIFIED (D's bytes differ from P's): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
