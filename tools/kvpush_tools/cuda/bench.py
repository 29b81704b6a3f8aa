"""GPU push benchmark: one fragmented request P (GPU0) -> D (GPU1) over real NIXL agents.

Why it exists: a KV layout of ~131k small pieces costs a NIXL descriptor each
(~7 us to post), so the naive push of a 16k-token request takes a second
while the link moves the bytes in ~1.4 ms. This measures, in one run and for
the same bytes:

- ``peer_copy``: a plain ``tensor.copy_`` GPU0 -> GPU1 (the link's limit);
- ``per_block``: one NIXL descriptor per block-layer (the naive push);
- ``coalesced``: ``map_pieces`` + ``coalesce`` + ``descriptors`` + ``merge_descriptors``;
- ``staged``: pack on P (Triton gather) -> one WRITE into D's registered
  staging buffer -> unpack on D (Triton scatter), as the engine does today
  (NIXL descriptors built per WRITE, piece table uploaded by the first pack);
- ``staged_prepped``: the same with NIXL lists prepared once per peer
  (``prep_xfer_dlist``), the WRITE handle made once and re-posted, and the
  piece tables uploaded while planning (P) and registering (D), i.e. off the
  critical path;
- ``pipelined:N`` / ``pipelined:1-6-1``: staged_prepped in N equal chunks of
  regions (or chunks sized by weight: a small first chunk starts the WRITE
  sooner, a small last one shortens D's final unpack), so packing chunk i+1
  and unpacking chunk i overlap the WRITE of the others;
- ``engine``: the same request through ``kvpush.engine`` Sender/Receiver with
  the CUDA backend (the plan chosen by the core's cost model);

for destination block ids that are shuffled, in runs of 16, and contiguous.
Every transfer is checked byte for byte on D with ``torch.equal`` (and every
block D did not register must still hold the poison byte). Times are wall
clock from "KV ready on P" to "KV in place on D" (CLOCK_MONOTONIC is shared by
both processes), medians over ``--iters``; strategies that post >20k
descriptors run ``--slow-iters`` times (1 by default: ~1 s each). Before each
timed run both GPUs copy memory for ``--warm-ms`` so that clocks are up, as
they are right after a prefill (P) or during decoding (D); a strategy name
ending in ``_cold`` skips that.

Run (2 GPUs): ``python examples/bench_cuda_push.py --json results.json``.
``--backend host --quick`` runs the same code on CPU memory (a dry run).

This module runs the two processes and writes the results; what a run measures is
:mod:`~kvpush_tools.cuda.options`', a process's cache and agent :mod:`~kvpush_tools.cuda.side`'s, D's side
:mod:`~kvpush_tools.cuda.d_server`'s, P's :mod:`~kvpush_tools.cuda.p_driver` (strategies, floors),
:mod:`~kvpush_tools.cuda.p_engine` (the engine) and :mod:`~kvpush_tools.cuda.p_layerwise` (layer-wise), the
report :mod:`~kvpush_tools.cuda.report`'s.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any

from kvpush_tools.bench import stages
from kvpush_tools.cuda.d_server import DServer
from kvpush_tools.cuda.options import Options, parse
from kvpush_tools.cuda.p_layerwise import LayerwiseDriver
from kvpush_tools.cuda.report import plot, plot_layerwise, summarize, timeline_rows
from kvpush_tools.cuda.side import Side, log_line


def _env(side: Side) -> dict[str, Any]:
    import kvpush

    torch = side.torch
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    # which kvpush ran (a run comparing two trees points PYTHONPATH at each in turn)
    env["kvpush"] = {"path": os.path.dirname(kvpush.__file__), "protocol": kvpush.PROTOCOL_VERSION}
    try:
        from importlib.metadata import version

        env["nixl"] = version("nixl")
    except Exception:
        env["nixl"] = "?"
    if side.cuda:
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["kernel"] = side.backend.kernel
    return env


def _profile_engine_threads(out_dir: str) -> None:
    """cProfile every kvpush engine thread of this process into ``out_dir/<engine name>.prof`` (the
    ``KVPUSH_BENCH_PROFILE`` variable: where P's and D's Python time goes, not how long it takes)."""
    import cProfile

    from kvpush.engine.loop import EngineLoop

    run = EngineLoop._run

    def profiled(self: EngineLoop) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()
            os.makedirs(out_dir, exist_ok=True)
            prof.dump_stats(os.path.join(out_dir, f"{self.name}.{os.getpid()}.prof"))

    EngineLoop._run = profiled  # type: ignore[method-assign]


def worker(role: str, opts: Options, conn: Any, results: Any) -> None:
    """Entry point of the P or D process (spawned)."""
    logging.basicConfig(level=logging.WARNING, format=f"[{role}] %(levelname)s %(name)s: %(message)s")
    if os.environ.get("KVPUSH_BENCH_PROFILE"):
        _profile_engine_threads(os.environ["KVPUSH_BENCH_PROFILE"])
    try:
        side = Side(role, opts)
        if role == "D":
            DServer(side, conn).serve()
            results.put((role, {}))
            return
        p = LayerwiseDriver(side, conn)
        p.connect()
        log_line(f"P and D connected; request {opts.total_bytes >> 20} MiB, layout order {side.layout.order}")
        k = p.raw_writes()
        p.run_cases(k)
        micro = p.microbench()
        eng: list[dict[str, Any]] = []
        eng_error = ""
        lw: list[dict[str, Any]] = []
        if opts.engine:
            try:
                eng = p.engine()
            except Exception:
                eng_error = traceback.format_exc()
                log_line(f"engine phase failed:\n{eng_error}")
        if opts.lw_tokens:
            try:
                lw = p.layerwise()
            except Exception:
                eng_error += traceback.format_exc()
                log_line(f"layer-wise phase failed:\n{eng_error}")
        conn.send(("stop",))
        results.put(
            (
                role,
                {
                    "env": _env(side),
                    "raw_write": p.raw,
                    "staged_write_descriptors": k,
                    "cases": [{**asdict(c), "median_ms": c.median_ms} for c in p.cases],
                    "engine": eng,
                    "engine_error": eng_error,
                    "layerwise": lw,
                    "micro": micro,
                },
            )
        )
    except BaseException:
        tb = traceback.format_exc()
        try:
            conn.send(("error", tb))
        except Exception:
            pass
        results.put((role, {"error": tb}))


def main(argv: list[str] | None = None) -> int:
    from kvpush_tools.demo.servers import export_temp_keys

    opts, a = parse(argv, __doc__ or "")
    import kvpush

    log_line(f"options: {opts}")
    log_line(f"kvpush from {os.path.dirname(kvpush.__file__)}, protocol v{kvpush.PROTOCOL_VERSION}")
    export_temp_keys()  # P's and D's engines authenticate (the spawned processes inherit the variable)
    ctx = mp.get_context("spawn")
    p_conn, d_conn = ctx.Pipe()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=("D", opts, d_conn, results), daemon=True),
        ctx.Process(target=worker, args=("P", opts, p_conn, results), daemon=True),
    ]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 900
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            role, val = results.get(timeout=5)
        except Exception:
            if not all(p.is_alive() for p in procs) and results.empty():
                time.sleep(1)
                if results.empty():
                    break
            continue
        got[role] = val
        if "error" in val:
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = {r: v["error"] for r, v in got.items() if "error" in v}
    if errors or "P" not in got:
        for r, tb in errors.items():
            print(f"--- {r} failed:\n{tb}", file=sys.stderr)
        if not errors:
            print("--- no result from P (crashed?)", file=sys.stderr)
        return 1
    res = {"config": {**asdict(opts), "total_bytes": opts.total_bytes, "block_bytes": opts.block_bytes}}
    res.update(got["P"])
    summarize(opts, res)
    print("\n".join(res["table"]), flush=True)
    rows = timeline_rows(res)
    for label, marks in rows:
        print("\n".join(stages.lines(label, marks)), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if a.plot:
        plot(res, a.plot)
        base, ext = os.path.splitext(a.plot)
        if rows:
            stages.plot(rows, f"{base}_timeline{ext or '.png'}", "kvpush engine on the GPU: stages (median ms)")
        if res.get("layerwise"):
            plot_layerwise(res, f"{base}_layerwise{ext or '.png'}")
    bad = [c for c in res["cases"] if not c["verified"]] + [e for e in res["engine"] if not e["verified"]]
    bad += [r for r in res.get("layerwise") or [] if not r["verified"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
