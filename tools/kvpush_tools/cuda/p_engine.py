"""P's engine runs in the GPU push benchmark: the same request through ``kvpush.engine`` with this backend, in
both orders (finished: D registers after P's prefill, as behind a sequential router; ahead: D registered while P
computes) and each ``push_parts`` (0: the cost model's choice, -1: peer copies), taking turns run by run, with
P's and D's stage times."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from kvpush_tools.bench import stages
from kvpush_tools.cuda.options import block_ids
from kvpush_tools.cuda.p_driver import PDriver
from kvpush_tools.cuda.side import log_line, recv_msg, stats_delta


class EngineDriver(PDriver):
    """P's driver with the engine's runs: a ``Sender`` per ``push_parts``, D's ``Receiver`` started to match."""

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
        recv_msg(self.conn, self.s.opts.timeout_s)
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
        recv_msg(self.conn, self.s.opts.timeout_s)  # D registered
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
                        out.append(engine_row(pattern, mode, parts, got))
                        r = out[-1]
                        log_line(
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
            _, t, stats, ok, det, _, d_times, t0 = recv_msg(self.conn, o.timeout_s)
        else:
            self._announce(sender, tid, src, dst, o.tokens)
            s.warm(o.warm_ms)
            t0 = time.monotonic()
            sender.forward_done([tid], s.backend.record_ready())
            _, _, stats, ok, det, t_result, d_times, _ = recv_msg(self.conn, o.timeout_s)
            t = (t_result - t0) * 1e3
        marks = {f"d_{k}": (v - t0) * 1e3 for k, v in d_times.items() if v >= t0}
        marks.update({k: v for k, v in stats.items() if k.startswith("d_copy_")})
        marks.update(stats_delta("p_copy_", before, s.copy_stats()))
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


def engine_row(pattern: str, mode: str, parts: int, runs: list[tuple[Any, ...]]) -> dict[str, Any]:
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
