"""One process of the GPU push benchmark: its KV cache as vLLM's layout variant allocates it, its backend (CUDA, or
host memory for a dry run), staging buffer and NIXL agent (:class:`Side`); P's data, which both processes rebuild
from a formula so D can check every byte; and the waits on D's pipe and on NIXL both sides use."""

from __future__ import annotations

import time
from typing import Any

from kvpush.core.geometry import KVGeometry
from kvpush.core.outcome import XferState
from kvpush_tools.cuda.options import Options


def pattern_words(torch: Any, n: int, salt: int, device: Any) -> Any:
    """Deterministic, position-dependent int32 words: both processes rebuild P's data exactly."""
    x = torch.arange(n, dtype=torch.int64, device=device) + salt * 1_000_003
    x = (x * 2654435761 + 97 * salt + 12345) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return (x - ((x >> 31) << 32)).to(torch.int32)


def fill_kv(torch: Any, kv: dict[str, Any], device: Any) -> None:
    """P's KV content: layer i holds ``pattern_words(..., salt=i)`` in memory order."""
    for i, t in enumerate(kv.values()):
        fill_layer(torch, t, i, device)


def fill_layer(torch: Any, t: Any, i: int, device: Any) -> None:
    w = t.view(torch.int32)
    w.copy_(pattern_words(torch, w.numel(), i, device).view(w.shape))


def make_side_kv(torch: Any, variant: str, g: KVGeometry, device: Any) -> dict[str, Any]:
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
        self.kv = make_side_kv(torch, variant, opts.geometry(role), self.device)
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


def recv_msg(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"peer process silent for {timeout}s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] in ("error", "failed"):
        raise RuntimeError(f"peer failed:\n{msg[1]}")
    return msg


def wait_notifs(agent: Any, tags: list[bytes], timeout: float, on_each: Any = None) -> tuple[float, float]:
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


def wait_xfers(agent: Any, handles: list[Any], timeout: float, release: bool = True) -> None:
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


def stats_delta(prefix: str, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Copier time spent during one round, in ms (host prep, launch, GPU wait) plus uploads."""
    out = {f"{prefix}{k[:-2]}_ms": (after[k] - before.get(k, 0.0)) * 1e3 for k in after if k.endswith("_s")}
    for k in ("uploads", "prepared_calls"):
        if k in after:
            out[f"{prefix}{k}"] = after[k] - before.get(k, 0.0)
    return out


def to_ms(seconds: float) -> float:
    return seconds * 1e3


def log_line(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
