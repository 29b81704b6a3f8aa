"""The LIBFABRIC test environment, as the tests see it: is it set up, and how a process gets its libraries.

``tools/libfabric/setup.sh --env`` builds libfabric (tcp, shm) into a cached
prefix and prints ``export KVPUSH_LIBFABRIC_PREFIX=...``; ``.ci/run`` does
that whenever the vendored tarball is there. The prefix's
``kvpush-libfabric.json`` lists the directories NIXL's LIBFABRIC plugin needs
on the loader's path (libfabric, a carried hwloc, and on hosts without an
NVIDIA driver the CUDA stand-in). Only the processes that run LIBFABRIC get
them, through :func:`spawn_env` (workers spawned meanwhile inherit
``os.environ``) or :func:`child_env` (subprocesses): the test process itself,
and with it every vLLM server, keeps the host's own libraries.

Without the variable the LIBFABRIC cases skip, saying how to set it; with it,
a LIBFABRIC that does not load fails them, so CI cannot skip silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFIX_ENV = "KVPUSH_LIBFABRIC_PREFIX"
MARKER = "kvpush-libfabric.json"
SETUP = 'eval "$(bash tools/libfabric/setup.sh --env)"'
BACKENDS = ("UCX", "LIBFABRIC")
"""The NIXL backends the multi-process tests and the conformance suite run over."""


class NotSetUp(Exception):
    """The LIBFABRIC environment is absent (skip) or broken (fail); the message says which and why."""


def marker() -> dict[str, object]:
    """The set-up script's description of the prefix; raises :class:`NotSetUp` when there is none."""
    prefix = os.environ.get(PREFIX_ENV)
    if not prefix:
        raise NotSetUp(f"LIBFABRIC test environment not set up ({PREFIX_ENV} unset); run: {SETUP}")
    path = Path(prefix) / MARKER
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise NotSetUp(f"{PREFIX_ENV}={prefix} but {path} is unreadable ({exc}); rerun: {SETUP}") from None


def library_path() -> list[str]:
    """Directories to put first on ``LD_LIBRARY_PATH`` for a LIBFABRIC process."""
    dirs = [str(d) for d in marker().get("library_path", [])]  # type: ignore[union-attr]
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        raise NotSetUp(f"{PREFIX_ENV} lists directories that are gone: {missing}; rerun: {SETUP}")
    return dirs


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the LIBFABRIC libraries first on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*library_path(), *([old] if old else [])])
    return env


@contextmanager
def spawn_env(nixl_backend: str) -> Iterator[None]:
    """While inside, processes started from this one get the libraries ``nixl_backend`` needs."""
    if nixl_backend != "LIBFABRIC":
        yield
        return
    old = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = child_env()["LD_LIBRARY_PATH"]
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = old
