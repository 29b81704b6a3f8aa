"""The CI lanes' interpreters (``.ci/lanes``, made by ``bash .ci/lane install NAME``), for tests that run one
side of a pair on another vLLM or NIXL version."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.spawn as mp_spawn
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lane_python(name: str) -> str | None:
    """The interpreter of CI lane ``name`` (``.ci/lane python NAME``), or None when it is not installed."""
    out = subprocess.run(["bash", str(ROOT / ".ci/lane"), "python", name], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.access(path, os.X_OK) else None


def version_of(python: str, dist: str) -> str:
    """The version of distribution ``dist`` installed for interpreter ``python``."""
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def spawning_with(python: str) -> Iterator[None]:
    """While inside, ``multiprocessing`` spawns its processes with ``python`` and that interpreter's own
    ``sys.path`` (spawn otherwise hands a child the parent's path, whose packages are another version's),
    plus this directory for the worker's module."""
    code = "import json, sys; print(json.dumps(sys.path))"
    path = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)
    path = [str(Path(__file__).parent), *path]
    old_exe, old_prep = mp_spawn.get_executable(), mp_spawn.get_preparation_data

    def preparation(name: str) -> dict[str, Any]:
        data = old_prep(name)
        data["sys_path"] = path
        return data

    mp_spawn.set_executable(python)
    mp_spawn.get_preparation_data = preparation
    try:
        yield
    finally:
        mp_spawn.set_executable(old_exe)
        mp_spawn.get_preparation_data = old_prep


def network_device() -> str | None:
    """The interface of this host's default route (``/proc/net/route``), or None without one: UCX of two
    NIXL versions on one host meets over it only (not over loopback or shared memory)."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    return next((f[0] for f in (line.split() for line in lines) if len(f) > 1 and f[1] == "00000000"), None)


def ucx_over_network() -> pytest.MonkeyPatch:
    """``UCX_NET_DEVICES`` set to the default route's interface for the processes started from now on (the
    returned patch's ``undo`` restores it); skips the caller where the host has no default route."""
    device = network_device()
    if device is None:
        pytest.skip("no default route: UCX of two NIXL versions meets over a network device only")
    mp = pytest.MonkeyPatch()
    mp.setenv("UCX_NET_DEVICES", device)
    return mp
