"""``kvpush doctor``: is this host ready to move KV, and if not, why and how to fix it.

Why a command and not a wiki page: the failures that cost operators hours on
P/D fleets are environmental (a NIXL plugin that silently is not there, a
libfabric too old for it, a missing device runtime, a busy port, clocks that
disagree) and each has a precise, checkable cause. The doctor checks each,
says what it found in plain words, and names the fix. Every check is a
``Check`` with a status:

``ok``       works;
``missing``  not available here, which is fine unless you ``--require`` it
             (LIBFABRIC on a host without EFA, CUDA on a CPU host);
``fail``     broken, or missing and required: the exit status is 1.

Checks: NIXL importable (version, wheel); each NIXL plugin (UCX, LIBFABRIC)
by creating a throwaway agent in a child process, and for one that does not
load, the reason from the plugin's shared-library dependencies; EFA devices;
installed kvpush backends and whether each is usable here; a loopback push
through every usable backend (a real ``Sender`` and ``Receiver`` with two
NIXL agents in this process), with byte verification and the measured
bandwidth; the side-channel port (``--port``); the clock offset to a P side
channel (``--peer``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpush import doctor_libfabric as lf
from kvpush.doctor_libfabric import LIBFABRIC_VERSION_NODE, has_version_node

DEFAULT_PLUGINS = ("UCX", "LIBFABRIC")
SELF_TEST_PLUGINS = ("UCX", "LIBFABRIC")
"""Plugins the self-test pushes through, each one that loads (unless ``--nixl-backend`` names one)."""
__all__ = ["LIBFABRIC_VERSION_NODE", "has_version_node"]


@dataclass
class Check:
    """One finding: ``key`` is what ``--require`` names (``nixl``, ``UCX``, ``efa``, ``host``, …)."""

    key: str
    title: str
    status: str  # "ok" | "missing" | "fail"
    summary: str
    why: str = ""
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# NIXL and its plugins.
# --------------------------------------------------------------------------- #


def check_nixl() -> tuple[Check, str]:
    """NIXL importable; returns the check and the wheel module kvpush uses (``nixl_cu13``, …)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from kvpush.transport.nixl_agent import _nixl

        _nixl()
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL logs every agent and backend it creates at INFO; the findings below say what matters.
            logging.getLogger("nixl").setLevel(logging.WARNING)
    except Exception as exc:
        return Check(
            "nixl",
            "NIXL",
            "fail",
            "NIXL is not importable",
            why=str(exc),
            fix="pip install nixl==1.5.1 (after torch, so pip does not pull a CUDA torch)",
        ), ""
    wheel = next(
        (w for w in ("nixl_cu13", "nixl_cu12", "nixl_rocm", "nixl") if f"{w}._api" in sys.modules),
        "nixl",
    )
    try:
        ver = version("nixl")
    except PackageNotFoundError:
        ver = "unknown"
    where = str(Path(sys.modules[wheel].__file__ or "").parent)
    ok = Check("nixl", "NIXL", "ok", f"NIXL {ver} importable (wheel {wheel})", details={"version": ver, "wheel": wheel})
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
    reasons: list[str] = []
    fixes: list[str] = []
    if name == "LIBFABRIC":
        why, fix, more = lf.explain_deps(deps)
        reasons += why
        fixes += fix
        details.update(more)
    else:
        others = [m for m in missing if m != "libfabric.so.1"]
        if others:
            reasons.append("the plugin links " + ", ".join(others) + ", which this host lacks")
            hints = []
            if any(m.startswith(("libcuda.", "libcudart.")) for m in others):
                hints.append("the NVIDIA driver/CUDA runtime (this NIXL wheel's plugin is built with CUDA)")
            if any(m.startswith("libhwloc") for m in others):
                hints.append("hwloc (libhwloc15)")
            if hints:
                fixes.append("install " + " and ".join(hints) + ", or use a NIXL build made for this host")
    if not reasons:
        reasons.append(f"NIXL reports {error}" + (f"; the loader says: {loader}" if loader else ""))
        fixes.append("run with NIXL_LOG_LEVEL=DEBUG to see NIXL's own account")
    elif loader:
        reasons.append(f"the loader says: {loader}")
    return "; ".join(reasons), "; ".join(fixes), details


def check_plugins(names: Sequence[str], wheel_dir: str) -> list[Check]:
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
    if not fab:
        return out
    title = "libfabric providers"
    try:
        found = lf.providers(fab)
    except Exception as exc:
        return [*out, Check("libfabric", title, "fail", "fi_getinfo failed in a child process", why=str(exc))]
    env = lf.fi_provider_env()
    details = {"libfabric": fab, **found, "FI_PROVIDER": env, "cuda_standin": standin}
    listing = "; ".join(f"{p} ({', '.join(d)})" for p, d in found["rdm"].items()) or "none"
    choice = lf.plugin_choice(found["rdm"])
    if choice is None:
        why = f"reliable-datagram RMA providers here: {listing}" + (f"; FI_PROVIDER={env} filters them" if env else "")
        out.append(
            Check(
                "libfabric",
                title,
                "missing",
                f"{fab}: no provider NIXL's plugin uses ({', '.join(lf.PLUGIN_ORDER)})",
                why=why,
                fix="on AWS attach EFA and install aws-efa-installer; unset FI_PROVIDER unless it names efa or tcp",
                details=details,
            )
        )
        return out
    prov, domains = choice
    hmem = "with FI_HMEM" if prov in found["hmem"] else "without FI_HMEM (it registers device memory as host memory)"
    role = "" if prov in ("efa", "cxi") else "; a test transport: production runs over efa"
    stand = "; CUDA symbols from kvpush's CPU stand-in: host memory only" if standin else ""
    details["plugin_provider"], details["plugin_domains"] = prov, domains
    summary = f"the LIBFABRIC plugin will use {prov} on {', '.join(domains)}, {hmem}{role}{stand}"
    out.append(Check("libfabric", title, "ok", summary, why=f"{fab}: {listing}", details=details))
    return out


# --------------------------------------------------------------------------- #
# EFA devices.
# --------------------------------------------------------------------------- #


def efa_devices(sys_root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """RDMA devices whose kernel driver is ``efa``."""
    out: list[str] = []
    if not sys_root.is_dir():
        return out
    for dev in sorted(sys_root.iterdir()):
        drv = dev / "device" / "driver"
        try:
            name = os.path.basename(os.readlink(drv))
        except OSError:
            name = ""
        if name == "efa" or (not name and dev.name.startswith("rdmap")):
            out.append(dev.name)
    return out


def check_efa() -> Check:
    devs = efa_devices()
    details: dict[str, Any] = {"devices": devs}
    fi = shutil.which("fi_info")
    if fi is not None:
        proc = subprocess.run([fi, "-p", "efa"], capture_output=True, text=True, timeout=30, check=False)
        details["fi_info_efa"] = proc.returncode == 0 and "provider: efa" in proc.stdout
    if devs:
        return Check("efa", "EFA devices", "ok", f"{len(devs)} EFA device(s): {', '.join(devs)}", details=details)
    rdma = Path("/sys/class/infiniband")
    why = "no RDMA devices at all (no /sys/class/infiniband)" if not rdma.is_dir() else "RDMA devices, none of them EFA"
    return Check(
        "efa",
        "EFA devices",
        "missing",
        "no EFA device",
        why=why + ("" if fi else "; fi_info is not installed either"),
        fix="on AWS, use an EFA-enabled instance type with EFA attached to its interface and the efa kernel "
        "driver loaded (aws-efa-installer); elsewhere use UCX",
        details=details,
    )


# --------------------------------------------------------------------------- #
# Backends.
# --------------------------------------------------------------------------- #


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
            fix = {
                "cuda": "run on a host with an NVIDIA GPU and a CUDA build of torch; use backend 'host' here",
                "neuron": "run on a Trainium/Inferentia host with aws-neuronx-runtime-lib, or point KVPUSH_NRT_LIB "
                "at libnrt.so.1",
            }.get(name, f"see the {name} backend's documentation")
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


# --------------------------------------------------------------------------- #
# Loopback self-test.
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class SelfTestGeometry:
    """The KV cache both sides of the self-test allocate (float16, NHD)."""

    layers: int = 8
    num_blocks: int = 160
    block_size: int = 16
    num_heads: int = 8
    head_dim: int = 128
    tokens: int = 1024

    @property
    def request_blocks(self) -> int:
        return -(-self.tokens // self.block_size)


def _np_cache(spec: Any, layers: int, num_blocks: int) -> dict[str, np.ndarray]:
    """Host fallback when a backend lacks ``make_test_cache``: numpy arrays in the NHD shape."""
    shape = (2, num_blocks, spec.block_size, spec.num_heads, spec.head_dim)
    return {f"layer{i}": np.zeros(shape, dtype=np.float16) for i in range(layers)}


def self_test(
    name: str,
    backend_factory: Callable[[], Any],
    nixl_backend: str = "UCX",
    geom: SelfTestGeometry = SelfTestGeometry(),
    rounds: int = 3,
    timeout: float = 60.0,
    key: str = "",
) -> Check:
    """Push ``geom.tokens`` tokens P -> D through a real Sender/Receiver pair in this process, verify, time it.

    ``key``: the check's name for ``--require`` (default ``selftest:<backend>``)."""
    from kvpush.backends.base import CacheSpec
    from kvpush.config import Config
    from kvpush.engine import PeerAddress, Receiver, Sender

    title = f"self-test push ({name} over {nixl_backend})"
    key = key or f"selftest:{name}"
    spec = CacheSpec(geom.block_size, geom.num_heads, geom.head_dim, "float16")
    p_be, d_be = backend_factory(), backend_factory()
    fallback = False
    try:
        p_kv = p_be.make_test_cache(spec, geom.layers, geom.num_blocks)
        d_kv = d_be.make_test_cache(spec, geom.layers, geom.num_blocks)
    except NotImplementedError:
        if name != "host":
            return Check(
                key,
                title,
                "missing",
                "skipped: the backend has no test-support surface (make_test_cache)",
                fix="implement the optional test-support methods (docs/backends.md)",
            )
        p_kv = _np_cache(spec, geom.layers, geom.num_blocks)
        d_kv = _np_cache(spec, geom.layers, geom.num_blocks)
        fallback = True
    rng = np.random.default_rng(7)
    per_layer = None
    for t in p_kv.values():
        data = rng.integers(0, 256, _nbytes(p_be, t, fallback), dtype=np.uint8)
        per_layer = data.size
        _write(p_be, t, data, fallback)
    for t in d_kv.values():
        _write(d_be, t, np.zeros(per_layer or 0, dtype=np.uint8), fallback)
    p_be.wait_ready(p_be.record_ready())
    cfg = Config.from_dict({"nixl_backends": [nixl_backend], "side_channel_port": 0, "model": "kvpush-doctor"})
    sender = receiver = None
    results: list[dict[str, float]] = []
    try:
        sender = Sender(cfg, p_be, p_be.describe(p_kv, spec), "doctor-p")
        receiver = Receiver(cfg, d_be, d_be.describe(d_kv, spec), "doctor-d")
        peer = PeerAddress(sender.address[0], sender.address[1], 1)
        n = geom.request_blocks
        for r in range(rounds + 1):  # round 0 pays the handshake: not timed
            pblocks = [int(b) for b in rng.choice(geom.num_blocks, n, replace=False)]
            dblocks = [int(b) for b in rng.choice(geom.num_blocks, n, replace=False)]
            tid = f"doctor-{r}"
            t0 = time.perf_counter()
            receiver.register(tid, f"d{r}", peer, [dblocks], geom.tokens)
            sender.prefill_finished(tid, f"p{r}", [pblocks], geom.tokens, p_be.record_ready())
            d_res = _wait(receiver, timeout)
            elapsed = time.perf_counter() - t0
            _wait(sender, timeout)
            if not d_res.ok:
                raise RuntimeError(f"transfer {tid} failed: {d_res.reason}")
            _verify(p_be, d_be, p_kv, d_kv, pblocks, dblocks, geom, fallback)
            if r:
                results.append({"seconds": elapsed, "bytes": float(d_res.stats.bytes)})
    except Exception as exc:
        return Check(
            key,
            title,
            "fail",
            "the loopback push failed",
            why=f"{type(exc).__name__}: {exc}",
            fix="run `pytest tests/test_push_nixl.py` for a detailed account; check the NIXL plugin above",
        )
    finally:
        for e in (receiver, sender):
            if e is not None:
                e.close()
    nbytes = results[0]["bytes"]
    best = min(r["seconds"] for r in results)
    med = sorted(r["seconds"] for r in results)[len(results) // 2]
    gbps = nbytes / best / 1e9
    return Check(
        key,
        title,
        "ok",
        f"{rounds} pushes of {nbytes / 2**20:.1f} MiB verified byte for byte; best {gbps:.2f} GB/s "
        f"({best * 1e3:.1f} ms), median {nbytes / med / 1e9:.2f} GB/s",
        details={
            "bytes": nbytes,
            "best_s": best,
            "median_s": med,
            "best_GBps": gbps,
            "verified": True,
            "numpy_fallback": fallback,
        },
    )


def _nbytes(be: Any, t: Any, fallback: bool) -> int:
    return int(t.nbytes) if fallback else int(be.read_bytes(t).size)


def _write(be: Any, t: Any, data: np.ndarray, fallback: bool) -> None:
    if fallback:
        t.view(np.uint8).reshape(-1)[:] = data
    else:
        be.write_bytes(t, data)


def _read(be: Any, t: Any, fallback: bool) -> np.ndarray:
    return t.view(np.uint8).reshape(-1).copy() if fallback else be.read_bytes(t)


def _wait(engine: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = engine.poll()
        if got:
            return got[0]
        time.sleep(0.0005)
    raise TimeoutError(f"{engine.name}: no result within {timeout:g}s")


def _verify(
    p_be: Any,
    d_be: Any,
    p_kv: dict[str, Any],
    d_kv: dict[str, Any],
    pblocks: list[int],
    dblocks: list[int],
    geom: SelfTestGeometry,
    fallback: bool,
) -> None:
    """D's registered blocks must hold P's bytes exactly (logical ``[2, blocks, ...]`` order on both)."""
    for (name, pt), dt in zip(p_kv.items(), d_kv.values(), strict=True):
        p = _read(p_be, pt, fallback).reshape(2, geom.num_blocks, -1)[:, pblocks]
        d = _read(d_be, dt, fallback).reshape(2, geom.num_blocks, -1)[:, dblocks]
        if not np.array_equal(p, d):
            bad = int(np.count_nonzero(p != d))
            raise AssertionError(f"{name}: {bad} bytes differ between P's blocks and D's after the push")


# --------------------------------------------------------------------------- #
# Port and clock.
# --------------------------------------------------------------------------- #


def check_port(host: str, port: int, tp_size: int = 1) -> Check:
    """P rank r binds ``port + r``: every one of them must be free."""
    busy: list[int] = []
    for p in range(port, port + tp_size):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, p))
            except OSError:
                busy.append(p)
    ports = f"{port}" if tp_size == 1 else f"{port}-{port + tp_size - 1}"
    if not busy:
        return Check("port", "side-channel port", "ok", f"{host}:{ports} free")
    return Check(
        "port",
        "side-channel port",
        "fail",
        f"{host}:{', '.join(map(str, busy))} already in use",
        why="another process listens there (a running P, or a previous one not yet gone)",
        fix="stop it, or choose another side_channel_port in kv_connector_extra_config (rank r uses port + r)",
    )


def measure_clock(host: str, port: int, samples: int = 8, timeout: float = 2.0) -> dict[str, float]:
    """Offset of the peer's wall clock from ours (peer - local), from the lowest-RTT time query.

    Each sample: send ``TimeQuery`` at t0, the peer answers with its clock
    ``now``, it arrives at t1; offset = now - (t0 + t1) / 2, good to ±RTT/2.
    """
    import zmq

    from kvpush import protocol

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    best: tuple[float, float] | None = None
    try:
        for seq in range(samples):
            t0 = time.time()
            sock.send(protocol.encode(protocol.TimeQuery(seq, t0)))
            while True:
                if not sock.poll(int(timeout * 1000)):
                    raise TimeoutError(f"no answer from {host}:{port} within {timeout:g}s")
                msg = protocol.decode(sock.recv())
                if isinstance(msg, protocol.TimeReply) and msg.seq == seq:
                    break
            t1 = time.time()
            rtt = t1 - t0
            if best is None or rtt < best[0]:
                best = (rtt, msg.now - (t0 + t1) / 2)
    finally:
        sock.close(linger=0)
    assert best is not None
    return {"offset_s": best[1], "rtt_s": best[0]}


def check_clock(peer: str, warn_ms: float) -> Check:
    host, _, port = peer.rpartition(":")
    try:
        m = measure_clock(host, int(port))
    except Exception as exc:
        return Check(
            "clock",
            f"clock offset to {peer}",
            "fail",
            "the peer did not answer a time query",
            why=f"{type(exc).__name__}: {exc}",
            fix="give the side channel of a running kvpush P (kv_connector_extra_config side_channel_port; "
            "rank r at port + r); a P from before time queries existed ignores them",
        )
    off_ms, rtt_ms = m["offset_s"] * 1e3, m["rtt_s"] * 1e3
    text = f"peer clock is {off_ms:+.2f} ms from ours (±{rtt_ms / 2:.2f} ms, RTT {rtt_ms:.2f} ms)"
    if abs(off_ms) - rtt_ms / 2 > warn_ms:
        return Check(
            "clock",
            f"clock offset to {peer}",
            "fail",
            text,
            why=f"more than {warn_ms:g} ms apart: timelines joined across P and D mislead by that much",
            fix="run chrony or another NTP/PTP client on both hosts (on AWS: the Amazon Time Sync Service)",
            details=m,
        )
    return Check("clock", f"clock offset to {peer}", "ok", text, details=m)


# --------------------------------------------------------------------------- #
# The command.
# --------------------------------------------------------------------------- #

_MARK = {"ok": "[ ok ]", "missing": "[ -- ]", "fail": "[FAIL]"}


def render(checks: Sequence[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{_MARK.get(c.status, '[ ?? ]')} {c.title}: {c.summary}")
        if c.why:
            lines.append(f"       why: {c.why}")
        if c.fix and c.status != "ok":
            lines.append(f"       fix: {c.fix}")
    return "\n".join(lines)


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> list[Check]:
    """All checks, in order; ``progress`` hears about each slow one before it starts."""
    say = progress or (lambda _m: None)
    checks: list[Check] = []
    say("checking NIXL ...")
    nixl, wheel_dir = check_nixl()
    checks.append(nixl)
    plugins = list(dict.fromkeys([*DEFAULT_PLUGINS, *(args.plugin or [])]))
    loaded: list[str] = []
    if nixl.status == "ok":
        say(f"starting a throwaway NIXL agent with {', '.join(plugins)} ...")
        pchecks = check_plugins(plugins, wheel_dir)
        checks += pchecks
        loaded = [c.key for c in pchecks if c.status == "ok"]
        if "LIBFABRIC" in plugins:
            say("reading libfabric's providers ...")
            checks += check_libfabric(plugin_dir(wheel_dir))
    checks.append(check_efa())
    say("loading kvpush backends ...")
    bchecks, usable = check_backends()
    checks += bchecks
    if args.self_test and nixl.status == "ok":
        vias = [args.nixl_backend] if args.nixl_backend else [p for p in SELF_TEST_PLUGINS if p in loaded]
        if not vias:
            checks.append(
                Check(
                    "selftest", "self-test push", "fail", "skipped: no NIXL plugin loads", fix="see the plugins above"
                )
            )
        from kvpush.backends.registry import load_backend

        for name, be in usable.items():
            be.close()  # the self-test makes its own P and D instances
            for i, via in enumerate(vias):
                say(f"self-test: pushing through the {name} backend over {via} ...")
                key = f"selftest:{name}" if i == 0 else f"selftest:{name}@{via}"
                checks.append(self_test(name, lambda n=name: load_backend(n), via, key=key))
    if args.port is not None:
        checks.append(check_port(args.host, args.port, args.tp_size))
    if args.peer:
        checks.append(check_clock(args.peer, args.max_skew_ms))
    return checks


def apply_requirements(checks: list[Check], required: Sequence[str]) -> list[str]:
    """Mark required checks that are not ok as failures; return requirements that match no check."""
    want = {r.lower() for r in required}
    found: set[str] = set()
    for c in checks:
        if c.key.lower() in want:
            found.add(c.key.lower())
            if c.status != "ok":
                c.status = "fail"
                c.summary += " (required)"
    return sorted(want - found)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush doctor",
        description="Check this host for kvpush: NIXL plugins, EFA, backends, a loopback push, port, clock.",
    )
    ap.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="NAME",
        help="fail (exit 1) unless NAME is ok: nixl, UCX, LIBFABRIC, efa, a backend (host, cuda, neuron), "
        "selftest:<backend> (repeatable)",
    )
    ap.add_argument("--plugin", action="append", metavar="NAME", help="also try this NIXL plugin (repeatable)")
    ap.add_argument("--nixl-backend", help="NIXL plugin for the self-test (default: UCX if it loads)")
    ap.add_argument("--no-self-test", dest="self_test", action="store_false", help="skip the loopback pushes")
    ap.add_argument("--port", type=int, help="check that this side-channel port (and port + rank) is free")
    ap.add_argument("--host", default="127.0.0.1", help="address the side channel binds to (with --port)")
    ap.add_argument("--tp-size", type=int, default=1, help="P ranks that bind port .. port + tp_size - 1")
    ap.add_argument("--peer", metavar="HOST:PORT", help="measure the clock offset to this P side channel")
    ap.add_argument("--max-skew-ms", type=float, default=5.0, help="clock offset that counts as a failure")
    ap.add_argument("--json", type=Path, help="also write the findings as JSON here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when nothing failed, 1 when a check failed (or a required one is not ok), 2 on usage errors."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.peer and (":" not in args.peer or not args.peer.rpartition(":")[2].isdigit()):
        ap.error(f"--peer wants HOST:PORT, got {args.peer!r}")
    print(f"kvpush doctor on {platform.node()} (Python {platform.python_version()}, {platform.machine()})")
    progress = None if args.quiet else (lambda m: print(f"  ... {m.removesuffix(' ...')}", flush=True))
    checks = run(args, progress)
    unknown = apply_requirements(checks, args.require)
    for u in unknown:
        checks.append(Check(u, f"requirement {u}", "fail", "no such check ran", fix="see kvpush doctor --help"))
    print(render(checks))
    failed = [c for c in checks if c.status == "fail"]
    print(
        f"\n{len(checks)} checks: {sum(c.status == 'ok' for c in checks)} ok, "
        f"{sum(c.status == 'missing' for c in checks)} not available here, {len(failed)} failed"
    )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(c) for c in checks], indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
