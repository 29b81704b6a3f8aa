"""What one run of the GPU push benchmark measures: its options (:class:`Options`, picklable for both processes;
:func:`parse` from the command line), the strategies and layer-wise modes, and the request's block ids by
pattern."""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass, field

import numpy as np

from kvpush.core.geometry import KVGeometry

POISON = 0xA5
SLOW_DESCRIPTORS = 20_000
STRATEGIES = (
    "staged",
    "staged_prepped",
    "pipelined:2",
    "pipelined:4",
    "pipelined:1-6-1",
    "pipelined:1-3-3-1",
    "coalesced",
    "per_block",
)
PATTERNS = ("shuffled", "runs16", "contiguous")
LW_MODES = ("none", "whole", "layer", "layer_stream", "layer_1gemm", "layer_lowprio", "layer_end", "layer_each")
"""Layer-wise microbenchmark modes: no transfer, whole-request push, layer-wise (the default schedule: held back
until two layers are left), streamed in 16 MiB groups, streamed layer by layer; variants in ``layerwise``'s doc."""
SIM_MODES = {"sim_pack": "pack", "sim_peer": "peer", "sim_pack_peer": "pack+peer", "sim_pull": "pull"}
"""Diagnostic modes without kvpush: at each layer's hook a side stream (the copier's priority) copies the
layer's request bytes into a staging buffer (pack: a device copy of the same bytes) and/or to the other
GPU (peer: P's copy engine over NVLink, as UCX's cuda_ipc does; pull: D's copy engine reads it, as a
READ issued by D would). They say which of the two slows the
forward when layers are pushed during it, with no host work at all. A suffix ``_g<K>`` (``sim_peer_g8``)
sends the peer copy every K layers, K layers' bytes at once; ``layer_mb<N>`` is ``layer`` with parts of at
least N MiB, streamed (``layerwise_min_part_bytes``): the two ask whether the cost is per byte or per copy."""


def sim_mode(mode: str) -> tuple[str, int] | None:
    """``sim_*[_g<K>]`` -> (the side copies, K); None for the other modes."""
    base, _, k = mode.partition("_g")
    if base not in SIM_MODES or (k and not k.isdigit()) or k == "0":
        return None
    return SIM_MODES[base], int(k or 1)


STREAM_LEAD = 1 << 20
"""``layerwise_lead_layers`` of the streaming modes: every group goes as soon as it is ready."""


def mode_cfg(mode: str) -> dict[str, int] | None:
    """P's config changes a layer-wise mode asks for; None: the defaults (or not a layer-wise mode).

    ``layer_stream``: groups of ``layerwise_min_part_bytes`` (16 MiB) sent as soon as they are ready;
    ``layer_each``: every layer as soon as it is ready; ``layer_mb<N>``: streaming, parts of N MiB;
    ``layer_lead<K>``: held back until K layers are left (the default is 2).
    """
    if mode == "layer_stream":
        return {"layerwise_lead_layers": STREAM_LEAD}
    if mode == "layer_each":
        return {"layerwise_lead_layers": STREAM_LEAD, "layerwise_min_part_bytes": 0}
    if mode.startswith("layer_mb") and mode[8:].isdigit():
        return {"layerwise_lead_layers": STREAM_LEAD, "layerwise_min_part_bytes": int(mode[8:]) << 20}
    if mode.startswith("layer_lead") and mode[10:].isdigit() and int(mode[10:]) > 0:
        return {"layerwise_lead_layers": int(mode[10:])}
    return None


def known_mode(mode: str) -> bool:
    return mode in LW_MODES or sim_mode(mode) is not None or mode_cfg(mode) is not None


@dataclass(frozen=True)
class Options:
    """Everything both worker processes need (picklable)."""

    tokens: int = 16384
    layers: int = 64
    heads: int = 1
    head_dim: int = 128
    block_size: int = 16
    p_extra_blocks: int = 64
    d_blocks_factor: int = 4
    p_variant: str = "old_flash_nhd"
    d_variant: str = "old_flash_nhd"
    backend: str = "cuda"
    kernel: str = "auto"
    p_device: int = 0
    d_device: int = 1
    iters: int = 10
    slow_iters: int = 1
    patterns: tuple[str, ...] = PATTERNS
    strategies: tuple[str, ...] = STRATEGIES
    write_descs: tuple[int, ...] = (1, 4, 16, 64)
    warm_ms: float = 2.0
    engine: bool = True
    engine_parts: tuple[int, ...] = (4, 1, 2, 8)
    engine_orders: tuple[str, ...] = ("finished", "ahead")
    engine_iters: int = 5
    busy_poll_us: float = 50.0
    lw_tokens: tuple[int, ...] = ()
    lw_iters: int = 3
    lw_modes: tuple[str, ...] = LW_MODES
    lw_gap_ms: float = 40.0
    gpu_samples: bool = False
    seed: int = 0
    timeout_s: float = 120.0

    def geometry(self, role: str) -> KVGeometry:
        """One side's KV cache in bf16 (each variant of ``kvpush_cuda.variants`` lays it out its own way): P's pool
        holds the request and ``p_extra_blocks`` more, D's ``d_blocks_factor`` requests."""
        nb = self.p_blocks if role == "P" else self.d_blocks
        return KVGeometry(self.layers, nb, self.block_size, self.heads, self.head_dim, dtype="bfloat16")

    @property
    def req_blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def p_blocks(self) -> int:
        return self.req_blocks + self.p_extra_blocks

    @property
    def d_blocks(self) -> int:
        return self.req_blocks * self.d_blocks_factor

    @property
    def block_bytes(self) -> int:
        return self.geometry("P").block_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * 2 * self.req_blocks * self.block_bytes


@dataclass
class Case:
    """One (pattern, strategy) measurement."""

    pattern: str
    strategy: str
    descriptors: int = 0
    ms: list[float] = field(default_factory=list)
    verified: bool = True
    detail: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms) if self.ms else float("nan")


def block_ids(pattern: str, opts: Options, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(P's source ids, D's destination ids) of the request for one pattern."""
    n, nb = opts.req_blocks, opts.d_blocks
    src = np.arange(n, dtype=np.int64)
    if pattern == "shuffled":
        return src, rng.permutation(nb)[:n].astype(np.int64)
    if pattern.startswith("runs"):
        r = int(pattern[4:])
        starts = rng.permutation(nb // r)[: -(-n // r)] * r
        return src, (starts[:, None] + np.arange(r)).reshape(-1)[:n].astype(np.int64)
    if pattern == "contiguous":
        start = int(rng.integers(0, nb - n + 1))
        return src, np.arange(start, start + n, dtype=np.int64)
    raise ValueError(f"unknown pattern {pattern!r}")


def split_spans(total: int, k: int) -> list[tuple[int, int]]:
    """``k`` (offset, length) slices of ``[0, total)``."""
    edges = np.linspace(0, total, k + 1).astype(np.int64) // 256 * 256
    edges[-1] = total
    return [(int(a), int(b - a)) for a, b in itertools.pairwise(edges) if b > a]


def _chunks(nregions: int, chunks: int) -> list[tuple[int, int]]:
    per = -(-nregions // max(1, chunks))
    return [(i, min(i + per, nregions)) for i in range(0, nregions, per)]


def strategy_chunks(strategy: str, nregions: int) -> list[tuple[int, int]]:
    """Region ranges of a strategy: ``pipelined:N`` (N equal chunks), ``pipelined:1-6-1`` (by weight), else one."""
    if ":" not in strategy:
        return [(0, nregions)]
    arg = strategy.split(":", 1)[1]
    if "-" not in arg:
        return _chunks(nregions, int(arg))
    w = np.array([float(x) for x in arg.split("-")])
    edges = np.round(np.concatenate(([0.0], np.cumsum(w) / w.sum())) * nregions).astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges) if b > a]


def is_prepared(strategy: str) -> bool:
    """Whether a strategy prepares ahead: NIXL lists once per peer, piece tables while planning."""
    return strategy.startswith("pipelined") or "prepped" in strategy


def parse(argv: list[str] | None, description: str = "") -> tuple[Options, argparse.Namespace]:
    """The options of a run from its command line (``description``: the command's help text)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    for name in ("tokens", "layers", "heads", "head_dim", "block_size", "iters", "slow_iters", "seed"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--p-device", type=int, default=d.p_device)
    ap.add_argument("--d-device", type=int, default=None, help="default: 1 if 2 GPUs are visible, else 0")
    ap.add_argument("--p-variant", default=d.p_variant)
    ap.add_argument("--d-variant", default=d.d_variant)
    ap.add_argument("--backend", choices=("cuda", "host"), default=d.backend)
    ap.add_argument("--kernel", choices=("auto", "triton", "torch"), default=d.kernel)
    ap.add_argument("--patterns", default=",".join(d.patterns))
    ap.add_argument("--strategies", default=",".join(d.strategies))
    ap.add_argument("--write-descs", default=",".join(map(str, d.write_descs)))
    ap.add_argument("--warm-ms", type=float, default=d.warm_ms)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument(
        "--engine-parts",
        default=",".join(map(str, d.engine_parts)),
        help="push_parts values (0: the cost model's; -1: peer copies, P's device writing D's blocks)",
    )
    ap.add_argument(
        "--engine-orders",
        default=",".join(d.engine_orders),
        help="finished (D registers after P's prefill: a sequential router), ahead (D registered while P computes)",
    )
    ap.add_argument("--engine-iters", type=int, default=d.engine_iters, help="measured runs per engine row")
    ap.add_argument("--busy-poll-us", type=float, default=d.busy_poll_us, help="engines' busy_poll_max_s, in us")
    ap.add_argument("--lw-tokens", default="", help="layer-wise microbenchmark prompt lengths, e.g. 2048,16384")
    ap.add_argument("--lw-iters", type=int, default=d.lw_iters)
    ap.add_argument("--lw-gap-ms", type=float, default=d.lw_gap_ms, help="from a run's setup to its forward")
    ap.add_argument(
        "--lw-modes",
        default=",".join(d.lw_modes),
        help=f"of {','.join(LW_MODES)}, layer_mb<N>, {','.join(SIM_MODES)}[_g<K>]; with none",
    )
    ap.add_argument(
        "--gpu-samples", action="store_true", help="layer-wise runs: P's GPU clock and power (nvidia-smi, 20 ms)"
    )
    ap.add_argument("--quick", action="store_true", help="small request (dry runs): 1024 tokens, 4 layers")
    ap.add_argument("--json", default="", help="write results here")
    ap.add_argument("--plot", default="", help="write a PNG here")
    a = ap.parse_args(argv)
    d_dev = a.d_device
    if d_dev is None:
        d_dev = 0
        if a.backend == "cuda":
            import torch

            d_dev = 1 if torch.cuda.device_count() > 1 else 0
    lw_modes = tuple(a.lw_modes.split(","))
    unknown = sorted(m for m in lw_modes if not known_mode(m))
    if unknown or "none" not in lw_modes:
        ap.error(f"--lw-modes: unknown {unknown}, or no 'none' (the others are measured against it)")
    orders = tuple(x for x in a.engine_orders.split(",") if x)
    if not orders or set(orders) - {"finished", "ahead"}:
        ap.error(f"--engine-orders: choose from finished, ahead (got {a.engine_orders!r})")
    opts = Options(
        tokens=1024 if a.quick else a.tokens,
        layers=4 if a.quick else a.layers,
        heads=a.heads,
        head_dim=a.head_dim,
        block_size=a.block_size,
        p_variant=a.p_variant,
        d_variant=a.d_variant,
        backend=a.backend,
        kernel=a.kernel,
        p_device=a.p_device,
        d_device=d_dev,
        iters=3 if a.quick else a.iters,
        slow_iters=a.slow_iters,
        patterns=tuple(a.patterns.split(",")),
        strategies=tuple(a.strategies.split(",")),
        write_descs=tuple(int(x) for x in a.write_descs.split(",")),
        warm_ms=a.warm_ms,
        engine=not a.no_engine,
        engine_parts=tuple(int(x) for x in a.engine_parts.split(",") if x),
        engine_orders=orders,
        engine_iters=1 if a.quick else a.engine_iters,
        busy_poll_us=a.busy_poll_us,
        lw_tokens=tuple(int(x) for x in a.lw_tokens.split(",") if x),
        lw_iters=a.lw_iters,
        lw_modes=lw_modes,
        lw_gap_ms=a.lw_gap_ms,
        gpu_samples=a.gpu_samples,
        seed=a.seed,
    )
    return opts, a
