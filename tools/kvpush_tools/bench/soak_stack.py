"""The soak's servers: the single instance (the reference), one P and one D with kvpush's connector, kvpush's
router in front; and the restarts the faults make (kill -9 a server, start it again at the same addresses).

Configuration, as users run it: the connector's defaults but for the side channel's address and key set
(``kvpush_tools.demo.servers.kvpush_transfer_config``, as the end-to-end tests do), D with a ``fence_port``
(the operator's way to give back a dead P's blocks; the soak restarts P at its address instead, which fences
the dead one too: docs/operability.md), vLLM's default ``kv_load_failure_policy`` (a failed load fails the
request, so it shows), the tiny fp32 model. One difference from vLLM's defaults: no prefix caching on P and
D, as in the serving benchmarks, because the soak repeats a few dozen prompts and with a cache D would hold
them after the first round and every later transfer would move nothing. The router is kvpush's own (the one
the README sets up first): it sends P and D their requests at once, so D registers while P computes.

With a :class:`~kvpush_tools.bench.soak_net.Link`, P runs in the link's namespace P, at
:data:`~kvpush_tools.bench.soak_net.P_ADDR` (its HTTP port and side channel), and P's and D's UCX go over TCP
on the pair only; everything else is in namespace A with the soak.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvpush_tools.bench.soak_net import A_DEV, P_ADDR, P_DEV, Link, in_namespace, ucx_env
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv

Say = Callable[[str], None]
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
KV_CACHE_BYTES = 256 << 20
"""Each server's KV cache: 65k tokens of the tiny model (4 KiB a token), far more than the soak's requests hold
at once, and a quarter of vLLM-CPU's default here, so the soak fits beside other jobs on this shared host."""
START_S = 900.0
"""How long a vLLM server may take to come up on this loaded 2-core machine."""


class SoakStack:
    """The servers by role (``single``, ``prefill``, ``decode``, ``router``), their fixed addresses, restarts."""

    def __init__(self, model: str, logs: Path, link: Link | None, say: Say, env: dict[str, str] | None = None) -> None:
        self.model, self.logs, self.link, self.say = model, logs, link, say
        self.env = dict(env or {})
        """More environment for every vLLM server (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``: the soak's module)."""
        self.keys = srv.temp_keys()
        self.p_host = P_ADDR if link is not None else "127.0.0.1"
        self.p_http, self.p_kv, self.d_http, self.d_fence, self.r_http, self.s_http = (
            launcher.free_port() for _ in range(6)
        )
        cpus = ("0", "1") if (os.cpu_count() or 1) > 1 else ("0", "0")
        self.cpus = {"prefill": cpus[0], "decode": cpus[1], "single": cpus[0]}
        self.kv_cache = ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
        self.servers: dict[str, launcher.ServerProcess] = {}
        self.up_at: dict[str, list[float]] = {"prefill": [], "decode": []}
        """Monotonic times each of P and D became healthy again after a restart."""
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="soak-starter")
        """The one thread every server is started from. The launcher asks the kernel to stop a server whose
        launcher went away (``PR_SET_PDEATHSIG``), and the kernel ties that to the thread that forked, not the
        process: a server started from the faults' thread would be stopped when that thread ends."""

    # -- the servers ---------------------------------------------------------- #

    def make(self, role: str) -> launcher.ServerProcess:
        """A (not started) server of ``role`` at the stack's addresses for that role."""
        if role == "router":
            args = ["--prefill", self.url("prefill"), "--prefill-kv", f"{self.p_host}:{self.p_kv}"]
            return srv.router_server(
                [*args, "--decode", self.url("decode")], self.r_http, log_dir=self.logs, keys=self.keys
            )
        if role == "single":
            return srv.vllm_server(
                "single",
                self.model,
                self.s_http,
                log_dir=self.logs,
                cpus=self.cpus[role],
                env=self.env,
                extra_args=self.kv_cache,
                fast_start=True,
            )
        if role == "prefill":
            cfg = srv.kvpush_transfer_config(
                "kv_producer", self.p_kv, auth_keys_dir=self.keys, side_channel_host=self.p_host
            )
            server = srv.vllm_server(
                "prefill",
                self.model,
                self.p_http,
                host=self.p_host,
                log_dir=self.logs,
                cpus=self.cpus[role],
                kv_transfer_config=cfg,
                env={**self.env, **(ucx_env(P_DEV) if self.link else {})},
                extra_args=(*NO_PREFIX_CACHE, *self.kv_cache),
                fast_start=True,
            )
            if self.link is not None:
                server.cmd = in_namespace(self.link.p_ns, server.cmd)
                server.ports = ()  # in namespace P: nothing here can tell whether they are free there
            else:
                server.ports = (self.p_http, self.p_kv)
            return server
        if role == "decode":
            cfg = srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=self.keys, fence_port=self.d_fence)
            return srv.vllm_server(
                "decode",
                self.model,
                self.d_http,
                log_dir=self.logs,
                cpus=self.cpus[role],
                kv_transfer_config=cfg,
                env={**self.env, **(ucx_env(A_DEV) if self.link else {})},
                extra_args=(*NO_PREFIX_CACHE, *self.kv_cache),
                check_ports=(self.d_fence,),
                fast_start=True,
            )
        raise ValueError(f"no role {role!r}")

    def _spawn(self, server: launcher.ServerProcess) -> launcher.ServerProcess:
        return self._starter.submit(server.start).result()

    def url(self, role: str) -> str:
        host = self.p_host if role == "prefill" else "127.0.0.1"
        port = {"prefill": self.p_http, "decode": self.d_http, "router": self.r_http, "single": self.s_http}[role]
        return f"http://{host}:{port}"

    def pid(self, role: str) -> int | None:
        """The root pid of ``role``'s current process tree (None while it is not running)."""
        s = self.servers.get(role)
        return s.proc.pid if s is not None and s.proc is not None and s.proc.poll() is None else None

    # -- life cycle ----------------------------------------------------------- #

    def start(self, roles: Sequence[str]) -> None:
        """Start vLLM servers of ``roles`` at once (imports dominate and overlap), and the router after P and D;
        raises ``launcher.ServerError`` when one does not come up."""
        vllm = [r for r in roles if r != "router"]
        for role in vllm:
            self.servers[role] = self._spawn(self.make(role))
        self.say(f"starting {', '.join(vllm)} (minutes on this machine)")
        launcher.wait_all_healthy([self.servers[r] for r in vllm], timeout=START_S, progress=self.say, every=60)
        if "router" in roles:
            self.servers["router"] = self._spawn(self.make("router"))
            launcher.wait_all_healthy([self.servers["router"]], timeout=120)
            self.wait_router()

    def stop_single(self) -> None:
        """The reference is computed: its server's cores go back to P and D."""
        single = self.servers.pop("single", None)
        if single is not None:
            single.stop()

    def kill(self, role: str) -> None:
        """SIGKILL ``role``'s whole process group (the launcher's guard, vLLM and its engine): no goodbye to
        anyone, as a crashed host or an OOM kill."""
        s = self.servers[role]
        assert s.proc is not None, f"{role} was never started"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=60)

    def start_again(self, role: str) -> float:
        """A new server of ``role`` at the same addresses; returns once it is healthy (monotonic time)."""
        again = self.make(role)
        deadline = time.monotonic() + 30
        while again.ports and not all(launcher.port_is_free(p) for p in again.ports):
            if time.monotonic() > deadline:
                raise launcher.ServerError(f"{role}: ports {again.ports} still taken 30 s after the kill")
            time.sleep(0.5)
        self.servers[role] = self._spawn(again)
        launcher.wait_all_healthy([again], timeout=START_S, progress=self.say, every=60)
        up = time.monotonic()
        self.up_at[role].append(up)
        return up

    def router_healthy(self) -> bool:
        """The router answers ``/health`` 200: it holds a healthy P and a healthy D."""
        return self.servers["router"].healthy(timeout=3.0)

    def wait_router(self, timeout: float = 120.0) -> float:
        """Until the router is healthy (monotonic time); raises ``launcher.ServerError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.router_healthy():
            if time.monotonic() > deadline:
                raise launcher.ServerError(f"the router is not healthy {timeout:.0f} s on")
            time.sleep(0.5)
        return time.monotonic()

    def stop(self) -> None:
        """Stop every server (in parallel); never raises."""
        launcher.stop_all(list(self.servers.values()))
        self._starter.shutdown(wait=False)
