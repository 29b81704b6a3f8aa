"""The real vLLM servers the end-to-end tests share: P and D behind the router, and a plain server.

Starting a vLLM server costs one to five minutes on this 2-core machine, so
``test_e2e_vllm`` and ``test_e2e_metrics`` use one set of servers per pytest
session (``tests/conftest.py`` holds the fixtures) instead of a pair each.
The servers are configured for both files at once:

* P and D run kvpush with ``KVPUSH_LOG_LEVEL=DEBUG`` (the per-transfer
  timeline lines ``test_e2e_metrics`` joins);
* P is launched the way vLLM's ``NixlPushConnector`` P is (the benchmark's
  vllm-push stack): vLLM's ``kv_transfer_config`` with only the connector's
  name (and module) changed, its side channel from
  ``VLLM_NIXL_SIDE_CHANNEL_PORT``, a fixed NIXL engine id
  (:data:`P_ENGINE_ID`), so routers written for vLLM drive it unchanged;
* D declares a silent P dead after 5 s (3 s gave false positives on a
  loaded 2-core machine) and prefills locally when a transfer fails
  (``kv_load_failure_policy=recompute``; the fault cases of ``test_e2e_vllm``);
* every server is a ``fast_start`` one (one process import fewer per start);
* the plain, non-disaggregated server that ``test_e2e_vllm`` compares
  outputs with starts only when a collected test asks for it, so
  ``pytest tests/e2e/test_e2e_metrics.py`` alone starts two servers, not three;
* likewise the announcing P and D (``AnnouncingPair``: vllm-router's
  concurrent mode, then the second P and D of the fleet fault tests, both in
  ``test_e2e_concurrent_router``): started with the others when a collected
  test asks for them (a server start costs about as much alone as beside the
  others), stopped by that module when it ends.

Tests therefore must not assume a fresh pair: they measure deltas of
counters, and pick out their own transfers by id, since other tests may
have used the servers before them. A test that breaks a server (kills P,
say) must call :meth:`E2EServers.restart` before it returns; as a safety
net every module checks the servers at its start and restarts them when one
is dead or unhealthy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.transport.key_set import ENV_DIR
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
P_ENGINE_ID = "kvpush-e2e-prefill"


def vllm_style_kvpush_config(role: str, engine_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """vLLM's ``NixlPushConnector`` configuration (``kvpush_tools.demo.servers``) with kvpush's connector named."""
    cfg = srv.vllm_nixl_transfer_config("KVPushConnector", role, engine_id=engine_id)
    cfg["kv_connector_module_path"] = "kvpush.integrations.vllm.connector"
    cfg["kv_connector_extra_config"] = {**cfg["kv_connector_extra_config"], **extra}
    return cfg


def model_dir() -> str:
    """The tiny model, built once under ``KVPUSH_MODEL_DIR`` (default ``models/`` in the repository)."""
    root = Path(os.environ.get("KVPUSH_MODEL_DIR", ROOT / "models"))
    return str(make_tiny_model(root / "tiny-qwen3"))


def announcing_config(role: str, kv_port: int, http_port: int, discovery: int, keys: str) -> dict[str, Any]:
    """kvpush announcing itself to vllm-router's service discovery (``discovery``); D as the session's D is,
    since it is also the fleet's second D: a silent P dead after 5 s, a failed transfer prefilled locally."""
    extra: dict[str, Any] = {"proxy_ip": "127.0.0.1", "proxy_ping_port": discovery, "http_port": http_port}
    if role == "kv_producer":
        # vllm-router's concurrent mode carries no capability (nobody holds the P fleet's key there): P accepts
        # registrations without one (docs/security.md, "Routers that cannot pass it").
        return srv.kvpush_transfer_config(role, kv_port, auth_keys_dir=keys, capability="optional", **extra)
    cfg = srv.kvpush_transfer_config(role, kv_port, auth_keys_dir=keys, peer_dead_s=5.0, **extra)
    return {**cfg, "kv_load_failure_policy": "recompute"}


@dataclass
class AnnouncingPair:
    """A P and a D that announce themselves to ``discovery`` and share the session's key set (so they pair
    with the session's P and D too); P's side channel at ``kv_port``. A test that restarts one replaces it here."""

    p: launcher.ServerProcess
    d: launcher.ServerProcess
    kv_port: int
    discovery: int

    @classmethod
    def build(cls, servers: E2EServers) -> AnnouncingPair:
        """The pair, not yet started (P's timeline at DEBUG, as the session's)."""
        p_port, d_port, kv_port, discovery = (launcher.free_port() for _ in range(4))
        logs, keys, model = servers.logs, servers.keys, servers.model
        p = srv.vllm_server(
            "prefill-announcing",
            model,
            p_port,
            log_dir=logs,
            cpus=servers.cpus_p,
            kv_transfer_config=announcing_config("kv_producer", kv_port, p_port, discovery, keys),
            check_ports=(kv_port,),
            env={"KVPUSH_LOG_LEVEL": "DEBUG"},
            fast_start=True,
        )
        d = srv.vllm_server(
            "decode-announcing",
            model,
            d_port,
            log_dir=logs,
            cpus=servers.cpus_d,
            kv_transfer_config=announcing_config("kv_consumer", 0, d_port, discovery, keys),
            fast_start=True,
        )
        return cls(p, d, kv_port, discovery)


class E2EServers:
    """P, D and the router (always), the plain reference server (on demand).

    ``start``/``stop``/``restart`` own the processes; the URLs change on a
    restart (fresh ports), so fixtures read them at each module's start.
    """

    def __init__(self, logs: Path, progress: Callable[[str], None] = print) -> None:
        self.model = model_dir()
        self.logs = logs
        self.progress = progress
        cpus = ("0", "1") if (os.cpu_count() or 1) > 1 else ("0", "0")
        self.cpus_p, self.cpus_d = cpus  # the plain server shares P's core: it is idle while P works
        self.pair: list[launcher.ServerProcess] = []
        self.router: launcher.ServerProcess | None = None
        self.single: launcher.ServerProcess | None = None
        self.announcing: AnnouncingPair | None = None
        self.kv_port = 0
        self.keys = ""  # the side channel's key set P and D share (families pairing with them use it too)
        self.restarts = 0

    # -- what the tests read ---------------------------------------------------

    @property
    def p(self) -> str:
        return self.pair[0].url

    @property
    def d(self) -> str:
        return self.pair[1].url

    @property
    def router_url(self) -> str:
        assert self.router is not None, "servers not started"
        return self.router.url

    @property
    def p_kv(self) -> tuple[str, int]:
        """P's kvpush side channel (for requests sent to D directly)."""
        return ("127.0.0.1", self.kv_port)

    # -- lifecycle --------------------------------------------------------------

    def _single_server(self) -> launcher.ServerProcess:
        return srv.vllm_server(
            "single", self.model, launcher.free_port(), log_dir=self.logs, cpus=self.cpus_p, fast_start=True
        )

    def start(self, with_single: bool, with_announcing: bool = False) -> None:
        """Start P, D (and the plain server, and the announcing pair) in parallel, then the router; raises
        ``ServerError``."""
        p_port, d_port, router_port, self.kv_port = (launcher.free_port() for _ in range(4))
        debug = {"KVPUSH_LOG_LEVEL": "DEBUG"}
        keys = self.keys = srv.temp_keys()
        self.pair = [
            srv.vllm_server(
                "prefill",
                self.model,
                p_port,
                log_dir=self.logs,
                cpus=self.cpus_p,
                kv_transfer_config=vllm_style_kvpush_config("kv_producer", P_ENGINE_ID),
                check_ports=(self.kv_port,),
                # vLLM's configuration untouched: the key set comes from the environment, as a drop-in would
                env={**debug, **srv.vllm_nixl_env(self.kv_port), ENV_DIR: keys},
                fast_start=True,
            ),
            srv.vllm_server(
                "decode",
                self.model,
                d_port,
                log_dir=self.logs,
                cpus=self.cpus_d,
                kv_transfer_config={
                    **srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys, peer_dead_s=5.0),
                    "kv_load_failure_policy": "recompute",
                },
                env=debug,
                fast_start=True,
            ),
        ]
        self.single = self._single_server() if with_single else None
        self.router = srv.router_server(
            ["--prefill", self.p, "--prefill-kv", f"127.0.0.1:{self.kv_port}", "--decode", self.d],
            router_port,
            log_dir=self.logs,
            keys=keys,
        )
        self.announcing = AnnouncingPair.build(self) if with_announcing else None
        extra = [self.announcing.p, self.announcing.d] if self.announcing else []
        vllm = [*self.pair, *([self.single] if self.single else []), *extra]
        for s in vllm:
            s.start()
        launcher.wait_all_healthy(vllm, timeout=900, progress=self.progress)
        self.router.start()
        launcher.wait_all_healthy([self.router], timeout=60)

    def ensure_single(self) -> str:
        """The plain server's URL, starting it now if the session did not (it is then not in parallel)."""
        if self.single is None:
            self.single = self._single_server().start()
            launcher.wait_all_healthy([self.single], timeout=900, progress=self.progress)
        return self.single.url

    def ensure_announcing(self) -> AnnouncingPair:
        """The announcing pair, starting it now if the session did not (it is then not in parallel)."""
        if self.announcing is None:
            self.announcing = AnnouncingPair.build(self)
            for s in (self.announcing.p, self.announcing.d):
                s.start()
            launcher.wait_all_healthy([self.announcing.p, self.announcing.d], timeout=900, progress=self.progress)
        return self.announcing

    def stop_announcing(self) -> None:
        if self.announcing is not None:
            launcher.stop_all([self.announcing.p, self.announcing.d])
            self.announcing = None

    def broken(self) -> list[str]:
        """Names of servers that died, or did not answer ``/health`` three times in a row.

        Three tries of 10 s: a busy server on this loaded machine can be slow
        to answer once, and a needless restart costs minutes.
        """
        procs = [*self.pair, *([self.router] if self.router else []), *([self.single] if self.single else [])]
        return [s.name for s in procs if not (s.alive and any(s.healthy(timeout=10.0) for _ in range(3)))]

    def restart(self) -> None:
        """Stop everything and start it again (fresh ports): for a test that broke a server."""
        with_single, with_announcing = self.single is not None, self.announcing is not None
        self.stop()
        self.restarts += 1
        self.start(with_single, with_announcing)

    def ensure_up(self) -> None:
        """Restart when a server is dead or unhealthy (a test before this module broke it)."""
        bad = self.broken()
        if bad:
            self.progress(f"e2e servers {bad} are down; restarting all of them")
            self.restart()

    def stop(self) -> None:
        procs = [*self.pair, *([self.single] if self.single else []), *([self.router] if self.router else [])]
        launcher.stop_all(procs)
        self.stop_announcing()
        self.pair, self.router, self.single = [], None, None
