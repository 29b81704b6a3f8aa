"""Fixtures shared by test files: one set of vLLM servers per session (end-to-end files), and a
P and a D worker process per module (multi-process engine files).

See ``e2e_cluster.py`` for why the servers are shared and what that asks of
the tests. Nothing starts unless a collected test uses one of these fixtures,
so the unit tests pay nothing for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import helpers_libfabric as lf
import pytest
from e2e_cluster import AnnouncingPair, E2EServers
from procs import Node

from kvpush_tools.demo import launcher, servers

# Every vLLM server a test starts holds 256 MiB of KV cache, not vLLM-CPU's whole GiB: the tests' prompts need a
# few thousand tokens, and a GiB each is a large part of a server's memory, which CI's host runs many servers
# in (docs/compat.md, "CI time"). A value set outside (a larger one to debug) wins.
os.environ.setdefault(servers.KV_CACHE_BYTES_ENV, str(256 << 20))

SINGLE = "e2e_single"
ANNOUNCING = "e2e_announcing"


@pytest.fixture(scope="session", autouse=True)
def auth_keys(kvpush_auth_keys: Path) -> Path:
    """Every engine, worker and server of the session authenticates with one key set (the plugin's
    ``kvpush_auth_keys``, exported as ``KVPUSH_AUTH_KEYS_DIR``); tests of authentication make their own."""
    return kvpush_auth_keys


@pytest.fixture(scope="session")
def e2e_servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EServers]:
    """P, D and the router for the whole session, and the plain server when a collected test needs it.

    The plain server is started with the pair (in parallel, which is what
    saves time) when any selected test uses ``e2e_single``; a session that
    has none, e.g. ``pytest tests/e2e/test_e2e_metrics.py``, never starts it.
    """
    want_single = any(SINGLE in item.fixturenames for item in request.session.items)
    want_announcing = any(ANNOUNCING in item.fixturenames for item in request.session.items)
    servers = E2EServers(tmp_path_factory.mktemp("e2e-logs"))
    try:
        servers.start(with_single=want_single, with_announcing=want_announcing)
        yield servers
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def e2e_pair(e2e_servers: E2EServers) -> E2EServers:
    """The shared servers, checked (and restarted if a test before this module broke one)."""
    try:
        e2e_servers.ensure_up()
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    return e2e_servers


@pytest.fixture(scope="module")
def e2e_single(e2e_pair: E2EServers) -> str:
    """URL of the plain (non-disaggregated) vLLM server the outputs are compared with."""
    try:
        return e2e_pair.ensure_single()
    except launcher.ServerError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def e2e_announcing(e2e_pair: E2EServers) -> Iterator[AnnouncingPair]:
    """The announcing P and D (``e2e_cluster.AnnouncingPair``), started with the session's servers when a
    collected test asks for them, and stopped when the module that uses them ends."""
    try:
        yield e2e_pair.ensure_announcing()
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        e2e_pair.stop_announcing()


@pytest.fixture(scope="module", params=lf.BACKENDS)
def nixl_backend(request: pytest.FixtureRequest) -> str:
    """The NIXL backend a module's engines run over: every multi-process test runs over each.

    LIBFABRIC skips where its test environment is not set up (helpers_libfabric
    says how) and fails where it is set up but broken.
    """
    name = str(request.param)
    if name == "LIBFABRIC":
        try:
            lf.library_path()
        except lf.NotSetUp as exc:
            if lf.PREFIX_ENV in os.environ:
                pytest.fail(str(exc))
            pytest.skip(str(exc))
    return name


@pytest.fixture(scope="module")
def nodes(nixl_backend: str) -> Iterator[tuple[Node, Node]]:
    """A P and a D worker process for one test module; fails the module if an engine loop raised."""
    with lf.spawn_env(nixl_backend):
        p, d = Node("P", nixl_backend), Node("D", nixl_backend)
    try:
        p.wait_ready()
        d.wait_ready()
        assert p.call("nixl_backends") == d.call("nixl_backends") == (nixl_backend,)
        yield p, d
        crashes = p.call("crashes") + d.call("crashes")
        assert not crashes, "exceptions escaped into an engine loop:\n" + "\n".join(crashes)
    finally:
        p.stop()
        d.stop()
