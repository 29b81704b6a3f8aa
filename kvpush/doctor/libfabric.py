"""LIBFABRIC's part of ``kvpush doctor``: the libfabric NIXL's plugin loads, its providers, and what else it links.

NIXL's LIBFABRIC plugin needs a libfabric defining the newest symbol version it
links (``FABRIC_1.10`` from NIXL 1.5, ``FABRIC_1.7`` before; read from the
plugin), hwloc (``libhwloc.so.15``) and, because the wheels build it with CUDA,
the NVIDIA driver's ``libcuda.so.1`` and the wheel's CUDA runtime, even for
host memory. Which provider it then uses is its own rule: cxi, else efa, else
the first tcp domain, else sockets (shm and the others are never chosen).
Each finding here is read from the host (the loader's resolution,
the library's version nodes, ``fi_getinfo`` in a child process), not assumed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

LIBFABRIC_VERSION_NODE = b"FABRIC_1.10"
"""The newest libfabric symbol version a NIXL LIBFABRIC plugin links (1.5's); older plugins link older ones."""
STANDIN_MARK = b"kvpush_cuda_standin\0"
"""Exported by kvpush's CPU stand-in for ``libcuda.so.1`` (tests/helpers/native/cuda_standin.c)."""
PLUGIN_ORDER = ("cxi", "efa", "tcp", "sockets")
"""Providers NIXL's LIBFABRIC plugin uses, in its order of preference (src/utils/libfabric)."""
FI_MSG, FI_RMA, FI_HMEM = 1 << 1, 1 << 2, 1 << 47
FI_EP_RDM = 3


def has_version_node(lib: Path, node: bytes = LIBFABRIC_VERSION_NODE) -> bool:
    """Whether a shared library defines symbol version ``node`` (its name is in the dynamic string table)."""
    try:
        return node + b"\0" in lib.read_bytes()
    except OSError:
        return False


def required_node(plugin: Path) -> bytes:
    """The newest libfabric symbol version ``plugin`` names (``FABRIC_1.7``, ``FABRIC_1.10``), read from its
    dynamic string table: what the libfabric it loads must define. ``LIBFABRIC_VERSION_NODE`` where it names
    none or cannot be read."""
    try:
        found = re.findall(rb"FABRIC_1\.(\d+)\0", plugin.read_bytes())
    except OSError:
        found = []
    return b"FABRIC_1.%d" % max(int(m) for m in found) if found else LIBFABRIC_VERSION_NODE


def is_cuda_standin(lib: str | Path | None) -> bool:
    """Whether ``lib`` is kvpush's CPU stand-in for the CUDA driver, not a driver."""
    if not lib:
        return False
    try:
        return STANDIN_MARK in Path(lib).read_bytes()
    except OSError:
        return False


def nvidia_present(root: Path = Path("/")) -> bool:
    """An NVIDIA kernel driver or device is on this host."""
    return (root / "proc/driver/nvidia").exists() or any((root / "dev").glob("nvidia[0-9]*"))


def explain_deps(
    deps: dict[str, str | None], node_bytes: bytes = LIBFABRIC_VERSION_NODE
) -> tuple[list[str], list[str], dict[str, Any]]:
    """(reasons, fixes, details) for the LIBFABRIC plugin's libraries as the loader resolves them; ``node_bytes``:
    the libfabric symbol version the plugin needs (:func:`required_node`)."""
    reasons: list[str] = []
    fixes: list[str] = []
    fab = deps.get("libfabric.so.1", "absent") if deps else "absent"
    node = node_bytes.decode()
    if "libfabric.so.1" in deps and fab is None:
        reasons.append(
            "libfabric is not installed where the loader looks (libfabric.so.1 not found); the plugin needs "
            f"a libfabric with symbol version {node}"
        )
        fixes.append(
            "on an EFA host install the AWS EFA software (aws-efa-installer), which puts a recent libfabric in "
            "/opt/amazon/efa/lib, and add that directory to LD_LIBRARY_PATH; do not install the distribution's "
            "libfabric1/rdma-core packages instead (too old here, and they break UCX agents); to test without "
            "EFA, build libfabric's tcp provider (kvpush's repository: tools/libfabric/setup.sh)"
        )
    elif isinstance(fab, str) and fab != "absent" and not has_version_node(Path(fab), node_bytes):
        reasons.append(f"the libfabric the loader finds ({fab}) is too old: it lacks symbol version {node}")
        fixes.append(
            "put the EFA installer's libfabric (/opt/amazon/efa/lib) first on LD_LIBRARY_PATH, or remove the old "
            "libfabric"
        )
    cuda = deps.get("libcuda.so.1")
    details: dict[str, Any] = {"libfabric": fab, "libcuda": cuda, "cuda_standin": is_cuda_standin(cuda)}
    if "libcuda.so.1" in deps and cuda is None:
        reasons.append(
            "the plugin links the NVIDIA driver's libcuda.so.1 (NIXL's wheels build it with CUDA), even for host "
            "memory, and no NVIDIA driver is installed"
        )
        fixes.append(
            "on a GPU host install the NVIDIA driver; on a CPU-only host use a NIXL build without CUDA, or for "
            "tests kvpush's CPU stand-in (tools/libfabric/setup.sh builds it and puts it on the library path)"
        )
    missing = [lib for lib, where in deps.items() if where is None]
    hwloc = [lib for lib in missing if lib.startswith("libhwloc")]
    if hwloc:
        reasons.append(f"the plugin links hwloc ({', '.join(hwloc)}), which is not installed")
        fixes.append("install hwloc 2.x: Debian/Ubuntu libhwloc15, RHEL/Amazon Linux hwloc-libs")
    cudart = [lib for lib in missing if lib.startswith("libcudart.")]
    if cudart:
        reasons.append(f"the plugin links the CUDA runtime of its NIXL wheel ({', '.join(cudart)}), which is missing")
        fixes.append(
            "install that CUDA runtime (the CUDA toolkit, or the nvidia-cuda-runtime wheel of the same major); on a "
            "CPU-only test host kvpush's stand-in provides it (tools/libfabric/setup.sh)"
        )
    known = ("libfabric.so.1", "libcuda.so.1", "libhwloc", "libcudart.")
    others = [lib for lib in missing if not lib.startswith(known)]
    if others:
        reasons.append("the plugin also links " + ", ".join(others) + ", which this host lacks")
    return reasons, fixes, details


_PROVIDERS = r"""
import ctypes as C, json, sys
class Fab(C.Structure):
    _fields_ = [("fabric", C.c_void_p), ("name", C.c_char_p), ("prov_name", C.c_char_p)]
class Dom(C.Structure):
    _fields_ = [("domain", C.c_void_p), ("name", C.c_char_p)]
class Ep(C.Structure):
    _fields_ = [("type", C.c_int)]
class Info(C.Structure):
    pass
Info._fields_ = [("next", C.POINTER(Info)), ("caps", C.c_uint64), ("mode", C.c_uint64), ("addr_format", C.c_uint32),
    ("src_addrlen", C.c_size_t), ("dest_addrlen", C.c_size_t), ("src_addr", C.c_void_p), ("dest_addr", C.c_void_p),
    ("handle", C.c_void_p), ("tx_attr", C.c_void_p), ("rx_attr", C.c_void_p), ("ep_attr", C.POINTER(Ep)),
    ("domain_attr", C.POINTER(Dom)), ("fabric_attr", C.POINTER(Fab)), ("nic", C.c_void_p)]
lib = C.CDLL(sys.argv[1])
lib.fi_getinfo.argtypes = [C.c_uint32, C.c_char_p, C.c_char_p, C.c_uint64, C.c_void_p, C.POINTER(C.POINTER(Info))]
lib.fi_freeinfo.argtypes = [C.POINTER(Info)]
head = C.POINTER(Info)()
rc = lib.fi_getinfo((1 << 16) | 18, None, None, 0, None, C.byref(head))
out, p = [], head
while p:
    i = p.contents
    out.append([i.fabric_attr.contents.prov_name.decode(), (i.domain_attr.contents.name or b"").decode(),
                i.ep_attr.contents.type, i.caps])
    p = i.next
if head:
    lib.fi_freeinfo(head)
print("KVPUSH_FI " + json.dumps({"rc": rc, "infos": out}), flush=True)
"""


def providers(libfabric: str, timeout: float = 30.0) -> dict[str, Any]:
    """What ``fi_getinfo`` offers through ``libfabric``, read in a child process (a provider may crash).

    Returns ``{"rc": fi_getinfo's return, "rdm": {provider: [domains]}, "hmem": [providers with FI_HMEM]}``
    for the endpoints NIXL's plugin can use (reliable datagram with messages and RMA)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROVIDERS, libfabric], capture_output=True, text=True, timeout=timeout, check=False
    )
    raw = next((ln[len("KVPUSH_FI ") :] for ln in proc.stdout.splitlines() if ln.startswith("KVPUSH_FI ")), None)
    if raw is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"fi_getinfo probe exited {proc.returncode}: {' | '.join(tail)}")
    got = json.loads(raw)
    rdm: dict[str, list[str]] = {}
    hmem: set[str] = set()
    for prov, domain, ep_type, caps in got["infos"]:
        if ep_type == FI_EP_RDM and caps & FI_MSG and caps & FI_RMA:
            doms = rdm.setdefault(prov, [])
            if domain not in doms:
                doms.append(domain)
            if caps & FI_HMEM:
                hmem.add(prov)
    return {"rc": got["rc"], "rdm": rdm, "hmem": sorted(hmem)}


def plugin_choice(rdm: dict[str, list[str]]) -> tuple[str, list[str]] | None:
    """The provider and domains NIXL's plugin takes from these (its rule: one tcp/sockets domain)."""
    for prov in PLUGIN_ORDER:
        if rdm.get(prov):
            return prov, rdm[prov] if prov in ("cxi", "efa") else rdm[prov][:1]
    return None


def fi_provider_env() -> str:
    """``FI_PROVIDER`` as set here (it filters what libfabric offers), or empty."""
    return os.environ.get("FI_PROVIDER", "")
