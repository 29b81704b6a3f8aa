"""pytest plugin of the conformance suite (entry point ``pytest11: kvpush_conformance``).

Installed with kvpush, so it loads in every pytest run of the environment;
therefore it only adds ``--kvpush-*`` options and ``kvpush_*`` fixtures, and
imports nothing but pytest at load time. The packaged tests
(``kvpush.conformance.suite``) use the fixtures; without ``--kvpush-backend``
they skip. ``kvpush conformance --backend NAME`` runs them with the options
filled in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvpush.backends.base import Backend
    from kvpush.conformance.target import Target
    from kvpush.conformance.worker import Pair


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvpush-conformance", "kvpush backend conformance suite")
    group.addoption(
        "--kvpush-backend",
        default=None,
        metavar="NAME|module:Class",
        help="backend under test: an entry point in kvpush.backends, or module:Class",
    )
    group.addoption(
        "--kvpush-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend constructor option (repeatable; VALUE is JSON when it parses, else a string)",
    )
    group.addoption("--kvpush-devices", default="0", help="device index for P and D, or P,D (default 0)")
    group.addoption("--kvpush-nixl-backend", default="UCX", help="NIXL plugin the engines use (default UCX)")


def pytest_report_header(config: pytest.Config) -> str | None:
    backend = config.getoption("--kvpush-backend", default=None)
    return f"kvpush conformance: backend {backend}" if backend else None


@pytest.fixture(scope="session")
def kvpush_target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The backend under test, with the host prepared by its ``conformance_setup`` for this session.

    The environment it yields is set here, before any worker is spawned, so
    the workers inherit it.
    """
    spec = request.config.getoption("--kvpush-backend")
    if not spec:
        pytest.skip("no backend under test: pass --kvpush-backend NAME, or run `kvpush conformance --backend NAME`")
    from kvpush.conformance.target import Target, parse_devices, parse_options

    target = Target(
        backend=spec,
        options=parse_options(request.config.getoption("--kvpush-option")),
        devices=parse_devices(request.config.getoption("--kvpush-devices")),
        nixl_backends=tuple(request.config.getoption("--kvpush-nixl-backend").split(",")),
    )
    cls = target.backend_class()
    workdir = tmp_path_factory.mktemp("kvpush-conformance")
    with cls.conformance_setup(workdir) as env, pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        _use_key_set(mp, workdir / "keys")
        yield target


@pytest.fixture(scope="session")
def kvpush_auth_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A side-channel key set (``kvpush keys``) for the session: engines started by this process, its
    spawned workers and the servers it launches find it through ``KVPUSH_AUTH_KEYS_DIR``. A key set
    already named there is kept."""
    with pytest.MonkeyPatch.context() as mp:
        yield _use_key_set(mp, tmp_path_factory.mktemp("kvpush-keys"))


def _use_key_set(mp: pytest.MonkeyPatch, path: Path) -> Path:
    import os

    from kvpush.transport import key_set

    if os.environ.get(key_set.ENV_DIR):
        return Path(os.environ[key_set.ENV_DIR])
    key_set.make_key_set(path)
    mp.setenv(key_set.ENV_DIR, str(path))
    return path


@pytest.fixture(scope="session")
def kvpush_pair(kvpush_target: Target) -> Iterator[Pair]:
    """One P and one D worker process for every two-process case; started at once, awaited on first use."""
    from kvpush.conformance.worker import Pair

    pair = Pair(kvpush_target)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture()
def kvpush_backend(kvpush_target: Target) -> Iterator[Backend]:
    """A fresh backend instance in the test process, closed afterwards."""
    backend = kvpush_target.make()
    try:
        yield backend
    finally:
        backend.close()
