"""The stand-in Neuron runtime: building it, and its test-only extras (fixtures and workers share these)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvpush_neuron import NeuronTensor

STANDIN_SRC = Path(__file__).parent / "standin" / "nrt_standin.c"


def compile_standin(out_dir: Path, name: str = "libnrt.so.1") -> Path:
    """Build the stand-in runtime with the system compiler (``$CC`` or ``cc``)."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.fail(f"C compiler {cc!r} not found: the Neuron backend tests build their stand-in runtime with it")
    out = out_dir / name
    cmd = [cc, "-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Werror", "-o", str(out), str(STANDIN_SRC)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"building the stand-in Neuron runtime failed:\n{' '.join(cmd)}\n{proc.stderr}")
    return out


def delayed_write(t: NeuronTensor, data: np.ndarray, delay_s: float) -> int:
    """Stand-in extra: bytes land on the 'device' after a delay, like a prefill still running."""
    fn = t.runtime.symbol("kvpush_standin_write_delayed")
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    seq = ctypes.c_uint64()
    buf = np.ascontiguousarray(data)
    st_ = fn(t.handle, buf.ctypes.data, 0, buf.nbytes, int(delay_s * 1e6), ctypes.byref(seq))
    assert st_ == 0, f"kvpush_standin_write_delayed returned {st_}"
    return int(seq.value)
