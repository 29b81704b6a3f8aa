"""The two processes of ``kvpush bench post``: D (its cache, its agent, the check of a WRITE's bytes once its
notification arrived) and P (each way of building and posting the same direct WRITE), and the driver's handle
on one (:class:`Proc`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvpush_tools.bench.post_shape import Shape, make_layout, vllm_ids, vllm_rows


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


class Proc:
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
