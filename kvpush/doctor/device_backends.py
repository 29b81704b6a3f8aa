"""Device backends (``kvpush.backends``): which are installed, and whether each is usable on this host.

A backend that is installed but cannot start here (CUDA on a CPU host) is
``missing``, not a failure: the same install serves hosts of every kind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvpush.doctor.report import Check

_FIXES = {
    "cuda": "run on a host with an NVIDIA GPU and a CUDA build of torch; use backend 'host' here",
    "neuron": "run on a Trainium/Inferentia host with aws-neuronx-runtime-lib, or point KVPUSH_NRT_LIB at libnrt.so.1",
}
"""What a known backend that is installed but not usable here needs."""


def backend_extra(name: str) -> dict[str, Any]:
    """What the host offers for a known backend, independent of kvpush (CUDA devices, Neuron runtime)."""
    info: dict[str, Any] = {}
    if name == "cuda":
        try:
            import torch

            info["torch"] = torch.__version__
            info["torch_cuda"] = torch.version.cuda
            info["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception as exc:  # torch missing or broken
            info["torch"] = f"not importable: {exc}"
    elif name == "neuron":
        info["KVPUSH_NRT_LIB"] = os.environ.get("KVPUSH_NRT_LIB", "")
        info["neuron_devices"] = sorted(p.name for p in Path("/dev").glob("neuron*"))
    return info


def check_backends() -> tuple[list[Check], dict[str, Any]]:
    """One check per installed backend; returns the usable instances too (for the self-test)."""
    from kvpush.backends.registry import available_backends, load_backend

    eps = available_backends()
    checks: list[Check] = []
    usable: dict[str, Any] = {}
    if not eps:
        return [
            Check("backends", "kvpush backends", "fail", "no kvpush backend is installed", fix="pip install -e .")
        ], usable
    for name in sorted(eps):
        ep = eps[name]
        details = {"entry_point": ep.value, **backend_extra(name)}
        try:
            usable[name] = load_backend(name)
        except Exception as exc:
            fix = _FIXES.get(name, f"see the {name} backend's documentation")
            checks.append(
                Check(
                    name,
                    f"backend {name}",
                    "missing",
                    "installed, not usable here",
                    why=str(exc),
                    fix=fix,
                    details=details,
                )
            )
            continue
        checks.append(Check(name, f"backend {name}", "ok", "installed and usable", details=details))
    return checks, usable
