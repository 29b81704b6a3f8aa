"""A NIXL backend that does not take a memory kind is refused by name, before NIXL fails on it.

NIXL's LIBFABRIC plugin takes device memory only where it found an accelerator runtime, which it
looks for on the efa provider alone; over tcp it takes host memory only. kvpush must say so when a
device-memory backend is configured over it, not pass on NIXL's bare registration status.
"""

from __future__ import annotations

import subprocess
import sys

import helpers_libfabric as lf

CHILD = """
import sys
import numpy as np
from kvpush.backends.base import MemRegistration
from kvpush.core.errors import ConfigError
from kvpush.core.layout import MemKind
from kvpush.transport.nixl_agent import Agent

agent = Agent("kinds", [sys.argv[1]])
buf = np.zeros(1 << 16, dtype=np.uint8)
agent.register([MemRegistration(buf.ctypes.data, buf.nbytes, 0, MemKind.DRAM)])
print("DRAM registered", agent.registered)
try:
    if sys.argv[1] == "LIBFABRIC":
        agent.register([MemRegistration(buf.ctypes.data, buf.nbytes, 0, MemKind.VRAM)])
    else:  # a CPU host has no device memory to register: ask the rule alone
        agent.check_takes("VRAM")
    print("VRAM taken")
except ConfigError as exc:
    print("VRAM refused:", exc)
agent.deregister_all()
"""


def _run(backend: str) -> str:
    env = lf.child_env() if backend == "LIBFABRIC" else None
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_memory_kinds_of_a_backend(nixl_backend: str) -> None:
    out = _run(nixl_backend)
    assert "DRAM registered 1" in out
    if nixl_backend == "LIBFABRIC":
        line = next(line for line in out.splitlines() if line.startswith("VRAM"))
        assert line.startswith("VRAM refused: no NIXL backend of this agent registers VRAM memory")
        assert "LIBFABRIC takes ['DRAM_SEG']" in line and "efa" in line
    else:
        assert "VRAM taken" in out
