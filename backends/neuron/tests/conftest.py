"""Fixtures: the Neuron runtime the tests run against.

Without ``KVPUSH_NRT_LIB`` in the environment, the stand-in runtime
(``standin/nrt_standin.c``) is compiled with the system C compiler into a
temporary directory and used. With it set (a trn host, pointing at the real
``libnrt.so.1``), the same tests run on the real runtime; tests that need the
stand-in's extras skip there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the helper modules, also for spawned workers

from _standin import compile_standin  # noqa: E402

_REAL = os.environ.get("KVPUSH_NRT_LIB")
# NeuronCores for (this process, push P worker, push D worker): a real runtime
# gives each process its own cores; the stand-in ignores this.
TEST_CORES = os.environ.get("KVPUSH_NEURON_TEST_CORES", "0,1,2").split(",")
if _REAL:
    os.environ.setdefault("NEURON_RT_VISIBLE_CORES", TEST_CORES[0])


@pytest.fixture(scope="session", autouse=True)
def auth_keys(kvpush_auth_keys: Path) -> Path:
    """The side-channel key set the push workers' engines find through ``KVPUSH_AUTH_KEYS_DIR``."""
    return kvpush_auth_keys


@pytest.fixture(scope="session")
def nrt_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the runtime library; exported as ``KVPUSH_NRT_LIB`` for the session and its workers."""
    path = _REAL or str(compile_standin(tmp_path_factory.mktemp("nrt")))
    os.environ["KVPUSH_NRT_LIB"] = path
    return path


@pytest.fixture(scope="session")
def is_standin(nrt_lib: str) -> bool:
    from kvpush_neuron.runtime import load_runtime

    return hasattr(load_runtime(nrt_lib)._lib, "kvpush_standin_live_tensors")


@pytest.fixture()
def standin_only(is_standin: bool) -> None:
    if not is_standin:
        pytest.skip("needs the stand-in runtime's test extras")


@pytest.fixture()
def backend(nrt_lib: str):
    from kvpush_neuron import NeuronBackend

    b = NeuronBackend(mode="direct", mem=os.environ.get("KVPUSH_NEURON_TEST_MEM", "DRAM"), lib=nrt_lib)
    yield b
    b.close()
