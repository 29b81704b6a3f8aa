"""NIXL and its plugins: is NIXL importable, does each plugin load, and if one does not, why.

A plugin is tried by starting it in a throwaway agent in a child process (a
plugin that crashes must not take the doctor with it); for one that does not
load, the reason is read from its shared library and the libraries it links,
as the loader resolves them, so the fix named is the one this host needs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.doctor import libfabric as lf
from kvpush.doctor.report import Check


def check_nixl() -> tuple[Check, str]:
    """NIXL importable; returns the check and the wheel module kvpush uses (``nixl_cu13``, …).

    It names the running NIXL version, whether kvpush starts on it (``nixl_agent.check_nixl``: fails on a
    NIXL older than supported or one whose API kvpush calls changed; a NIXL newer than tested is ok, said in
    why), and whether kvpush's LIBFABRIC handling was measured on it: the LIBFABRIC plugin changes between NIXL
    releases, and on a version nobody measured kvpush drives it with its most cautious traits
    (kvpush/core/nixl_backends.py)."""
    try:
        from kvpush.transport.nixl_agent import (
            NIXL_INSTALL,
            check_nixl,
            imports_torch,
            nixl_version,
            nixl_wheel,
            read_nixl_surface,
        )

        ver = nixl_version()
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL logs every agent and backend it creates at INFO; the findings below say what matters.
            logging.getLogger("nixl").setLevel(logging.WARNING)
    except Exception as exc:
        from kvpush.transport.nixl_agent import NIXL_INSTALL

        return Check("nixl", "NIXL", "fail", "NIXL is not importable", why=str(exc), fix=NIXL_INSTALL), ""
    from kvpush.core.nixl_backends import TESTED_NIXL, VERIFIED, verified

    wheel = nixl_wheel() or "nixl"
    where = str(Path(sys.modules[wheel].__file__ or "").parent)
    lf_ok = verified("LIBFABRIC", ver)
    lf_versions = ", ".join(sorted(VERIFIED["LIBFABRIC"]))
    verdict = check_nixl(ver, read_nixl_surface(), ("UCX",))
    details = {
        "version": ver,
        "wheel": wheel,
        "supported": not verdict.refusal,
        "tested": TESTED_NIXL.standing(ver) == "tested",
        "libfabric_verified": lf_ok,
        "libfabric_verified_on": sorted(VERIFIED["LIBFABRIC"]),
        "imports_torch": imports_torch(),
    }
    why = (
        f"kvpush's LIBFABRIC behaviour was verified on NIXL {ver}"
        if lf_ok
        else f"kvpush's LIBFABRIC behaviour was not verified on NIXL {ver} (verified on {lf_versions}): "
        "over LIBFABRIC it is driven with its most cautious traits"
    )
    if details["imports_torch"]:
        why += f"; NIXL {ver} imports torch when loaded (seconds and hundreds of MiB in every process using it)"
    if verdict.warning:
        why += f"; {verdict.warning}"
    if verdict.refusal:
        return Check(
            "nixl",
            "NIXL",
            "fail",
            f"NIXL {ver} (wheel {wheel}): kvpush does not start on it",
            why=f"{verdict.refusal}; {why}",
            fix=NIXL_INSTALL,
            details=details,
        ), where
    ok = Check("nixl", "NIXL", "ok", f"NIXL {ver} importable (wheel {wheel})", why=why, details=details)
    return ok, where


def plugin_dir(wheel_dir: str) -> Path | None:
    """Where NIXL looks for plugins: ``NIXL_PLUGIN_DIR``, else the wheel's bundled directory."""
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env:
        return Path(env)
    if not wheel_dir:
        return None
    pkg = Path(wheel_dir)
    cand = pkg.parent / f".{pkg.name}.mesonpy.libs" / "plugins"
    return cand if cand.is_dir() else None


_PROBE = r"""
import json, sys
from kvpush.transport.nixl_agent import _nixl
A, C = _nixl()
agent = A("kvpush-doctor-probe", C(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
listed = list(agent.get_plugin_list())
out = {"listed": listed, "loaded": {}}
for name in sys.argv[1:]:
    try:
        agent.create_backend(name)
        out["loaded"][name] = ""
    except Exception as exc:
        out["loaded"][name] = f"{type(exc).__name__}: {exc}"
print("KVPUSH_PROBE " + json.dumps(out), flush=True)
"""


def probe_plugins(names: Sequence[str], timeout: float = 60.0) -> dict[str, Any]:
    """Create a throwaway agent in a child process and start each plugin there.

    A child, because a plugin that crashes (or a NIXL that prints to stderr)
    must not take the doctor with it; the answer is one JSON line.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *names], capture_output=True, text=True, timeout=timeout, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("KVPUSH_PROBE "):
            return dict(json.loads(line[len("KVPUSH_PROBE ") :]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"plugin probe exited {proc.returncode}: {' | '.join(tail)}")


def ldd(path: Path) -> dict[str, str | None]:
    """Shared-library dependencies of ``path`` as the loader resolves them (None: not found)."""
    exe = shutil.which("ldd")
    if exe is None:
        return {}
    proc = subprocess.run([exe, str(path)], capture_output=True, text=True, timeout=30, check=False)
    out: dict[str, str | None] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(not found|\S+)", line)
        if m:
            out[m.group(1)] = None if m.group(2) == "not found" else m.group(2)
    return out


def dlopen_error(path: Path) -> str:
    """The dynamic loader's own error for ``path`` (empty when it loads), from a child process."""
    code = "import ctypes, sys\ntry:\n ctypes.CDLL(sys.argv[1])\nexcept OSError as e:\n print(e)"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip()


def explain_plugin(name: str, pdir: Path | None, error: str) -> tuple[str, str, dict[str, Any]]:
    """(why, fix, details) for a plugin that does not load, from its .so and its dependencies."""
    details: dict[str, Any] = {"error": error}
    if pdir is None:
        return (
            f"NIXL could not start {name} ({error}) and its plugin directory was not found",
            "set NIXL_PLUGIN_DIR to the directory holding libplugin_*.so",
            details,
        )
    so = pdir / f"libplugin_{name}.so"
    details["plugin"] = str(so)
    if not so.exists():
        return (
            f"this NIXL build has no {name} plugin (no {so.name} in {pdir})",
            f"install a NIXL build that includes {name}",
            details,
        )
    deps = ldd(so)
    missing = [lib for lib, where in deps.items() if where is None]
    details["missing_libraries"] = missing
    loader = dlopen_error(so)
    details["loader_error"] = loader
    if name == "LIBFABRIC":
        reasons, fixes, more = lf.explain_deps(deps, lf.required_node(so))
        details.update(more)
    else:
        reasons, fixes = _other_deps(missing)
    if not reasons:
        reasons.append(f"NIXL reports {error}" + (f"; the loader says: {loader}" if loader else ""))
        fixes.append("run with NIXL_LOG_LEVEL=DEBUG to see NIXL's own account")
    elif loader:
        reasons.append(f"the loader says: {loader}")
    return "; ".join(reasons), "; ".join(fixes), details


def _other_deps(missing: list[str]) -> tuple[list[str], list[str]]:
    """(reasons, fixes) for the libraries a plugin other than LIBFABRIC links and this host lacks."""
    others = [m for m in missing if m != "libfabric.so.1"]
    if not others:
        return [], []
    reasons = ["the plugin links " + ", ".join(others) + ", which this host lacks"]
    hints = []
    if any(m.startswith(("libcuda.", "libcudart.")) for m in others):
        hints.append("the NVIDIA driver/CUDA runtime (this NIXL wheel's plugin is built with CUDA)")
    if any(m.startswith("libhwloc") for m in others):
        hints.append("hwloc (libhwloc15)")
    fixes = ["install " + " and ".join(hints) + ", or use a NIXL build made for this host"] if hints else []
    return reasons, fixes


def check_plugins(names: Sequence[str], wheel_dir: str) -> list[Check]:
    """One check a plugin: ok when a throwaway agent started it, else missing with the reason and the fix."""
    try:
        probe = probe_plugins(names)
    except Exception as exc:
        return [
            Check(n, f"NIXL plugin {n}", "fail", "could not create a NIXL agent to try it", why=str(exc)) for n in names
        ]
    pdir = plugin_dir(wheel_dir)
    out: list[Check] = []
    for n in names:
        err = probe["loaded"].get(n, "not tried")
        if not err:
            out.append(Check(n, f"NIXL plugin {n}", "ok", f"{n} loads (a throwaway agent started it)"))
            continue
        why, fix, details = explain_plugin(n, pdir, err)
        details["listed_by_nixl"] = n in probe["listed"]
        out.append(Check(n, f"NIXL plugin {n}", "missing", f"{n} does not load", why=why, fix=fix, details=details))
    return out


def check_libfabric(pdir: Path | None) -> list[Check]:
    """The libfabric the LIBFABRIC plugin links here: its providers and the one the plugin will use; and a
    kvpush CUDA stand-in where a real NVIDIA driver is (a test set-up leaking onto a GPU host)."""
    so = pdir / "libplugin_LIBFABRIC.so" if pdir is not None else None
    if so is None or not so.exists():
        return []
    deps = ldd(so)
    out: list[Check] = []
    cuda, fab = deps.get("libcuda.so.1"), deps.get("libfabric.so.1")
    standin = lf.is_cuda_standin(cuda)
    if standin and lf.nvidia_present():
        out.append(
            Check(
                "cuda-standin",
                "CUDA driver for LIBFABRIC",
                "fail",
                f"the plugin resolves libcuda.so.1 to kvpush's CPU stand-in ({cuda}) on a host with an NVIDIA driver",
                why="a CPU test set-up's library path is in effect here: the plugin could not use the GPU",
                fix=f"remove {Path(str(cuda)).parent} from LD_LIBRARY_PATH",
            )
        )
    if fab:
        out.append(_providers_check(fab, standin))
    return out


def _providers_check(fab: str, standin: bool) -> Check:
    """What ``fi_getinfo`` offers through ``fab`` and which provider (if any) NIXL's plugin takes from it."""
    title = "libfabric providers"
    try:
        found = lf.providers(fab)
    except Exception as exc:
        return Check("libfabric", title, "fail", "fi_getinfo failed in a child process", why=str(exc))
    env = lf.fi_provider_env()
    details = {"libfabric": fab, **found, "FI_PROVIDER": env, "cuda_standin": standin}
    listing = "; ".join(f"{p} ({', '.join(d)})" for p, d in found["rdm"].items()) or "none"
    choice = lf.plugin_choice(found["rdm"])
    if choice is None:
        why = f"reliable-datagram RMA providers here: {listing}" + (f"; FI_PROVIDER={env} filters them" if env else "")
        return Check(
            "libfabric",
            title,
            "missing",
            f"{fab}: no provider NIXL's plugin uses ({', '.join(lf.PLUGIN_ORDER)})",
            why=why,
            fix="on AWS attach EFA and install aws-efa-installer; unset FI_PROVIDER unless it names efa or tcp",
            details=details,
        )
    prov, domains = choice
    hmem = "with FI_HMEM" if prov in found["hmem"] else "without FI_HMEM"
    if prov not in ("efa", "cxi"):  # NIXL's plugin looks for an accelerator runtime on efa alone
        hmem += "; host memory only (device KV goes through a backend's host staging, e.g. cuda staging=host)"
    role = "" if prov in ("efa", "cxi") else "; a test transport: production runs over efa"
    stand = "; CUDA symbols from kvpush's CPU stand-in: host memory only" if standin else ""
    details["plugin_provider"], details["plugin_domains"] = prov, domains
    summary = f"the LIBFABRIC plugin will use {prov} on {', '.join(domains)}, {hmem}{role}{stand}"
    return Check("libfabric", title, "ok", summary, why=f"{fab}: {listing}", details=details)
