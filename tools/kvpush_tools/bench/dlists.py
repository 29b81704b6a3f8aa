"""``python -m kvpush_tools.bench.dlists``: what building a direct WRITE costs, per WRITE or from prepared lists.

A direct push's WRITE names one descriptor per coalesced run of blocks per
region. The engine builds those descriptors for each WRITE (``get_xfer_descs``
and ``initialize_xfer``); NIXL 1.5 can instead prepare, once per peer, a
*strided* list over every block of every region (one N x 5 row per region:
address, block bytes, device, block stride, block count) and make a WRITE
from it by block index (``make_prepped_xfer``, which merges adjacent entries
back into runs). This measures both ways on one request shape, for contiguous
blocks (one run per region), runs of 16 blocks and shuffled blocks: the build
(host work, on the path from "D registered" to the post when D registers
late), then the post and completion of the WRITE it made, between two agents
of one process (UCX). ``--mem VRAM`` puts both caches on GPU 0 (torch).

JSON on stdout (or ``--json``): medians in ms per (pattern, way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np


def _alloc(mem: str, nbytes: int) -> tuple[Any, int, int]:
    """(keep-alive object, address, device id) of ``nbytes`` zeroed bytes in ``mem``."""
    if mem == "VRAM":
        import torch

        t = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        return t, t.data_ptr(), 0
    a = np.zeros(nbytes, dtype=np.uint8)
    return a, a.ctypes.data, 0


def _blocks(pattern: str, nblocks: int, rng: np.random.Generator) -> np.ndarray:
    if pattern == "contiguous":
        return np.arange(nblocks)
    if pattern == "runs16":
        starts = rng.permutation(nblocks // 16) * 16
        return (starts[:, None] + np.arange(16)[None, :]).ravel()
    return rng.permutation(nblocks)


def _runs(blocks: np.ndarray) -> list[tuple[int, int]]:
    """(first block, length) of each run of consecutive block ids, in request order."""
    out: list[tuple[int, int]] = []
    for b in blocks.tolist():
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("dl-A", cfg), nixl_agent("dl-B", cfg)
    regions, nblocks, bb = args.regions, args.blocks, args.block_bytes
    size = regions * nblocks * bb
    keep_s, src, dev = _alloc(args.mem, size)
    keep_d, dst, _ = _alloc(args.mem, size)
    a.register_memory(a.get_reg_descs([(src, size, dev, "")], args.mem))
    b.register_memory(b.get_reg_descs([(dst, size, dev, "")], args.mem))
    a.add_remote_agent(b.get_agent_metadata())

    def strided(base: int) -> np.ndarray:
        rows = np.zeros((regions, 5), dtype=np.int64)
        rows[:, 0] = base + np.arange(regions) * nblocks * bb
        rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = bb, dev, bb, nblocks
        return rows

    t0 = time.perf_counter()
    lists = (
        a.prep_xfer_dlist("NIXL_INIT_AGENT", strided(src), args.mem),
        a.prep_xfer_dlist("dl-B", strided(dst), args.mem),
    )
    prep_ms = (time.perf_counter() - t0) * 1e3

    def wait(h: Any) -> None:
        while a.check_xfer_state(h) == "PROC":
            pass

    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        "mem": args.mem,
        "regions": regions,
        "blocks": nblocks,
        "block_bytes": bb,
        "prep_lists_ms": prep_ms,
    }
    for pattern in args.patterns.split(","):
        dblocks = _blocks(pattern, nblocks, rng)
        sblocks = np.arange(nblocks)  # P's blocks contiguous, D's as the pattern says
        runs = _runs(dblocks)
        # per WRITE: one descriptor per run per region, P's side following D's runs
        starts, lens, off = [], [], 0
        for first, n in runs:
            starts.append((off, first))
            lens.append(n)
            off += n
        rr = np.arange(regions)[:, None] * nblocks * bb
        lrow = (src + rr + np.array([s[0] for s in starts])[None, :] * bb).ravel()
        rrow = (dst + rr + np.array([s[1] for s in starts])[None, :] * bb).ravel()
        nb = np.tile(np.array(lens) * bb, regions)
        local = np.stack([lrow, nb, np.full_like(nb, dev)], axis=1).astype(np.int64)
        remote = np.stack([rrow, nb, np.full_like(nb, dev)], axis=1).astype(np.int64)
        lidx = (np.arange(regions)[:, None] * nblocks + sblocks[None, :]).astype(np.int32).ravel()
        ridx = (np.arange(regions)[:, None] * nblocks + dblocks[None, :]).astype(np.int32).ravel()
        m: dict[str, list[float]] = {
            "per_write_build": [],
            "per_write_post": [],
            "strided_build": [],
            "strided_post": [],
        }
        iters = args.iters if local.shape[0] <= 4096 else max(2, args.iters // 4)
        for it in range(iters + 1):
            t0 = time.perf_counter()
            h = a.initialize_xfer(
                "WRITE", a.get_xfer_descs(local, args.mem), a.get_xfer_descs(remote, args.mem), "dl-B", b"w"
            )
            t1 = time.perf_counter()
            a.transfer(h)
            wait(h)
            t2 = time.perf_counter()
            a.release_xfer_handle(h)
            t3 = time.perf_counter()
            h = a.make_prepped_xfer("WRITE", lists[0], lidx, lists[1], ridx, b"s")
            t4 = time.perf_counter()
            a.transfer(h)
            wait(h)
            t5 = time.perf_counter()
            a.release_xfer_handle(h)
            b.get_new_notifs()
            if it:
                for k, v in zip(m, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
                    m[k].append(v * 1e3)
        out[pattern] = {
            "descriptors": int(local.shape[0]),
            "indices": int(lidx.size),
            **{k: statistics.median(v) for k, v in m.items()},
        }
        print(f"{args.mem} {pattern:>10}: {out[pattern]}", file=sys.stderr, flush=True)
    del keep_s, keep_d
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush_tools.bench.dlists", description=__doc__.split("\n")[0])
    ap.add_argument("--mem", choices=("DRAM", "VRAM"), default="DRAM")
    ap.add_argument("--regions", type=int, default=128, help="KV regions (layers x K/V)")
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per region in the request")
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--patterns", default="contiguous,runs16,shuffled")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    res = run(args)
    text = json.dumps(res, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
