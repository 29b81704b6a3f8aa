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

JSON and a PNG in ``--out``; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

WAYS = ("per-request", "by-index", "vllm", "kvpush")
PATTERNS = ("fragmented", "contiguous")
KV = ("split", "blocks-first")
COUNTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
LIBFABRIC_PREFIX_ENV = "KVPUSH_LIBFABRIC_PREFIX"


@dataclass(frozen=True)
class Shape:
    """Each side's cache: ``regions`` (layers x K/V) of ``pool`` blocks of ``block_bytes``, one buffer a side;
    ``kv``: ``split`` (each region its own span) or ``blocks-first`` (a layer's block b holds K then V)."""

    regions: int
    pool: int
    block_bytes: int
    kv: str
    block_size: int = 16

    @property
    def nbytes(self) -> int:
        return self.regions * self.pool * self.block_bytes

    @property
    def vllm_width(self) -> int:
        """Regions one entry of vLLM's lists covers: a blocks-first layer is one region of K|V blocks there."""
        return 2 if self.kv == "blocks-first" else 1


def make_layout(shape: Shape, base: int, device: int, mem: str) -> Any:
    """The kvpush layout of one side's buffer at ``base``."""
    from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder

    bb, pool = shape.block_bytes, shape.pool
    if shape.kv == "split":
        stride = bb
        bases = [base + r * pool * bb for r in range(shape.regions)]
    else:
        stride = 2 * bb
        bases = [base + (r // 2) * pool * stride + (r % 2) * bb for r in range(shape.regions)]
    size = (pool - 1) * stride + bb
    return KVLayout(
        block_size=shape.block_size,
        num_blocks=pool,
        block_stride=stride,
        head_bytes=bb // shape.block_size,
        num_heads=1,
        head_start=0,
        local_heads=1,
        order=TokenOrder.NHD,
        mem=MemKind(mem),
        dtype="bfloat16",
        regions=tuple(Region(b, size, device, layer=r // 2) for r, b in enumerate(bases)),
    ).validate()


def vllm_rows(layout: Any, width: int) -> np.ndarray:
    """vLLM's prepared list over a layout: one (address, bytes, device) entry per block of each of its regions
    (``width`` of kvpush's regions each), region by region."""
    bb, nb = layout.block_bytes * width, layout.num_blocks
    bases = [r.base for r in layout.regions[::width]]
    addrs = np.asarray(bases, dtype=np.int64)[:, None] + np.arange(nb, dtype=np.int64)[None, :] * layout.block_stride
    out = np.empty((addrs.size, 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = addrs.ravel(), bb, layout.regions[0].device_id
    return out


def vllm_ids(blocks: np.ndarray, regions: int, pool: int) -> np.ndarray:
    """vLLM's entry ids of a request's blocks (its ``_compute_desc_ids``): region offset + block id, region by
    region, as int32."""
    return (np.arange(regions, dtype=np.int64)[:, None] * pool + blocks[None, :]).ravel().astype(np.int32)


def block_ids(pattern: str, n: int, pool: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct block ids of a pool: random (``fragmented``) or one run at a random start."""
    if pattern == "contiguous":
        first = int(rng.integers(0, pool - n + 1))
        return np.arange(first, first + n, dtype=np.int64)
    return rng.permutation(pool)[:n].astype(np.int64)


# -- the worker processes ------------------------------------------------------------------------------------


class _Side:
    """One process's cache and NIXL agent: P (``seed`` given, random bytes) or D (zeros)."""

    def __init__(self, role: str, shape: Shape, backend: str, device: str, seed: int | None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from kvpush.backends.base import MemRegistration
        from kvpush.transport.nixl_agent import Agent, nixl_version

        self.shape, self.device = shape, device
        self.mem = "VRAM" if device == "cuda" else "DRAM"
        if device == "cuda":
            import torch

            gpu = 0 if role == "P" or torch.cuda.device_count() < 2 else 1
            torch.cuda.set_device(gpu)
            self.torch = torch
            self.buf: Any = torch.zeros(shape.nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
            if seed is not None:
                gen = torch.Generator(device=f"cuda:{gpu}").manual_seed(seed)
                self.buf.random_(0, 256, generator=gen)
            self.addr, self.gpu = int(self.buf.data_ptr()), gpu
        else:
            self.buf = np.zeros(shape.nbytes, dtype=np.uint8)
            if seed is not None:
                self.buf[:] = np.random.default_rng(seed).integers(0, 256, shape.nbytes, dtype=np.uint8)
            self.addr, self.gpu = int(self.buf.ctypes.data), 0
        conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self.name = f"post-bench-{role}-{os.getpid()}"
        self.inner = nixl_agent(self.name, conf)
        self.inner.create_backend(backend)
        self.agent = Agent.over(self.name, self.inner, (backend,), nixl_version())
        self.agent.register([MemRegistration(self.addr, shape.nbytes, self.gpu, self.mem)])
        self.layout = make_layout(shape, self.addr, self.gpu, self.mem)
        self.seen: set[bytes] = set()
        """Notifications received (D: each verified WRITE's tag)."""

    def sums(self, blocks: np.ndarray, tag: bytes = b"") -> list[int]:
        """Weighted byte sums of the request's blocks, region by region (what a WRITE must make equal); ``tag``:
        first wait for the notification of the WRITE that carried it (its bytes are in place only then: a
        WRITE done on P may still be landing here)."""
        deadline = time.monotonic() + 60.0
        while tag and tag not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no notification {tag!r} in 60 s")
            self.progress()
        bb = self.shape.block_bytes
        offs = np.asarray([r.base - self.addr for r in self.layout.regions], dtype=np.int64)
        offs = (offs[:, None] + blocks[None, :] * self.layout.block_stride).ravel()
        out: list[int] = []
        for i in range(0, offs.size, 4096):
            chunk = offs[i : i + 4096]
            if self.device == "cuda":
                t, dev = self.torch, self.buf.device
                idx = t.as_tensor(chunk, device=dev)[:, None] + t.arange(bb, device=dev)
                w = (t.arange(bb, device=dev, dtype=t.int32) % 251) + 1
                out += (self.buf[idx].to(t.int32) * w).sum(dim=1).tolist()
            else:
                g = self.buf[chunk[:, None] + np.arange(bb)[None, :]].astype(np.int64)
                out += (g @ ((np.arange(bb) % 251) + 1)).tolist()
        return out

    def progress(self) -> None:
        """Progress the agent once, keeping the notifications it brings."""
        self.seen.update(msg for _, msg in self.agent.notifs(drain=True))

    def zero(self) -> None:
        if self.device == "cuda":
            self.buf.zero_()
            self.torch.cuda.synchronize()
        else:
            self.buf[:] = 0


class _P(_Side):
    """P: the three ways' lists and posts."""

    def setup(self, d_meta: bytes, d_layout: bytes) -> dict[str, float]:
        """Load D; prepare kvpush's lists (its own, D's) and vLLM's; return how long each preparation took."""
        import msgspec

        from kvpush.core.layout import KVLayout
        from kvpush.engine import by_index

        self.dst = msgspec.msgpack.decode(d_layout, type=KVLayout)
        self.peer = self.agent.add_peer(d_meta)
        t0 = time.perf_counter()
        assert by_index.prepare_local(self.agent, self.layout), "kvpush's own list was not prepared"
        t1 = time.perf_counter()
        assert by_index.prepare_peer(self.agent, self.layout, self.peer, self.dst), "D's list was not prepared"
        t2 = time.perf_counter()
        w = self.shape.vllm_width
        self.vllm_local = self.inner.prep_xfer_dlist("NIXL_INIT_AGENT", vllm_rows(self.layout, w), self.mem)
        t3 = time.perf_counter()
        self.vllm_remote = self.inner.prep_xfer_dlist(self.peer, vllm_rows(self.dst, w), self.mem)
        t4 = time.perf_counter()
        self.pair = self.agent.kept(self.peer)
        from kvpush.config import Config
        from kvpush.engine.by_index import costs_of

        self.costs = costs_of(Config.of(nixl_backends=list(self.agent.backends)), self.agent.nixl_version)
        return {
            "kvpush_local_s": t1 - t0,
            "kvpush_remote_s": t2 - t1,
            "vllm_local_s": t3 - t2,
            "vllm_remote_s": t4 - t3,
            "strided_lists": self.agent.strided_lists,
        }

    def point(self, src: np.ndarray, dst: np.ndarray, tokens: int) -> dict[str, Any]:
        """Plan the request (at pairing, before any post) and say what each way will post."""
        from kvpush.config import Config
        from kvpush.core.indexed import choose, split
        from kvpush.core.plan import build_plan, part_descriptors

        self.src_blocks, self.dst_blocks = src, dst
        self.plan = build_plan(Config.of(plan="direct"), self.layout, self.dst, src, dst, tokens, 0)
        part = split(self.pair, self.plan, 0, self.plan.nregions)
        assert part is not None
        today = part_descriptors(self.plan, self.layout, self.dst, 0, self.plan.nregions)[0].shape[0]
        return {
            "per_request_descriptors": int(today),
            "by_index_indices": part.indices,
            "by_index_posted": part.posted,
            "kvpush_chooses": choose(part, self.plan.merged.shape[0] * self.plan.nregions, self.costs).value,
            "vllm_indices": int(src.size * self.shape.regions // self.shape.vllm_width),
        }

    def measure(self, way: str, tag: bytes) -> dict[str, float]:
        """One WRITE of the current request ``way``, its notification ``tag``: build (per-request work), post call,
        until DONE."""
        from kvpush.core.indexed import indices, split
        from kvpush.core.outcome import XferState
        from kvpush.core.plan import part_descriptors
        from kvpush.engine.by_index import build_direct

        plan, agent, nreg = self.plan, self.agent, self.plan.nregions
        t0 = time.perf_counter()
        made = None
        if way == "kvpush":
            made = build_direct(agent, self.costs, plan, self.layout, self.dst, self.peer, 0, nreg, lambda n: tag)
        if made is not None:
            h = made[0]
        elif way in ("per-request", "kvpush"):
            local, remote = part_descriptors(plan, self.layout, self.dst, 0, nreg)
            h = agent.prepare_write(local, self.mem, remote, self.mem, self.peer, tag)
        elif way == "by-index":
            part = split(self.pair, plan, 0, nreg)
            assert part is not None and not part.rest.shape[0]
            li, ri = indices(self.pair, part)
            h = agent.prepare_by_index(self.peer, li, ri, tag)
        else:
            n = self.shape.regions // self.shape.vllm_width
            li = vllm_ids(self.src_blocks, n, self.shape.pool)
            ri = vllm_ids(self.dst_blocks, n, self.dst.num_blocks)
            h = self.inner.make_prepped_xfer("WRITE", self.vllm_local, li, self.vllm_remote, ri, tag)
        t1 = time.perf_counter()
        if way == "vllm":
            state = self.inner.transfer(h)
            t2 = time.perf_counter()
            while state == "PROC":
                state = self.inner.check_xfer_state(h)
            ok = state == "DONE"
            self.inner.release_xfer_handle(h)
        else:
            st = agent.post(h)
            t2 = time.perf_counter()
            while st is XferState.PROC:
                st = agent.state(h)
            ok = st is XferState.DONE
            agent.release(h)
        t3 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{way}: the WRITE failed")
        return {"build_s": t1 - t0, "post_s": t2 - t0, "write_s": t3 - t0}


def _serve(role: str, conn: Connection, shape: Shape, backend: str, device: str, seed: int, poll_s: float) -> None:
    """A worker: build the side, then answer ``(op, args)`` with ``("ok", value)`` or ``("err", traceback)``;
    D progresses its agent between commands every ``poll_s`` (LIBFABRIC's tcp provider moves data as the
    target progresses), waiting on its pipe in between rather than spinning against P for the CPU."""
    try:
        side: Any = (_P if role == "P" else _Side)(role, shape, backend, device, seed if role == "P" else None)
        import msgspec

        conn.send(("ok", (side.agent.metadata(), msgspec.msgpack.encode(side.layout))))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        if role == "D" and not conn.poll(poll_s):
            side.progress()
            continue
        op, args = conn.recv()
        if op == "stop":
            side.agent.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(side, op)(*args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


class _Proc:
    """The main process's handle on a worker."""

    def __init__(self, role: str, shape: Shape, backend: str, device: str, seed: int, poll_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (role, child, shape, backend, device, seed, poll_s)
        self.proc = ctx.Process(target=_serve, args=args, daemon=True)
        self.proc.start()
        self.role = role

    def recv(self, timeout_s: float = 300.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} did not answer in {timeout_s:.0f}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.role} failed:\n{value}")
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.conn.send((op, args))
        return self.recv()

    def close(self) -> None:
        try:
            self.call("stop")
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# -- the run -------------------------------------------------------------------------------------------------


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
        p = _Proc("P", shape, backend, args.device, args.seed, poll_s)
        d = _Proc("D", shape, backend, args.device, args.seed, poll_s)
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


# -- output --------------------------------------------------------------------------------------------------


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
