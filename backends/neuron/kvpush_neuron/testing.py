"""The Neuron backend's test-support surface for ``kvpush conformance`` (see ``Backend``).

Test caches are ``NeuronTensor``s allocated through the runtime, and their
bytes move with ``nrt_tensor_write``/``nrt_tensor_read``: exactly how NxDI's
caches are filled and how decode would read them, so the suite checks the
backend against the runtime, not against a host shortcut.

Where no runtime is configured (``KVPUSH_NRT_LIB`` unset), the suite's setup
builds the stand-in runtime with the Neuron tests' own build helper
(``backends/neuron/tests/_standin.py``), which needs a source checkout and a C
compiler; on a trn host set ``KVPUSH_NRT_LIB`` to the real ``libnrt.so.1``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.backends.base import CacheSpec
from kvpush.backends.testing import TestSupport, cache_shape
from kvpush.core.errors import BackendError
from kvpush.core.geometry import DTYPE_BYTES
from kvpush_neuron.runtime import ENV_LIB, Placement, Runtime
from kvpush_neuron.tensor import NeuronTensor

ENV_MEM = "KVPUSH_NEURON_MEM"  # the backend's own constant, repeated: backend.py imports this module
STANDIN_HELPER = Path(__file__).resolve().parent.parent / "tests" / "_standin.py"


def build_standin(workdir: Path) -> Path:
    """Compile the stand-in runtime with the Neuron tests' helper (no second copy of the C build)."""
    if not STANDIN_HELPER.exists():
        raise BackendError(
            f"no Neuron runtime configured (KVPUSH_NRT_LIB unset) and the stand-in's build helper "
            f"{STANDIN_HELPER} is missing (installed without the source tree?): set KVPUSH_NRT_LIB to libnrt.so.1"
        )
    spec = importlib.util.spec_from_file_location("kvpush_neuron_standin_build", STANDIN_HELPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.compile_standin(workdir))


class NeuronTestSupport(TestSupport):
    """Mixed into ``NeuronBackend``: caches through the runtime, bytes through nrt_tensor_read/write."""

    runtime: Runtime

    @classmethod
    @contextmanager
    def conformance_setup(cls, workdir: Path) -> Iterator[dict[str, str]]:
        """Use ``KVPUSH_NRT_LIB`` when set; else build the stand-in and use it, registered as DRAM over UCX."""
        if os.environ.get(ENV_LIB):
            yield {}
            return
        lib = build_standin(workdir)
        # The stand-in's "device" memory is host memory: NIXL must register it as DRAM.
        yield {ENV_LIB: str(lib), ENV_MEM: os.environ.get(ENV_MEM, "DRAM")}

    def make_test_cache(self, spec: CacheSpec, num_layers: int, num_blocks: int, device: int = 0) -> dict[str, Any]:
        """Device tensors on core ``device``, shaped like vLLM-Neuron's paged cache (or NxDI's block layout)."""
        shape = cache_shape(spec, num_blocks)
        out: dict[str, Any] = {}
        try:
            for i in range(num_layers):
                out[f"layers.{i}"] = NeuronTensor(self.runtime, shape, spec.dtype, device, name=f"kvpush-test-{i}")
        except BaseException:
            self.free_test_cache(out)
            raise
        return out

    def write_bytes(self, tensor: Any, data: np.ndarray) -> None:
        """``nrt_tensor_write``: synchronous, as ``nrt_execute`` (how NxDI writes KV) is by default."""
        buf = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        if not isinstance(tensor, NeuronTensor) or buf.size != tensor.nbytes:
            raise BackendError(f"write_bytes: {buf.size} bytes for {tensor!r}")
        tensor.write_bytes(buf)

    def read_bytes(self, tensor: Any) -> np.ndarray:
        if not isinstance(tensor, NeuronTensor):
            raise BackendError(f"read_bytes: {tensor!r} is not a NeuronTensor")
        return tensor.read_bytes()

    def free_test_cache(self, kv_caches: dict[str, Any]) -> None:
        for t in kv_caches.values():
            if isinstance(t, NeuronTensor):
                t.free()

    def foreign_test_tensors(self, spec: CacheSpec, num_blocks: int, device: int = 0) -> dict[str, dict[str, Any]]:
        """Host numpy arrays, and runtime tensors in host placement: right shape, not Neuron device memory."""
        shape = cache_shape(spec, num_blocks)
        if spec.dtype not in DTYPE_BYTES:
            raise BackendError(f"unsupported dtype {spec.dtype!r}")
        np_dtype = np.dtype(f"u{DTYPE_BYTES[spec.dtype]}")
        host: dict[str, Any] = {f"layers.{i}": np.zeros(shape, np_dtype) for i in range(2)}
        pinned: dict[str, Any] = {}
        try:
            for i in range(2):
                pinned[f"layers.{i}"] = NeuronTensor(self.runtime, shape, spec.dtype, device, Placement.HOST)
        except BaseException:
            self.free_test_cache(pinned)
            raise
        return {"numpy arrays (host memory)": host, "runtime tensors in host placement": pinned}
