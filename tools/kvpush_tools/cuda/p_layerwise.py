"""P's layer-wise runs in the GPU push benchmark: a stand-in forward (a Qwen3-32B TP8 rank's layer work in vLLM's
order) with no transfer, a whole-request push after it, a layer-wise push during it by each schedule, and the
``sim_*`` side copies without kvpush; what each leaves after the forward and adds to it."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import numpy as np

from kvpush_tools.cuda.options import Options, mode_cfg, sim_mode
from kvpush_tools.cuda.p_engine import EngineDriver
from kvpush_tools.cuda.side import Side, fill_layer, log_line, recv_msg
from kvpush_tools.cuda.standin_layer import QWEN3_32B_TP8, TINY, StandInLayer


class LayerwiseDriver(EngineDriver):
    """P's driver with the layer-wise runs (they use the engine's sender, announce and release)."""

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
        other schedules (``mode_cfg``); ``sim_*`` side copies without kvpush
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
        # Modes with their own schedule (mode_cfg) change P's config between runs (P reads it when it
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
                log_line(f"no GPU samples: {exc}")

        sims = {m: sim_mode(m) for m in o.lw_modes}
        side = SideCopies(torch, s, o) if s.cuda and any(sims.values()) else None

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
                fill_layer(torch, t, i, s.device)  # vLLM writes the KV before the attention
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
            _, _, stats, ok, det, t_result, d_times, _ = recv_msg(self.conn, o.timeout_s)
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
            log_line(f"layerwise {tokens:>6}: one layer {split}")
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
                    sender.cfg = default_cfg.replace(**(mode_cfg(mode) or {}))
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
                log_line(f"layerwise {tokens:>6} {mode:>5}: {med} verified={ok_all[mode]} {detail[mode]}")
                out.append(rec)
        sender.close()
        if sampler is not None:
            sampler.close()
        return out


class SideCopies:
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
