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
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpush.core.geometry import KVGeometry
from kvpush.core.outcome import XferState
from kvpush.transport.key_set import session_capability
from kvpush_tools.bench import stages
from kvpush_tools.cuda.standin_layer import QWEN3_32B_TP8, TINY, StandInLayer

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


def _sim_mode(mode: str) -> tuple[str, int] | None:
    """``sim_*[_g<K>]`` -> (the side copies, K); None for the other modes."""
    base, _, k = mode.partition("_g")
    if base not in SIM_MODES or (k and not k.isdigit()) or k == "0":
        return None
    return SIM_MODES[base], int(k or 1)


STREAM_LEAD = 1 << 20
"""``layerwise_lead_layers`` of the streaming modes: every group goes as soon as it is ready."""


def _mode_cfg(mode: str) -> dict[str, int] | None:
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


def _known_mode(mode: str) -> bool:
    return mode in LW_MODES or _sim_mode(mode) is not None or _mode_cfg(mode) is not None


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


def pattern_words(torch: Any, n: int, salt: int, device: Any) -> Any:
    """Deterministic, position-dependent int32 words: both processes rebuild P's data exactly."""
    x = torch.arange(n, dtype=torch.int64, device=device) + salt * 1_000_003
    x = (x * 2654435761 + 97 * salt + 12345) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return (x - ((x >> 31) << 32)).to(torch.int32)


def fill_kv(torch: Any, kv: dict[str, Any], device: Any) -> None:
    """P's KV content: layer i holds ``pattern_words(..., salt=i)`` in memory order."""
    for i, t in enumerate(kv.values()):
        _fill_layer(torch, t, i, device)


def _fill_layer(torch: Any, t: Any, i: int, device: Any) -> None:
    w = t.view(torch.int32)
    w.copy_(pattern_words(torch, w.numel(), i, device).view(w.shape))


def _make_kv(torch: Any, variant: str, g: KVGeometry, device: Any) -> dict[str, Any]:
    """A side's KV cache as vLLM's ``variant`` allocates it (bf16)."""
    from kvpush_cuda.variants import make_kv

    return make_kv(
        torch, variant, g.layers, g.num_blocks, g.block_size, g.num_heads, g.head_dim, torch.bfloat16, device
    )


class Side:
    """One process's KV cache, backend, staging buffer and NIXL agent."""

    def __init__(self, role: str, opts: Options) -> None:
        import torch

        from kvpush.backends.base import CacheSpec, MemRegistration
        from kvpush.transport.nixl_agent import Agent
        from kvpush_cuda.variants import axes, content

        self.torch, self.role, self.opts = torch, role, opts
        self.cuda = opts.backend == "cuda"
        idx = opts.p_device if role == "P" else opts.d_device
        self.idx = idx
        if self.cuda:
            torch.cuda.set_device(idx)
            self.device = torch.device("cuda", idx)
            from kvpush_cuda import CudaBackend

            self.backend: Any = CudaBackend(device=idx, kernel=opts.kernel)  # type: ignore[arg-type]
        else:
            from kvpush.backends.host import HostBackend

            self.device = torch.device("cpu")
            self.backend = HostBackend()
        variant = opts.p_variant if role == "P" else opts.d_variant
        self.variant = variant
        self.kv = _make_kv(torch, variant, opts.geometry(role), self.device)
        heads = 1 if variant.endswith("mla") else opts.heads
        self.spec = CacheSpec(opts.block_size, heads, content(variant, opts.head_dim), "bfloat16", axes=axes(variant))
        self.layout = self.backend.describe(self.kv, self.spec)
        self.staging = self.backend.alloc_staging(opts.total_bytes, idx)
        self.agent = Agent(role)
        s = self.staging
        self.regs = [*self.backend.registrations(self.layout), MemRegistration(s.addr, s.size, s.device_id, s.mem)]
        self.agent.register(self.regs)
        self.mem = str(self.layout.mem)
        self.bases = [r.base for r in self.layout.regions]
        self._scratch = torch.empty(2, 64 << 20, dtype=torch.uint8, device=self.device)
        self.sync()

    def warm(self, ms: float) -> None:
        """Keep the GPU copying for ``ms`` so its clocks are up when the timed part starts."""
        if ms <= 0 or not self.cuda:
            return
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            self._scratch[0].copy_(self._scratch[1])
            self.sync()

    def copy_stats(self) -> dict[str, float]:
        return self.backend.copy_stats() if hasattr(self.backend, "copy_stats") else {}

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def staging_tensor(self) -> Any:
        return self.staging.owner if self.cuda else self.torch.from_numpy(self.staging.owner)


def _recv(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"peer process silent for {timeout}s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] in ("error", "failed"):
        raise RuntimeError(f"peer failed:\n{msg[1]}")
    return msg


def _wait_notifs(agent: Any, tags: list[bytes], timeout: float, on_each: Any = None) -> tuple[float, float]:
    """Busy-poll NIXL until every tag arrived; returns (first, last) arrival times."""
    pending = set(tags)
    first = last = 0.0
    deadline = time.perf_counter() + timeout
    while pending:
        for _, msg in agent.notifs():
            if msg in pending:
                pending.discard(msg)
                last = time.perf_counter()
                first = first or last
                if on_each is not None:
                    on_each(msg)
        if time.perf_counter() > deadline:
            raise TimeoutError(f"notifications {sorted(pending)[:3]} did not arrive in {timeout}s")
    return first, last


def _wait_xfers(agent: Any, handles: list[Any], timeout: float, release: bool = True) -> None:
    deadline = time.perf_counter() + timeout
    for h in handles:
        st = agent.state(h)
        while st is XferState.PROC:
            if time.perf_counter() > deadline:
                raise TimeoutError("NIXL transfer did not complete")
            st = agent.state(h)
        if release:
            agent.release(h)
        if st is XferState.ERR:
            raise RuntimeError("NIXL transfer failed (state ERR)")


def _split(total: int, k: int) -> list[tuple[int, int]]:
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


# --------------------------------------------------------------------------- D


class DServer:
    """D's side: poison, wait for the data, unpack, verify, report times."""

    def __init__(self, side: Side, conn: Any) -> None:

        self.s, self.conn = side, conn
        torch, o = side.torch, side.opts
        # A replica of P's KV on D, built by the same formula: the reference for torch.equal.
        self.ref = _make_kv(torch, o.p_variant, o.geometry("P"), side.device)
        fill_kv(torch, self.ref, side.device)
        self.p_layout: Any = None
        self.peer = ""
        self.receiver: Any = None

    def poison(self) -> None:
        for t in self.s.kv.values():
            t.view(self.s.torch.uint8).fill_(POISON)
        self.s.staging_tensor().fill_(0x5A)
        self.s.sync()

    def verify(self, src: np.ndarray, dst: np.ndarray) -> tuple[bool, str]:
        """Requested blocks equal P's, and every other D block still holds the poison."""
        from kvpush_cuda.variants import canonical

        torch, s = self.s.torch, self.s
        si = torch.as_tensor(src, device=s.device)
        di = torch.as_tensor(dst, device=s.device)
        others = torch.ones(s.opts.d_blocks, dtype=torch.bool, device=s.device)
        others[di] = False
        for i, (d, r) in enumerate(zip(s.kv.values(), self.ref.values(), strict=True)):
            got = canonical(d, s.variant).view(torch.int16)
            want = canonical(r, s.opts.p_variant).view(torch.int16)
            if not torch.equal(got[:, di], want[:, si]):
                return False, f"layer {i}: requested blocks differ from P's"
            if not bool((got[:, others].view(torch.uint8) == POISON).all()):
                return False, f"layer {i}: a block outside the request was written"
        return True, ""

    def serve(self) -> None:
        from kvpush.core.pieces import coalesce, map_pieces

        s, o = self.s, self.s.opts
        self.conn.send(("hello", s.agent.metadata(), s.layout, s.staging.addr))
        _, p_meta, self.p_layout = _recv(self.conn, o.timeout_s)
        self.peer = s.agent.add_peer(p_meta)
        self.conn.send(("ok",))
        while True:
            msg = _recv(self.conn, 600)
            op = msg[0]
            if op == "stop":
                if self.receiver is not None:
                    self.receiver.close()
                return
            if op == "raw":
                _, tag = msg
                self.poison()
                s.warm(o.warm_ms)
                self.conn.send(("ready",))
                _, t1 = _wait_notifs(s.agent, [tag], o.timeout_s)
                words = s.staging_tensor().view(s.torch.int32)
                ok = s.torch.equal(words, pattern_words(s.torch, words.numel(), 1000, s.device))
                self.conn.send(("done", t1, {}, ok, "" if ok else "staging differs"))
            elif op == "case":
                _, strategy, tag, src, dst = msg
                self.poison()
                pieces = None
                if strategy.startswith(("staged", "pipelined")):
                    pieces = coalesce(map_pieces(self.p_layout, s.layout, src, dst, o.tokens))[:, [1, 2]]
                    if _prepared(strategy) and hasattr(s.backend, "prepare_unpack"):
                        # D knows its pieces when it registers, long before the data comes.
                        for a, b in strategy_chunks(strategy, len(s.bases)):
                            s.backend.prepare_unpack(s.bases[a:b], pieces)
                if not strategy.endswith("_cold"):
                    s.warm(o.warm_ms)
                before = s.copy_stats()
                self.conn.send(("ready",))
                unpack_s = 0.0
                if strategy.startswith("staged"):
                    _, t_notif = _wait_notifs(s.agent, [tag], o.timeout_s)
                    s.backend.unpack(s.bases, pieces, s.staging.addr)
                    unpack_s = time.perf_counter() - t_notif
                elif strategy.startswith("pipelined"):
                    spans = strategy_chunks(strategy, len(s.bases))
                    acc = [0.0]
                    tags = [tag + b":%d" % i for i in range(len(spans))]
                    on_chunk = functools.partial(self._unpack_chunk, spans, pieces, acc)
                    _, t_notif = _wait_notifs(s.agent, tags, o.timeout_s, on_chunk)
                    unpack_s = acc[0]
                else:
                    _, t_notif = _wait_notifs(s.agent, [tag], o.timeout_s)
                t1 = time.perf_counter()
                info = {"unpack_ms": unpack_s * 1e3, "notif_t": t_notif, **_stats_delta("d_", before, s.copy_stats())}
                ok, detail = self.verify(src, dst)
                self.conn.send(("done", t1, info, ok, detail))
            elif op in ("engine_start", "engine", "engine_ahead"):
                # The engine is measured last and must not take the other results down with it.
                try:
                    if op == "engine_start":
                        self._engine_start(msg[1])
                    elif op == "engine":
                        self._engine_case(*msg[1:])
                    else:
                        self._engine_case(*msg[1:], announce=True)
                except Exception:
                    self.conn.send(("failed", traceback.format_exc()))
            else:
                raise ValueError(f"unknown op {op}")

    def _unpack_chunk(self, spans: list[tuple[int, int]], pieces: np.ndarray, acc: list[float], tag: bytes) -> None:
        """Unpack the regions of the chunk whose notification ``tag`` just arrived."""
        s = self.s
        a, b = spans[int(tag.rsplit(b":", 1)[1])]
        t = time.perf_counter()
        s.backend.unpack(s.bases[a:b], pieces, s.staging.addr + a * int(pieces[:, 1].sum()))
        acc[0] += time.perf_counter() - t

    def _engine_start(self, cfg: dict[str, Any]) -> None:
        from kvpush.config import Config
        from kvpush.engine import Receiver

        if self.receiver is not None:
            self.receiver.close()
        self.receiver = Receiver(Config.from_dict(cfg), self.s.backend, self.s.layout, engine_id="D", rank=0)
        self.conn.send(("ok",))

    def _engine_case(
        self,
        tid: str,
        address: tuple[str, int],
        src: np.ndarray,
        dst: np.ndarray,
        tokens: int | None = None,
        announce: bool = False,
    ) -> None:
        """Register, wait for the result; ``announce``: tell P once registered (P times from its KV ready).

        The reply carries D's monotonic time of the result, so P can time from
        its own moment (CLOCK_MONOTONIC is shared by both processes).
        """
        from kvpush.engine import PeerAddress

        s = self.s
        self.poison()
        s.warm(s.opts.warm_ms)
        before = s.copy_stats()
        t0 = time.monotonic()
        n = s.opts.tokens if tokens is None else tokens
        cap = session_capability(tid)  # the harness plays the router
        self.receiver.register(tid, tid, PeerAddress(address[0], address[1], 1), [dst.tolist()], n, capability=cap)
        if announce:
            self.conn.send(("registered",))
        res = None
        deadline = time.perf_counter() + s.opts.timeout_s
        while res is None and time.perf_counter() < deadline:
            for r in self.receiver.poll():
                if r.transfer_id == tid:
                    res = r
            if res is None:
                time.sleep(50e-6)  # a busy poll would starve the engine thread of the GIL
        t1 = time.monotonic()
        if res is None:
            self.conn.send(("done", (t1 - t0) * 1e3, {}, False, "no result from the receiver", 0.0, {}, t0))
            return
        copier = _stats_delta("d_copy_", before, s.copy_stats())  # before verify's own copies
        ok, detail = self.verify(src, dst) if res.ok else (False, res.reason)
        result_t = res.times.result or 0.0
        stats = {**res.stats.as_dict(), **copier}
        times = {**res.times.as_dict(), **stages.part_times(res.times, "")}
        self.conn.send(("done", (result_t - t0) * 1e3, stats, ok, detail, result_t, times, t0))


# --------------------------------------------------------------------------- P


class PDriver:
    """P's side: runs every strategy and pattern, times them, collects D's verdicts."""

    def __init__(self, side: Side, conn: Any) -> None:
        self.s, self.conn = side, conn
        fill_kv(side.torch, side.kv, side.device)
        side.sync()
        self.cases: list[Case] = []
        self.raw: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self._dlists: dict[tuple[tuple[int, int], ...], tuple[Any, Any]] = {}
        self._handles: dict[tuple[Any, ...], Any] = {}
        self.seq = 0

    def _tag(self) -> bytes:
        self.seq += 1
        return b"t%d" % self.seq

    def connect(self) -> None:
        s, o = self.s, self.s.opts
        _, d_meta, self.d_layout, self.d_staging = _recv(self.conn, o.timeout_s)
        self.peer = s.agent.add_peer(d_meta)
        self.conn.send(("hello", s.agent.metadata(), s.layout))
        _recv(self.conn, o.timeout_s)

    def _round(self, msg: tuple[Any, ...], run: Any) -> tuple[float, dict[str, float], bool, str, dict[str, Any]]:
        """Send D a case, wait until it is ready, run P's part, return (ms, P breakdown, ok, detail, D info)."""
        o = self.s.opts
        self.conn.send(msg)
        _recv(self.conn, o.timeout_s)
        if not str(msg[1]).endswith("_cold"):
            self.s.warm(o.warm_ms)
        before = self.s.copy_stats()
        ev = self.s.backend.record_ready()
        self.s.backend.wait_ready(ev)
        t0 = time.perf_counter()
        p_times = run(t0)
        p_times.update(_stats_delta("p_", before, self.s.copy_stats()))
        _, t1, d_info, ok, detail = _recv(self.conn, o.timeout_s)
        if "notif_t" in d_info:
            d_info["notif_ms"] = _ms(d_info.pop("notif_t") - t0)
        return _ms(t1 - t0), p_times, ok, detail, d_info

    def raw_writes(self) -> int:
        """WRITE of the whole staging buffer, split into k descriptors: NIXL's ceiling; returns the best k."""
        s, o = self.s, self.s.opts
        words = s.staging_tensor().view(s.torch.int32)
        words.copy_(pattern_words(s.torch, words.numel(), 1000, s.device))
        s.sync()
        best, best_ms = 1, float("inf")
        for k in o.write_descs:
            spans = _split(o.total_bytes, k)
            local = np.array([[s.staging.addr + a, n, s.staging.device_id] for a, n in spans], dtype=np.int64)
            dev_d = self.d_layout.regions[0].device_id
            remote = np.array([[self.d_staging + a, n, dev_d] for a, n in spans], dtype=np.int64)
            ms: list[float] = []
            ok_all = True
            for it in range(o.iters + 1):
                tag = self._tag()
                t, _, ok, _, _ = self._round(("raw", tag), functools.partial(self._write, local, remote, tag))
                ok_all &= ok
                if it:
                    ms.append(t)
            med = statistics.median(ms)
            self.raw.append({"descriptors": k, "ms": ms, "median_ms": med, "verified": ok_all})
            _log(f"raw WRITE {o.total_bytes >> 20} MiB as {k} descriptors: {med:.3f} ms, verified={ok_all}")
            if med < best_ms and ok_all:
                best, best_ms = k, med
        return best

    def _write(self, local: np.ndarray, remote: np.ndarray, tag: bytes, t0: float) -> dict[str, float]:
        h = self.s.agent.prepare_write(local, self.s.mem, remote, str(self.d_layout.mem), self.peer, tag)
        self.s.agent.post(h)
        _wait_xfers(self.s.agent, [h], self.s.opts.timeout_s)
        return {}

    def run_cases(self, write_k: int) -> None:
        o = self.s.opts
        rng = np.random.default_rng(o.seed)
        for pattern in o.patterns:
            for strategy in o.strategies:
                case = Case(pattern, strategy)
                samples: dict[str, list[float]] = {}

                target = 0
                while not target or len(case.ms) < target:
                    # Fresh block ids every run, as every request has its own: no plan or
                    # uploaded piece table is reused across runs.
                    src, dst = block_ids(pattern, o, rng)
                    tag = self._tag()
                    ms, p_ms, ok, detail, d_info = self._round(
                        ("case", strategy, tag, src, dst),
                        functools.partial(self._run, strategy, case, src, dst, tag, write_k),
                    )
                    if not target:
                        # The first run warms up (IPC handles, kernels) and is dropped, except
                        # where descriptor posting dominates and a run costs ~1 s.
                        slow = case.descriptors > SLOW_DESCRIPTORS
                        target = o.slow_iters if slow else o.iters
                        if slow:
                            case.ms.append(ms)
                    else:
                        case.ms.append(ms)
                    for k, v in {**p_ms, **d_info}.items():
                        samples.setdefault(k, []).append(v)
                    case.verified &= ok
                    case.detail = case.detail or detail
                case.breakdown = {k: statistics.median(v) for k, v in samples.items()}
                self.cases.append(case)
                _log(
                    f"{pattern:>10} {strategy:>9}: {case.median_ms:9.3f} ms ({len(case.ms)} runs, "
                    f"{case.descriptors} descs) verified={case.verified} {case.detail} {case.breakdown}"
                )

    def _prepped(self, spans: list[tuple[int, int]]) -> tuple[Any, Any]:
        """NIXL prepared descriptor lists over staging (P) -> staging (D), made once per chunking.

        The design's rule, "prepare once per peer and region, never per request":
        a request then names entries by index instead of building descriptors.
        """
        key = tuple(spans)
        if key not in self._dlists:
            s = self.s
            dev_d = self.d_layout.regions[0].device_id
            local = np.array([[s.staging.addr + a, n, s.idx] for a, n in spans], dtype=np.int64)
            remote = np.array([[self.d_staging + a, n, dev_d] for a, n in spans], dtype=np.int64)
            self._dlists[key] = s.agent.prepare_lists(local, s.mem, remote, str(self.d_layout.mem), self.peer)
        return self._dlists[key]

    def _post_prepped(self, spans: list[tuple[int, int]], indices: list[int], tag: bytes) -> Any:
        """Post a WRITE of prepared entries; the handle is made once and re-posted with a new notification."""
        agent = self.s.agent
        key = (tuple(spans), tuple(indices))
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = agent.prepare_indexed_write(self._prepped(spans), indices, tag)
        if agent.post(h, tag) is XferState.ERR:
            raise RuntimeError("NIXL transfer failed at post")
        return h

    def _run(
        self, strategy: str, case: Case, src: np.ndarray, dst: np.ndarray, tag: bytes, write_k: int, t0: float
    ) -> dict[str, float]:
        """P's part of one transfer (timed from ``t0``): plan, pack if staged, post, wait for completion.

        ``staged`` is what the engine does today (descriptors built per WRITE,
        piece table uploaded by the first pack); ``staged_prepped`` and
        ``pipelined:N`` use prepared NIXL lists and upload the table while planning.
        """
        from kvpush.core.pieces import coalesce, descriptors, map_pieces, merge_descriptors

        s, o, dl = self.s, self.s.opts, self.d_layout
        dev_d = dl.regions[0].device_id
        if strategy == "per_block":
            pieces = np.stack(
                [src * s.layout.block_stride, dst * dl.block_stride, np.full(src.size, o.block_bytes)],
                axis=1,
            )
            local, remote = descriptors(pieces, s.layout, dl)
        else:
            pieces = coalesce(map_pieces(s.layout, dl, src, dst, o.tokens))
            if strategy == "coalesced":
                local, remote = merge_descriptors(*descriptors(pieces, s.layout, dl))
        pack_pieces = pieces[:, [0, 2]]
        per_region = int(pieces[:, 2].sum())
        chunks = strategy_chunks(strategy, len(s.bases))
        if _prepared(strategy) and hasattr(s.backend, "prepare_pack"):
            for a, b in chunks:
                s.backend.prepare_pack(s.bases[a:b], pack_pieces)
        t_plan = time.perf_counter()
        if strategy in ("per_block", "coalesced"):
            case.descriptors = int(local.shape[0])
            h = s.agent.prepare_write(local, s.mem, remote, str(dl.mem), self.peer, tag)
            s.agent.post(h)
            t_post = time.perf_counter()
            _wait_xfers(s.agent, [h], o.timeout_s)
            return {"plan_ms": _ms(t_plan - t0), "post_ms": _ms(t_post - t_plan)}
        if strategy.startswith("staged"):
            s.backend.pack(s.bases, pack_pieces, s.staging.addr)
            t_pack = time.perf_counter()
            spans = _split(o.total_bytes, write_k)
            case.descriptors = len(spans)
            if not _prepared(strategy):
                local = np.array([[s.staging.addr + a, n, s.idx] for a, n in spans], dtype=np.int64)
                remote = np.array([[self.d_staging + a, n, dev_d] for a, n in spans], dtype=np.int64)
                h = s.agent.prepare_write(local, s.mem, remote, str(dl.mem), self.peer, tag)
                s.agent.post(h)
            else:
                h = self._post_prepped(spans, list(range(len(spans))), tag)
            t_post = time.perf_counter()
            _wait_xfers(s.agent, [h], o.timeout_s, release=not _prepared(strategy))
            return {
                "plan_ms": _ms(t_plan - t0),
                "pack_ms": _ms(t_pack - t_plan),
                "post_ms": _ms(t_post - t_pack),
            }
        # pipelined: pack a chunk of regions, post it, pack the next while it flies.
        spans = [(a * per_region, (b - a) * per_region) for a, b in chunks]
        handles, pending, pack_s, post_s = [], [], 0.0, 0.0
        for i, (a, b) in enumerate(chunks):
            tp = time.perf_counter()
            s.backend.pack(s.bases[a:b], pack_pieces, s.staging.addr + a * per_region)
            tq = time.perf_counter()
            h = self._post_prepped(spans, [i], tag + b":%d" % i)
            post_s += time.perf_counter() - tq
            pack_s += tq - tp
            handles.append(h)
            pending.append(h)
            # Progress NIXL so finished chunks notify D (which unpacks them) while we pack the next.
            pending = [x for x in pending if s.agent.state(x) is XferState.PROC]
        case.descriptors = len(handles)
        _wait_xfers(s.agent, handles, o.timeout_s, release=False)
        return {"plan_ms": _ms(t_plan - t0), "pack_ms": _ms(pack_s), "post_ms": _ms(post_s)}

    def _engine_cfg(self, parts: int) -> dict[str, Any]:
        o = self.s.opts
        return {
            "backend": o.backend,
            "staging_bytes": o.total_bytes + (64 << 20),
            "idle_poll_max_s": 0.001,
            "busy_poll_max_s": o.busy_poll_us * 1e-6,
            "link_gbps": 200.0,
            "side_channel_port": 0,  # a free port: D learns it from the sender
            # parts > 0: exactly that many (no fixed cost per part in the cost model); 0: the cost model's choice;
            # -1: peer copies (both sides on this host: P's device writes D's blocks, kvpush.backends.peer)
            **({"push_parts": parts, "part_cost_us": 0.0} if parts > 0 else {}),
            **({"peer_copy": True} if parts < 0 else {}),
        }

    def _sender(self, parts: int) -> Any:
        from kvpush.config import Config
        from kvpush.engine import Sender

        cfg = self._engine_cfg(parts)
        sender = Sender(Config.from_dict(cfg), self.s.backend, self.s.layout, engine_id="P", rank=0, tp_size=1)
        self.conn.send(("engine_start", cfg))
        _recv(self.conn, self.s.opts.timeout_s)
        return sender

    def _released(self, sender: Any, tid: str) -> Any:
        """P's Result for ``tid`` once P let go of the blocks (None on timeout)."""
        deadline = time.perf_counter() + self.s.opts.timeout_s
        while time.perf_counter() < deadline:
            for r in sender.poll():
                if r.transfer_id == tid:
                    return r
            time.sleep(50e-6)
        return None

    def _announce(self, sender: Any, tid: str, src: np.ndarray, dst: np.ndarray, tokens: int) -> None:
        """Start a prefill on P before its KV exists and have D register: P pairs and plans now."""
        sender.prefill_started(tid, tid, [src.tolist()], tokens)
        self.conn.send(("engine_ahead", tid, sender.address, src, dst, tokens))
        _recv(self.conn, self.s.opts.timeout_s)  # D registered
        deadline = time.perf_counter() + self.s.opts.timeout_s
        while sender.stats()["in_flight"] < 1:  # paired (and planned) on P's engine thread
            if time.perf_counter() > deadline:
                raise TimeoutError("P never paired the registration")
            time.sleep(100e-6)

    def engine(self) -> list[dict[str, Any]]:
        """The same request through kvpush.engine with this backend, in both orders; the core picks the plan.

        ``finished``: the order behind a sequential router (P answers, then the
        router sends D): P hands over the finished prefill and parks it, then D
        registers; time from D's register call to D's result, so D's and P's
        planning and every hand-off after the registration are on it.
        ``ahead``: D registered while P computes: P announces the prefill, D
        registers, P pairs and plans before the KV exists; time from "KV ready"
        on P (``forward_done`` with a CUDA event) to D's result (unpacked).
        Both orders run with each ``push_parts`` and take turns run by run.
        """
        o = self.s.opts
        rng = np.random.default_rng(o.seed + 1)
        out = []
        for parts in o.engine_parts:
            sender = self._sender(parts)
            try:
                for pattern in o.patterns:
                    runs: dict[str, list[tuple[Any, ...]]] = {m: [] for m in o.engine_orders}
                    for it in range(o.engine_iters + 1):
                        for mode in o.engine_orders if it % 2 else o.engine_orders[::-1]:
                            src, dst = block_ids(pattern, o, rng)
                            self.seq += 1
                            one = self._engine_once(sender, mode, f"bench-{pattern}-{self.seq}", src, dst)
                            if it:
                                runs[mode].append(one)
                    for mode, got in runs.items():
                        out.append(_engine_row(pattern, mode, parts, got))
                        r = out[-1]
                        _log(
                            f"engine {mode:>8} parts={parts} {pattern:>10}: plan={r['plan']} "
                            f"{r['median_ms']:.3f} ms verified={r['verified']} {r['detail']}"
                        )
            finally:
                sender.close()
        return out

    def _engine_once(
        self, sender: Any, mode: str, tid: str, src: np.ndarray, dst: np.ndarray
    ) -> tuple[float, bool, str, dict[str, Any], dict[str, float]]:
        """One transfer in ``mode``: (ms, verified, detail, D's stats, stage times in ms after the timed start)."""
        s, o = self.s, self.s.opts
        before = s.copy_stats()
        if mode == "finished":
            sender.prefill_finished(tid, tid, [src.tolist()], o.tokens, ready=s.backend.record_ready())
            deadline = time.perf_counter() + o.timeout_s
            while sender.stats()["parked_prefills"] < 1:  # handed over and parked (P's engine thread saw it)
                if time.perf_counter() > deadline:
                    raise TimeoutError("P never parked the prefill")
                time.sleep(100e-6)
            s.warm(o.warm_ms)
            self.conn.send(("engine", tid, sender.address, src, dst))
            _, t, stats, ok, det, _, d_times, t0 = _recv(self.conn, o.timeout_s)
        else:
            self._announce(sender, tid, src, dst, o.tokens)
            s.warm(o.warm_ms)
            t0 = time.monotonic()
            sender.forward_done([tid], s.backend.record_ready())
            _, _, stats, ok, det, t_result, d_times, _ = _recv(self.conn, o.timeout_s)
            t = (t_result - t0) * 1e3
        marks = {f"d_{k}": (v - t0) * 1e3 for k, v in d_times.items() if v >= t0}
        marks.update({k: v for k, v in stats.items() if k.startswith("d_copy_")})
        marks.update(_stats_delta("p_copy_", before, s.copy_stats()))
        p_res = self._released(sender, tid)
        if p_res is not None:
            # P's stages before the timed start too (negative): in the finished order the pack at hand-over
            # (``p_ready``, ``p_packed``) comes before D's register call.
            p_times = {**p_res.times.as_dict(), **stages.part_times(p_res.times, "")}
            marks.update({f"p_{k}": (v - t0) * 1e3 for k, v in p_times.items()})
            marks.update({f"p_{k}_ms": v * 1e3 for k, v in p_res.stats.as_dict().items() if k.endswith("_s")})
        ok = ok and p_res is not None
        det = det or ("" if p_res is not None else "P never released the blocks")
        return t, ok, det, stats, marks

    def layerwise(self) -> list[dict[str, Any]]:
        """Time-to-KV-on-D after a simulated prefill: no transfer, whole-request push, layer-wise push.

        P's forward is a stand-in (``standin_layer.StandInLayer``: a Qwen3-32B
        TP8 rank's layer work in vLLM's order): per layer, the KV written (P's
        blocks are zeroed before each run, so a layer pushed before it was
        written would fail D's check), the QKV projection and attention, then
        vLLM's ``save_kv_layer`` hook (``layer``: the layer's CUDA event is
        reported there), then o_proj and the MLP. ``layer`` uses P's default
        schedule (layers held back until two are left, then one burst);
        ``layer_stream``, ``layer_each``, ``layer_mb<N>`` and ``layer_lead<K>``
        other schedules (``_mode_cfg``); ``sim_*`` side copies without kvpush
        (``SIM_MODES``). Other variants of ``layer``:
        ``layer_1gemm`` does the post-hook work as one GEMM of the same FLOPs;
        ``layer_lowprio`` runs P's copier stream at normal priority;
        ``layer_end`` reports each layer after its MLP instead of at the hook
        (the most a push can lag behind vLLM's hook). ``none`` is the end of
        the forward; ``whole`` pushes after it. The transfer is planned at
        pairing in every pushing mode. Overhead = D's result - end of this
        run's forward; the forward of each mode is kept too (a push thread
        that slowed the forward would show there).
        """
        torch, s, o = self.s.torch, self.s, self.s.opts
        rng = np.random.default_rng(o.seed + 7)
        parts = o.engine_parts[0] if o.engine_parts else 4
        # Modes with their own schedule (_mode_cfg) change P's config between runs (P reads it when it
        # groups layers; D does not use it), so that all modes take turns with one sender.
        sender = self._sender(parts)
        default_cfg = sender.cfg
        layer = StandInLayer(
            torch, s.device, torch.bfloat16 if s.cuda else torch.float32, QWEN3_32B_TP8 if s.cuda else TINY
        )
        out: list[dict[str, Any]] = []
        layers = list(s.kv.values())
        n = 0

        def gpu_ms(fn: Any, reps: int = 5) -> float:
            fn()
            s.sync()
            t0 = time.monotonic()
            for _ in range(reps):
                fn()
            s.sync()
            return (time.monotonic() - t0) * 1e3 / reps

        sampler = None
        if o.gpu_samples:
            from kvpush_tools.cuda.gpu_samples import GpuSampler, smi_command

            try:
                sampler = GpuSampler(smi_command(o.p_device))
            except OSError as exc:
                _log(f"no GPU samples: {exc}")

        sims = {m: _sim_mode(m) for m in o.lw_modes}
        side = _SideCopies(torch, s, o) if s.cuda and any(sims.values()) else None

        def run(mode: str, tid: str, req_blocks: int, x: Any) -> tuple[dict[str, float], bool, str]:
            """One prefill in ``mode``: the forward, then (pushing modes) D's result and P's release."""
            t_setup = time.monotonic()
            src = np.arange(req_blocks, dtype=np.int64)
            dst = rng.permutation(o.d_blocks)[:req_blocks].astype(np.int64)
            for t in layers:
                t.zero_()
            s.sync()
            sim = sims[mode]
            pushing = mode != "none" and sim is None
            if pushing:
                self._announce(sender, tid, src, dst, x.shape[0])
            # GPU time of each layer's two halves (before/after the hook), from events on the forward's stream.
            marks: list[Any] | None = [] if s.cuda else None

            def mark() -> None:
                if marks is not None:
                    marks.append(torch.cuda.Event(enable_timing=True))
                    marks[-1].record()

            # Every mode's forward starts the same time after this run's setup began: the GPU's power
            # limit lets a forward run faster after a longer idle gap, and pairing (pushing modes only)
            # lengthens the gap (without this, no-transfer forwards ran 1-2 ms slower than whole-push ones).
            time.sleep(max(0.0, t_setup + o.lw_gap_ms / 1e3 - time.monotonic()))
            s.warm(o.warm_ms)
            t0 = time.monotonic()
            for i, t in enumerate(layers):
                mark()
                _fill_layer(torch, t, i, s.device)  # vLLM writes the KV before the attention
                a = layer.attention(x)
                mark()
                if pushing and mode not in ("whole", "layer_end"):
                    sender.layer_written([tid], i, s.backend.record_ready())
                elif side is not None and sim is not None:
                    side.layer(i, t, req_blocks, *sim)
                if mode == "layer_1gemm":
                    layer.after_hook_one_gemm(x)
                else:
                    layer.after_hook(x, a)
                if mode == "layer_end":
                    sender.layer_written([tid], i, s.backend.record_ready())
            mark()
            last = s.backend.record_ready()
            s.backend.wait_ready(last)
            t_fwd = time.monotonic()
            # Wall-clock start: lines up a run with outside samples (nvidia-smi's clocks and power).
            row = {"forward_ms": (t_fwd - t0) * 1e3, "wall_start": time.time() - (time.monotonic() - t0)}
            if mode == "whole":  # first: the samples' wait below must not delay the push
                sender.forward_done([tid], last)
            if sim is not None and side is not None:
                row["sim_tail_ms"] = (side.wait() - t_fwd) * 1e3
            if marks:
                pre = sum(marks[k].elapsed_time(marks[k + 1]) for k in range(0, len(marks) - 1, 2))
                row.update({"gpu_pre_hook_ms": pre, "gpu_post_hook_ms": marks[0].elapsed_time(marks[-1]) - pre})
            if sampler is not None:
                time.sleep(0.03)  # the samples of the forward's last 20 ms arrive after it
                row.update(sampler.window(t0, t_fwd))
            if not pushing:
                return row, True, ""
            _, _, stats, ok, det, t_result, d_times, _ = _recv(self.conn, o.timeout_s)
            row["overhead_ms"] = (t_result - t_fwd) * 1e3
            row["kv_on_d_ms"] = (t_result - t0) * 1e3
            row["parts"] = float(stats.get("parts", 0))
            row["d_unpack_ms_total"] = stats.get("unpack_s", 0.0) * 1e3
            # Where the tail goes: D's and P's last events, ms after the end of the forward.
            for k in ("last_part", "completed", "result"):
                if k in d_times:
                    row[f"d_{k}_ms"] = (d_times[k] - t_fwd) * 1e3
            p_res = self._released(sender, tid)
            if p_res is None:
                return row, False, det or "P never released the blocks"
            for k, v in p_res.times.as_dict().items():
                if k in ("posted", "completed"):
                    row[f"p_{k}_ms"] = (v - t_fwd) * 1e3
            row["p_pack_ms_total"] = (p_res.stats.pack_s or 0.0) * 1e3
            row["p_post_ms_total"] = (p_res.stats.post_s or 0.0) * 1e3
            return row, ok, det

        for tokens in o.lw_tokens:
            x = layer.activations(tokens)
            req_blocks = -(-tokens // o.block_size)
            # One layer's work before vLLM's hook (QKV projection and attention) and after it (o_proj + MLP).
            split = {
                "pre_hook_ms": gpu_ms(lambda x=x: layer.attention(x)),
                "post_hook_ms": gpu_ms(lambda x=x: layer.after_hook(x, layer.attention(x)))
                - gpu_ms(lambda x=x: layer.attention(x)),
                "post_hook_1gemm_ms": gpu_ms(lambda x=x: layer.after_hook_one_gemm(x)),
            }
            _log(f"layerwise {tokens:>6}: one layer {split}")
            modes = o.lw_modes
            times: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            ok_all, detail = dict.fromkeys(modes, True), dict.fromkeys(modes, "")
            # The modes take turns run by run, so a drift of the GPU's clocks over the minutes of a
            # length lands on all of them alike, in a new order each round: a run's forward depends on
            # the one before it (the power limit's controller remembers), which would favour some modes.
            order = list(modes)
            for it in range(o.lw_iters + 1):
                random.Random(o.seed * 7919 + it).shuffle(order)
                for mode in order:
                    if hasattr(s.backend, "set_stream_priority"):
                        s.backend.set_stream_priority(0 if mode == "layer_lowprio" else -1)
                    sender.cfg = default_cfg.replace(**(_mode_cfg(mode) or {}))
                    n += 1
                    row, ok, det = run(mode, f"lw-{tokens}-{mode}-{n}", req_blocks, x)
                    ok_all[mode] &= ok
                    detail[mode] = detail[mode] or det
                    if it:
                        times[mode].append(row)
            for mode in modes:
                keys = set().union(*times[mode]) - {"wall_start"}  # GPU samples may miss a short run
                med = {k: statistics.median(r[k] for r in times[mode] if k in r) for k in sorted(keys)}
                rec = {"tokens": tokens, "mode": mode, **split, **{f"median_{k}": v for k, v in med.items()}}
                rec.update({"runs": times[mode], "verified": ok_all[mode], "detail": detail[mode]})
                _log(f"layerwise {tokens:>6} {mode:>5}: {med} verified={ok_all[mode]} {detail[mode]}")
                out.append(rec)
        sender.close()
        if sampler is not None:
            sampler.close()
        return out

    def microbench(self) -> dict[str, Any]:
        """Peer copy (the goal's yardstick), one-GPU copy, and pack/unpack kernels alone."""
        torch, s, o = self.s.torch, self.s, self.s.opts
        out: dict[str, Any] = {}
        n = o.total_bytes

        def timed(fn: Any, reps: int = 20) -> float:
            for _ in range(3):
                fn()
            xs = []
            for _ in range(reps):
                sync_all()
                t = time.perf_counter()
                fn()
                sync_all()
                xs.append((time.perf_counter() - t) * 1e3)
            return statistics.median(xs)

        if s.cuda:
            d_dev = torch.device("cuda", o.d_device)

            def sync_all() -> None:
                torch.cuda.synchronize(s.device)
                torch.cuda.synchronize(d_dev)

            x = torch.randint(0, 255, (n,), dtype=torch.uint8, device=s.device)
            y = torch.empty(n, dtype=torch.uint8, device=d_dev)
            z = torch.empty(n, dtype=torch.uint8, device=s.device)
            out["peer_copy_ms"] = timed(lambda: y.copy_(x))
            out["peer_copy_equal"] = bool(torch.equal(y.to(s.device), x))
            out["local_copy_ms"] = timed(lambda: z.copy_(x))
            out["peer_access"] = bool(torch.cuda.can_device_access_peer(o.p_device, o.d_device))
            del x, y, z
        else:

            def sync_all() -> None:
                pass

            x = torch.randint(0, 255, (n,), dtype=torch.uint8)
            y = torch.empty(n, dtype=torch.uint8)
            out["peer_copy_ms"] = timed(lambda: y.copy_(x))
            out["local_copy_ms"] = out["peer_copy_ms"]
        # Kernels alone on the shuffled request: pack, then unpack of the same bytes back (identity).
        from kvpush.core.pieces import coalesce, map_pieces

        src, dst = block_ids("shuffled", o, np.random.default_rng(o.seed))
        pieces = coalesce(map_pieces(s.layout, self.d_layout, src, dst, o.tokens))[:, [0, 2]]
        backends: dict[str, Any] = {"default": s.backend}
        if s.cuda:
            from kvpush_cuda import CudaBackend

            backends["torch"] = CudaBackend(device=s.idx, kernel="torch")
        for name, be in backends.items():
            label = getattr(be, "kernel", name) if name == "default" else name
            out[f"pack_{label}_ms"] = timed(lambda be=be: be.pack(s.bases, pieces, s.staging.addr), 10)
            out[f"unpack_{label}_ms"] = timed(lambda be=be: be.unpack(s.bases, pieces, s.staging.addr), 10)
            _log(f"kernel {label}: pack {out[f'pack_{label}_ms']:.3f} ms, unpack {out[f'unpack_{label}_ms']:.3f} ms")
        ref = self.s.torch  # P's KV must be intact after pack/unpack round trips
        ok = True
        for i, t in enumerate(s.kv.values()):
            w = t.view(ref.int32)
            ok &= bool(ref.equal(w.reshape(-1), pattern_words(ref, w.numel(), i, s.device)))
        out["pack_unpack_identity_ok"] = ok
        return out


class _SideCopies:
    """The ``sim_*`` modes' side work: a layer's request bytes copied at its hook, off the forward's stream.

    The pack stand-in is a plain device copy of those bytes into a staging buffer (the gather kernel reads
    and writes as many). Every K layers, K layers' bytes of the staging buffer go to the other GPU: by P's
    copy engine on a P stream (``peer``: what UCX's cuda_ipc does for P's WRITE), or by D's copy engine on
    a D stream that waits for the layer's event (``pull``: cudaMemcpyPeerAsync issued on D).
    """

    def __init__(self, torch: Any, s: Side, o: Options) -> None:
        self.torch = torch
        self.stream = torch.cuda.Stream(device=s.device, priority=-1)
        d_dev = torch.device("cuda", o.d_device)
        self.d_stream = torch.cuda.Stream(device=d_dev, priority=-1)
        total = o.layers * 2 * o.req_blocks * o.block_bytes
        self.stage = torch.empty(total, dtype=torch.uint8, device=s.device)
        self.peer = torch.empty(total, dtype=torch.uint8, device=d_dev)
        self.p_blocks, self.layers = o.p_blocks, o.layers
        self.p_idx, self.d_idx = s.idx, o.d_device
        self._cudart: Any = None

    def _memcpy_peer_on_d(self, dst: int, src: int, n: int) -> None:
        import ctypes

        if self._cudart is None:
            for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
                try:
                    self._cudart = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
            else:
                raise OSError("sim_pull: no libcudart")
            with self.torch.cuda.device(self.d_idx):
                self._cudart.cudaDeviceEnablePeerAccess(ctypes.c_int(self.p_idx), ctypes.c_uint(0))  # may be on
        rc = self._cudart.cudaMemcpyPeerAsync(
            ctypes.c_void_p(dst),
            ctypes.c_int(self.d_idx),
            ctypes.c_void_p(src),
            ctypes.c_int(self.p_idx),
            ctypes.c_size_t(n),
            ctypes.c_void_p(self.d_stream.cuda_stream),
        )
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyPeerAsync: error {rc}")

    def layer(self, i: int, t: Any, req_blocks: int, what: str, k: int) -> None:
        torch = self.torch
        flat = t.view(-1).view(torch.uint8)
        n = flat.numel() * req_blocks // self.p_blocks
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            if "pack" in what:
                self.stage[i * n : (i + 1) * n].copy_(flat[:n], non_blocking=True)
            if (i + 1) % k and i + 1 != self.layers:
                return
            a, b = (i + 1 - ((i + 1) % k or k)) * n, (i + 1) * n
            if "peer" in what:
                self.peer[a:b].copy_(self.stage[a:b], non_blocking=True)
        if "pull" in what:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.d_stream.wait_event(ev)
            self._memcpy_peer_on_d(self.peer[a:].data_ptr(), self.stage[a:].data_ptr(), b - a)

    def wait(self) -> float:
        """When the side copies are done (host clock)."""
        self.stream.synchronize()
        self.d_stream.synchronize()
        return time.monotonic()


def _engine_row(pattern: str, mode: str, parts: int, runs: list[tuple[Any, ...]]) -> dict[str, Any]:
    """One (pattern, order, push_parts) row from its runs ``(ms, ok, detail, D's stats, stage marks)``."""
    ms = [r[0] for r in runs]
    marks = [r[4] for r in runs]
    keys = dict.fromkeys(k for m in marks for k in m)
    stats = runs[-1][3] if runs else {}
    return {
        "pattern": pattern,
        "mode": mode,
        "parts": parts,
        "plan": str(stats.get("plan", "?")),
        "ms": ms,
        "median_ms": statistics.median(ms) if ms else float("nan"),
        "verified": all(r[1] for r in runs),
        "detail": next((r[2] for r in runs if r[2]), ""),
        "stats": stats,
        # ms after the timed start (finished: D's register call; ahead: P's KV ready; negative: before it):
        # P's and D's stage times and P's stage durations
        "timeline_median": {k: statistics.median(m[k] for m in marks if k in m) for k in keys},
    }


def _prepared(strategy: str) -> bool:
    """Whether a strategy prepares ahead: NIXL lists once per peer, piece tables while planning."""
    return strategy.startswith("pipelined") or "prepped" in strategy


def _stats_delta(prefix: str, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Copier time spent during one round, in ms (host prep, launch, GPU wait) plus uploads."""
    out = {f"{prefix}{k[:-2]}_ms": (after[k] - before.get(k, 0.0)) * 1e3 for k in after if k.endswith("_s")}
    for k in ("uploads", "prepared_calls"):
        if k in after:
            out[f"{prefix}{k}"] = after[k] - before.get(k, 0.0)
    return out


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
        p = PDriver(side, conn)
        p.connect()
        _log(f"P and D connected; request {opts.total_bytes >> 20} MiB, layout order {side.layout.order}")
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
                _log(f"engine phase failed:\n{eng_error}")
        if opts.lw_tokens:
            try:
                lw = p.layerwise()
            except Exception:
                eng_error += traceback.format_exc()
                _log(f"layer-wise phase failed:\n{eng_error}")
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


def timeline_rows(res: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """Each engine row's median stage times (ms after its start), labelled, for ``stages``; parts 0 is the
    cost model's choice."""
    rows = []
    for e in res.get("engine") or []:
        marks = {k: v for k, v in e.get("timeline_median", {}).items() if not k.endswith("_ms")}
        parts = e["parts"] or f"auto({len(stages.parts_of(marks))})"
        rows.append((f"{e['pattern']} {e['mode']} parts={parts} ({e['plan']}) {e['median_ms']:.2f} ms", marks))
    return rows


def summarize(opts: Options, res: dict[str, Any]) -> dict[str, Any]:
    """Attach ratios to peer copy and build the printed table."""
    peer = res["micro"]["peer_copy_ms"]
    gb = opts.total_bytes / 1e9
    rows = [("peer copy", "-", 1, peer, True)]
    for r in res["raw_write"]:
        rows.append(("raw WRITE", f"{r['descriptors']} descs", r["descriptors"], r["median_ms"], r["verified"]))
    for c in res["cases"]:
        c["x_peer_copy"] = c["median_ms"] / peer
        c["gbps"] = gb / (c["median_ms"] / 1e3)
        # Planning (block ids -> pieces/descriptors) can run before the KV is ready: shown apart.
        c["median_ms_excl_plan"] = c["median_ms"] - c["breakdown"].get("plan_ms", 0.0)
        c["x_peer_copy_excl_plan"] = c["median_ms_excl_plan"] / peer
        rows.append((c["pattern"], c["strategy"], c["descriptors"], c["median_ms"], c["verified"]))
    for e in res["engine"]:
        e["x_peer_copy"] = e["median_ms"] / peer
        label = f"eng:{e.get('mode', 'finished')}/{e.get('parts', 1)}:{e['plan']}"
        rows.append((e["pattern"], label, int(e["stats"].get("descriptors", 0)), e["median_ms"], e["verified"]))
    ahead = {(e["pattern"], e["parts"]): e["median_ms"] for e in res["engine"] if e.get("mode") == "ahead"}
    for e in res["engine"]:
        if e.get("mode") == "finished" and (e["pattern"], e["parts"]) in ahead:
            e["x_ahead"] = e["median_ms"] / ahead[(e["pattern"], e["parts"])]
    plan = {(c["pattern"], c["strategy"]): c["breakdown"].get("plan_ms", 0.0) for c in res["cases"]}
    head = f"{'pattern':>12} {'strategy':>16} {'descs':>8} {'median ms':>10} {'GB/s':>8} {'x peer':>7}"
    lines = [f"{head} {'plan ms':>8} {'x peer w/o plan':>15} ok"]
    for pat, strat, nd, ms, ok in rows:
        p = plan.get((pat, strat), 0.0)
        lines.append(
            f"{pat:>12} {strat:>16} {nd:>8} {ms:>10.3f} {gb / (ms / 1e3):>8.1f} {ms / peer:>7.2f} "
            f"{p:>8.3f} {(ms - p) / peer:>15.2f} {ok}"
        )
    for e in res["engine"]:
        if "x_ahead" in e:
            lines.append(
                f"{e['pattern']:>12} finished/ahead, {e['parts']} parts: {e['median_ms']:.3f} / "
                f"{ahead[(e['pattern'], e['parts'])]:.3f} ms = {e['x_ahead']:.2f}x"
            )
    lw = res.get("layerwise") or []
    if lw:
        # +ms: D's result after the end of the run's own forward (the transfer's tail); /whole: that tail
        # over the whole-request push's (the goal: <= 0.1); fwd: the run's forward, to compare
        # with none's (a push that slowed the forward would add that to TTFT too).
        # ttft: D's result - the start of the forward, less none's forward (what TTFT gains, all told).
        present = list(dict.fromkeys(r["mode"] for r in lw))
        pushing = [m for m in present if m not in ("none", "whole") and _sim_mode(m) is None]
        head = [f"{'tokens':>7} {'fwd ms':>7} {'whole +ms':>9} {'fwd':>7} {'ttft':>6}"]
        head += [f"{m + ' +ms':>15} {'/whole':>6} {'fwd':>7} {'ttft':>6}" for m in pushing]
        lines += ["", " ".join(head) + " ok"]
        by = {(r["tokens"], r["mode"]): r for r in lw}
        for tokens in sorted({r["tokens"] for r in lw}):
            if not all((tokens, m) in by for m in ("none", "whole", *pushing)):
                continue
            wh, base = by[(tokens, "whole")], by[(tokens, "none")]["median_forward_ms"]
            for m in ("whole", *pushing):
                by[(tokens, m)]["ttft_added_ms"] = by[(tokens, m)]["median_kv_on_d_ms"] - base
            cells = [f"{tokens:>7} {base:>7.2f}"]
            cells.append(
                f"{wh['median_overhead_ms']:>9.3f} {wh['median_forward_ms']:>7.2f} {wh['ttft_added_ms']:>6.2f}"
            )
            for m in pushing:
                r = by[(tokens, m)]
                r["over_whole"] = r["median_overhead_ms"] / wh["median_overhead_ms"]
                cells.append(
                    f"{r['median_overhead_ms']:>15.3f} {r['over_whole']:>6.3f} {r['median_forward_ms']:>7.2f} "
                    f"{r['ttft_added_ms']:>6.2f}"
                )
            ok = all(by[(tokens, m)]["verified"] for m in ("none", "whole", *pushing))
            lines.append(" ".join(cells) + f" {ok}")
        # Where a forward's time goes (GPU events around vLLM's hook), and the sim_* modes' side copies.
        if any("median_gpu_pre_hook_ms" in r for r in lw):
            cols = ("fwd ms", "+ vs none", "GPU pre", "GPU post", "sim tail")
            lines += ["", f"{'tokens':>7} {'mode':>13} " + " ".join(f"{c:>9}" for c in cols)]
            nan = float("nan")
            for r in lw:
                base = by.get((r["tokens"], "none"), {}).get("median_forward_ms", nan)
                keys = ("gpu_pre_hook_ms", "gpu_post_hook_ms", "sim_tail_ms")
                vals = [r["median_forward_ms"], r["median_forward_ms"] - base]
                vals += [r.get(f"median_{k}", nan) for k in keys]
                lines.append(f"{r['tokens']:>7} {r['mode']:>13} " + " ".join(f"{v:>9.2f}" for v in vals))
    res["table"] = lines
    return res


def plot(res: dict[str, Any], path: str) -> None:
    """Bars of median time per (pattern, strategy), log scale, peer copy as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib missing: no plot")
        return
    labels = [f"{c['pattern']} {c['strategy']}" for c in res["cases"]]
    labels += [f"{e['pattern']} eng:{e.get('mode', 'finished')}/{e.get('parts', 1)}:{e['plan']}" for e in res["engine"]]
    vals = [c["median_ms"] for c in res["cases"]] + [e["median_ms"] for e in res["engine"]]
    fig, ax = plt.subplots(figsize=(max(8, len(vals) * 0.45), 5.5))
    ax.bar(range(len(vals)), vals, color="tab:blue")
    ax.axhline(res["micro"]["peer_copy_ms"], color="tab:red", ls="--", label="peer copy")
    ax.axhline(1.5 * res["micro"]["peer_copy_ms"], color="tab:orange", ls=":", label="1.5x peer copy (goal)")
    ax.set_yscale("log")
    ax.set_ylabel("ms, P ready -> D in place (median)")
    ax.set_xticks(range(len(vals)), labels, fontsize=7, rotation=60, ha="right")
    ax.legend()
    ax.set_title(f"{res['config']['tokens']} tokens, {res['config']['total_bytes'] >> 20} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_layerwise(res: dict[str, Any], path: str) -> None:
    """By prompt length: what each mode leaves after P's forward (left), and what it adds to the time
    from the forward's start to KV on D over the no-transfer forward (right; forward slowdowns count
    there), each with the goal (10% of the whole-request push's tail)."""
    lw = res.get("layerwise") or []
    if not lw:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({r["tokens"] for r in lw})
    by = {(r["tokens"], r["mode"]): r for r in lw}
    goal = [0.1 * by[(t, "whole")]["median_overhead_ms"] if (t, "whole") in by else float("nan") for t in tokens]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (
        ("median_overhead_ms", "ms from the end of P's forward to KV on D"),
        ("ttft_added_ms", "ms added: KV on D - no-transfer forward"),
    )
    # The pushing modes this run measured (the sim_* modes push nothing to D).
    modes = [m for m in dict.fromkeys(r["mode"] for r in lw) if m != "none" and _sim_mode(m) is None]
    colors = dict(zip(modes, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for mode in modes:
            if mode == "layer_1gemm" and key == "ttft_added_ms":
                continue  # a different forward (one GEMM after the hook): not comparable with none's
            vals = [by.get((t, mode), {}).get(key, float("nan")) for t in tokens]
            ax.plot(tokens, vals, marker="o", label=mode, color=colors.get(mode))
        ax.plot(tokens, goal, ls=":", color="black", label="goal: 10% of whole's tail")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"{label} (median)", fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"layer-wise push, {res['config']['layers']} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv: list[str] | None) -> tuple[Options, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    unknown = sorted(m for m in lw_modes if not _known_mode(m))
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


def main(argv: list[str] | None = None) -> int:
    from kvpush_tools.demo.servers import export_temp_keys

    opts, a = parse(argv)
    import kvpush

    _log(f"options: {opts}")
    _log(f"kvpush from {os.path.dirname(kvpush.__file__)}, protocol v{kvpush.PROTOCOL_VERSION}")
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
