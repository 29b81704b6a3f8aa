"""D's side of the GPU push benchmark: poisons its cache, waits for each case's data (a raw WRITE, a strategy's
WRITEs and unpacks, or the engine's Receiver), checks every requested block against P's and every other block
for the poison, and reports its times."""

from __future__ import annotations

import functools
import time
import traceback
from typing import Any

import numpy as np

from kvpush.transport.key_set import session_capability
from kvpush_tools.bench import stages
from kvpush_tools.cuda.options import POISON, is_prepared, strategy_chunks
from kvpush_tools.cuda.side import Side, fill_kv, make_side_kv, pattern_words, recv_msg, stats_delta, wait_notifs


class DServer:
    """D's side: poison, wait for the data, unpack, verify, report times."""

    def __init__(self, side: Side, conn: Any) -> None:

        self.s, self.conn = side, conn
        torch, o = side.torch, side.opts
        # A replica of P's KV on D, built by the same formula: the reference for torch.equal.
        self.ref = make_side_kv(torch, o.p_variant, o.geometry("P"), side.device)
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
        _, p_meta, self.p_layout = recv_msg(self.conn, o.timeout_s)
        self.peer = s.agent.add_peer(p_meta)
        self.conn.send(("ok",))
        while True:
            msg = recv_msg(self.conn, 600)
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
                _, t1 = wait_notifs(s.agent, [tag], o.timeout_s)
                words = s.staging_tensor().view(s.torch.int32)
                ok = s.torch.equal(words, pattern_words(s.torch, words.numel(), 1000, s.device))
                self.conn.send(("done", t1, {}, ok, "" if ok else "staging differs"))
            elif op == "case":
                _, strategy, tag, src, dst = msg
                self.poison()
                pieces = None
                if strategy.startswith(("staged", "pipelined")):
                    pieces = coalesce(map_pieces(self.p_layout, s.layout, src, dst, o.tokens))[:, [1, 2]]
                    if is_prepared(strategy) and hasattr(s.backend, "prepare_unpack"):
                        # D knows its pieces when it registers, long before the data comes.
                        for a, b in strategy_chunks(strategy, len(s.bases)):
                            s.backend.prepare_unpack(s.bases[a:b], pieces)
                if not strategy.endswith("_cold"):
                    s.warm(o.warm_ms)
                before = s.copy_stats()
                self.conn.send(("ready",))
                unpack_s = 0.0
                if strategy.startswith("staged"):
                    _, t_notif = wait_notifs(s.agent, [tag], o.timeout_s)
                    s.backend.unpack(s.bases, pieces, s.staging.addr)
                    unpack_s = time.perf_counter() - t_notif
                elif strategy.startswith("pipelined"):
                    spans = strategy_chunks(strategy, len(s.bases))
                    acc = [0.0]
                    tags = [tag + b":%d" % i for i in range(len(spans))]
                    on_chunk = functools.partial(self._unpack_chunk, spans, pieces, acc)
                    _, t_notif = wait_notifs(s.agent, tags, o.timeout_s, on_chunk)
                    unpack_s = acc[0]
                else:
                    _, t_notif = wait_notifs(s.agent, [tag], o.timeout_s)
                t1 = time.perf_counter()
                info = {"unpack_ms": unpack_s * 1e3, "notif_t": t_notif, **stats_delta("d_", before, s.copy_stats())}
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
        copier = stats_delta("d_copy_", before, s.copy_stats())  # before verify's own copies
        ok, detail = self.verify(src, dst) if res.ok else (False, res.reason)
        result_t = res.times.result or 0.0
        stats = {**res.stats.as_dict(), **copier}
        times = {**res.times.as_dict(), **stages.part_times(res.times, "")}
        self.conn.send(("done", (result_t - t0) * 1e3, stats, ok, detail, result_t, times, t0))
