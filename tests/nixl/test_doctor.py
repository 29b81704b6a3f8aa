"""kvpush doctor on this machine, for real: NIXL, plugins, backends, a loopback push, port, clock.

What this host is (2 CPUs, UCX, no EFA, no GPU, no Neuron runtime, a NIXL
wheel whose LIBFABRIC plugin cannot load) is what the expectations say; where
a fact depends on the host it is read from the host first (is libfabric
installed?), so the test states what the doctor must say *given* that fact.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import helpers_libfabric as lf_env
import pytest
from helpers_local_pair import local_pair

from kvpush.core.nixl_backends import verified
from kvpush.doctor import (
    LIBFABRIC_VERSION_NODE,
    SELF_TEST_GEOMETRY,
    SELF_TEST_TOKENS,
    Check,
    apply_requirements,
    check_clock,
    check_port,
    efa_devices,
    explain_plugin,
    has_version_node,
)
from kvpush.doctor.libfabric import explain_deps, is_cuda_standin, nvidia_present, required_node

ROOT = Path(__file__).resolve().parents[2]


def doctor(
    tmp: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[int, str, list[dict[str, Any]]]:
    """``kvpush doctor ARGS --json`` in a child process: (exit status, output, findings)."""
    out = tmp / "doctor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "doctor", "-q", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
        env=env,
    )
    text = proc.stdout + proc.stderr
    findings = json.loads(out.read_text()) if out.exists() else []
    return proc.returncode, text, findings


def by_key(findings: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f["key"]: f for f in findings}


def test_doctor_on_this_host(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    with local_pair() as pair:  # a live P side channel to measure the clock against
        rc, text, findings = doctor(tmp_path, "--port", str(free_port), "--peer", f"127.0.0.1:{pair.sender.address[1]}")
    f = by_key(findings)
    assert rc == 0, text
    nixl = f["nixl"]["details"]
    assert f["nixl"]["status"] == "ok" and nixl["version"] == version(nixl["wheel"].replace("_", "-")), f["nixl"]
    assert nixl["supported"] is True and nixl["libfabric_verified"] is verified("LIBFABRIC", nixl["version"])
    assert f"[ ok ] NIXL: NIXL {nixl['version']} importable (wheel {nixl['wheel']})" in text
    said = "was verified on" if nixl["libfabric_verified"] else "was not verified on"
    assert f"kvpush's LIBFABRIC behaviour {said} NIXL {nixl['version']}" in f["nixl"]["why"]
    assert f["UCX"]["status"] == "ok"
    assert "[ ok ] NIXL plugin UCX" in text
    # LIBFABRIC: unavailable here, and the reason names the library the loader could not find.
    lf = f["LIBFABRIC"]
    if ctypes.util.find_library("fabric") is None:
        assert lf["status"] == "missing"
        node = required_node(Path(lf["details"]["plugin"])).decode()  # FABRIC_1.10 from NIXL 1.5, 1.7 before
        assert "libfabric.so.1 not found" in lf["why"] and f"symbol version {node}" in lf["why"]
        assert "libfabric.so.1" in lf["details"]["missing_libraries"]
        assert "aws-efa-installer" in lf["fix"]
        assert "[ -- ] NIXL plugin LIBFABRIC: LIBFABRIC does not load" in text
    else:
        assert lf["status"] == "ok" or lf["why"], lf
    assert f["efa"]["status"] == ("ok" if efa_devices() else "missing")
    assert f["host"]["status"] == "ok"
    for name in ("cuda", "neuron"):
        if name in f and f[name]["status"] != "ok":
            assert f[name]["why"] and f[name]["fix"], f[name]
    st = f["selftest:host"]
    g, tokens = SELF_TEST_GEOMETRY, SELF_TEST_TOKENS
    assert st["status"] == "ok", st
    assert st["details"]["verified"] is True
    assert st["details"]["bytes"] == tokens * g.layers * 2 * g.num_heads * g.head_dim * 2  # fp16 K and V
    assert st["details"]["best_GBps"] > 0.01
    assert "verified byte for byte" in text
    assert f["port"]["status"] == "ok"
    assert f["clock"]["status"] == "ok"
    assert abs(f["clock"]["details"]["offset_s"]) < 0.005 + f["clock"]["details"]["rtt_s"]  # same host, same clock


def test_required_but_missing_fails_the_exit_status(tmp_path: Path) -> None:
    rc, text, findings = doctor(tmp_path, "--no-self-test", "--require", "UCX", "--require", "LIBFABRIC")
    f = by_key(findings)
    if f["LIBFABRIC"]["status"] == "ok":
        pytest.skip("LIBFABRIC loads on this host")
    assert f["LIBFABRIC"]["status"] == "fail"
    assert rc == 1, text
    assert f["UCX"]["status"] == "ok"
    assert "[FAIL] NIXL plugin LIBFABRIC: LIBFABRIC does not load (required)" in text
    assert "selftest:host" not in f


def test_requirements() -> None:
    checks = [
        Check("UCX", "u", "ok", "fine"),
        Check("LIBFABRIC", "l", "missing", "no"),
        Check("cuda", "c", "missing", ""),
    ]
    unknown = apply_requirements(checks, ["ucx", "cuda", "warp-drive"])
    assert [c.status for c in checks] == ["ok", "missing", "fail"]
    assert unknown == ["warp-drive"]


def test_busy_port_fails_with_the_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = check_port("127.0.0.1", port)
    assert c.status == "fail" and str(port) in c.summary and "side_channel_port" in c.fix
    assert check_port("127.0.0.1", port).status == "ok"


def test_silent_peer_fails() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing will answer here
    c = check_clock(f"127.0.0.1:{port}", warn_ms=5)
    assert c.status == "fail" and "did not answer" in c.summary and "side_channel_port" in c.fix


def test_libfabric_version_node_is_read_from_the_plugin(tmp_path: Path) -> None:
    """The libfabric a plugin needs is the one defining the newest symbol version that plugin names (NIXL 1.5's
    FABRIC_1.10, earlier NIXL's FABRIC_1.7): a libfabric stopping at FABRIC_1.9 serves the older plugins."""
    p17, p110 = tmp_path / "p17.so", tmp_path / "p110.so"
    p17.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.1\0FABRIC_1.7\0...")
    p110.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.10\0FABRIC_1.7\0...")
    assert required_node(p17) == b"FABRIC_1.7" and required_node(p110) == b"FABRIC_1.10"
    assert required_node(tmp_path / "absent.so") == LIBFABRIC_VERSION_NODE
    fab = tmp_path / "libfabric.so.1"
    fab.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.7\0FABRIC_1.9\0")
    deps: dict[str, str | None] = {"libfabric.so.1": str(fab)}
    assert explain_deps(deps, required_node(p17))[0] == []
    assert "it lacks symbol version FABRIC_1.10" in explain_deps(deps, required_node(p110))[0][0]


def test_libfabric_version_node(tmp_path: Path) -> None:
    new, old = tmp_path / "new.so", tmp_path / "old.so"
    new.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.1\0" + LIBFABRIC_VERSION_NODE + b"\0...")
    old.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.1\0FABRIC_1.9\0")
    assert has_version_node(new) and not has_version_node(old)
    assert not has_version_node(tmp_path / "absent.so")


# -- LIBFABRIC: each way the plugin cannot load, diagnosed from real ELF files and the real loader ------------

STUBS = {
    # soname: (C source, version node or None). hwloc and the CUDA runtime under sonames no host has, so
    # that they can be missing anywhere; the diagnosis keys on the family (libhwloc*, libcudart.*).
    "libfabric.so.1": ("int fi_getinfo(void) { return 0; }", "FABRIC_1.10"),
    "libhwloc.so.915": ("int hwloc_topology_init(void) { return 0; }", None),
    "libcuda.so.1": ("int cuPointerGetAttributes(void) { return 0; }", None),
    "libcudart.so.913": ("int cudaSetDevice(int d) { return d; }", "libcudart.so.913"),
}
PLUGIN_C = """extern int fi_getinfo(void), hwloc_topology_init(void), cuPointerGetAttributes(void), cudaSetDevice(int);
int plugin_entry(void) { return fi_getinfo() + hwloc_topology_init() + cuPointerGetAttributes() + cudaSetDevice(0); }
"""


def _cc(tmp: Path, name: str, src: str, out: Path, *flags: str) -> None:
    c = tmp / f"{name}.c"
    c.write_text(src)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(c), *flags], check=True, capture_output=True)


def _stub(tmp: Path, soname: str, dest: Path, node: str | None) -> None:
    src, _ = STUBS[soname]
    flags = [f"-Wl,-soname,{soname}"]
    if node:
        sym = src.split("(")[0].split()[-1]
        (tmp / f"{soname}.map").write_text(f"{node} {{ global: {sym}; local: *; }};\n")
        flags.append(f"-Wl,--version-script,{tmp / f'{soname}.map'}")
    _cc(tmp, soname.replace(".", "_"), src, dest / soname, *flags)


@pytest.fixture(scope="module")
def fake_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``libplugin_LIBFABRIC.so`` linking the plugin's four outside libraries (fi_getinfo at FABRIC_1.10),
    found through ``$ORIGIN/deps``; each case copies it with some of those libraries missing or old."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stand-in libraries")
    tmp = tmp_path_factory.mktemp("fakeplugin")
    deps = tmp / "deps"
    deps.mkdir()
    for soname, (_, node) in STUBS.items():
        _stub(tmp, soname, deps, node)
    _cc(
        tmp,
        "plugin",
        PLUGIN_C,
        tmp / "libplugin_LIBFABRIC.so",
        f"-L{deps}",
        "-l:libfabric.so.1",
        "-l:libhwloc.so.915",
        "-l:libcuda.so.1",
        "-l:libcudart.so.913",
        "-Wl,-rpath,$ORIGIN/deps",
    )
    old = tmp / "old"
    old.mkdir()
    _stub(tmp, "libfabric.so.1", old, "FABRIC_1.9")
    return tmp


def _case(fake: Path, tmp: Path, drop: str | None = None, old_fabric: bool = False) -> tuple[str, str, dict[str, Any]]:
    pdir = tmp / "plugins"
    (pdir / "deps").mkdir(parents=True)
    shutil.copy(fake / "libplugin_LIBFABRIC.so", pdir)
    for soname in STUBS:
        if soname != drop:
            src = fake / "old" / soname if (old_fabric and soname == "libfabric.so.1") else fake / "deps" / soname
            shutil.copy(src, pdir / "deps" / soname)
    return explain_plugin("LIBFABRIC", pdir, "NIXL_ERR_BACKEND")


def _system_has(soname: str) -> bool:
    out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    return f"{soname} " in out


@pytest.mark.parametrize(
    ("drop", "old", "why", "fix"),
    [
        ("libfabric.so.1", False, "libfabric.so.1 not found", "aws-efa-installer"),
        (None, True, "too old: it lacks symbol version FABRIC_1.10", "/opt/amazon/efa/lib"),
        ("libhwloc.so.915", False, "links hwloc (libhwloc.so.915), which is not installed", "libhwloc15"),
        ("libcuda.so.1", False, "no NVIDIA driver is installed", "stand-in"),
        ("libcudart.so.913", False, "CUDA runtime of its NIXL wheel (libcudart.so.913)", "nvidia-cuda-runtime"),
    ],
)
def test_libfabric_plugin_diagnosis(
    fake_plugin: Path, tmp_path: Path, drop: str | None, old: bool, why: str, fix: str
) -> None:
    """Each missing or old library is named, with its own fix, and nothing else is blamed."""
    if drop and _system_has(drop):
        pytest.skip(f"{drop} is installed on this host: it cannot be missing here")
    reason, remedy, details = _case(fake_plugin, tmp_path, drop, old)
    assert why in reason and fix in remedy, (reason, remedy)
    blamed = {"libfabric": "libfabric", "hwloc": "hwloc", "NVIDIA driver": "libcuda", "CUDA runtime": "cudart"}
    for word, lib in blamed.items():
        if lib not in (drop or "libfabric.so.1"):
            assert word not in reason or (word == "libfabric" and old), (word, reason)
    assert details["missing_libraries"] == ([drop] if drop else [])


def test_libfabric_plugin_that_links_fine_is_not_blamed_on_libraries(fake_plugin: Path, tmp_path: Path) -> None:
    reason, remedy, details = _case(fake_plugin, tmp_path)
    assert reason.startswith("NIXL reports NIXL_ERR_BACKEND") and "NIXL_LOG_LEVEL=DEBUG" in remedy, reason
    assert details["missing_libraries"] == [] and details["cuda_standin"] is False


def test_cuda_standin_is_recognised(tmp_path: Path) -> None:
    """kvpush's stand-in is told from a driver by its marker symbol; an NVIDIA host by /proc or /dev."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    standin, other = tmp_path / "libcuda.so.1", tmp_path / "libother.so"
    src = ROOT / "tests" / "helpers" / "native" / "cuda_standin.c"
    subprocess.run(["cc", "-shared", "-fPIC", "-DKVPUSH_STANDIN_DRIVER", "-o", str(standin), str(src)], check=True)
    _cc(tmp_path, "other", STUBS["libcuda.so.1"][0], other)
    assert is_cuda_standin(standin) and not is_cuda_standin(other) and not is_cuda_standin(None)
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    assert not nvidia_present(root)
    (root / "dev" / "nvidia0").touch()
    assert nvidia_present(root)


def _libfabric_env() -> dict[str, str]:
    """The environment of a process that loads LIBFABRIC; skips (not set up) or fails (set up, broken)."""
    try:
        return lf_env.child_env()
    except lf_env.NotSetUp as exc:
        if lf_env.PREFIX_ENV in os.environ:
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def test_doctor_over_libfabric(tmp_path: Path) -> None:
    """With libfabric's tcp provider on the library path: the plugin loads, the doctor names the provider
    the plugin will use and why, and pushes through LIBFABRIC byte for byte."""
    env = _libfabric_env()
    rc, text, findings = doctor(tmp_path, "--require", "LIBFABRIC", "--require", "selftest:host@LIBFABRIC", env=env)
    f = by_key(findings)
    assert rc == 0, text
    assert f["LIBFABRIC"]["status"] == "ok"
    fab = f["libfabric"]
    assert fab["status"] == "ok", fab
    assert fab["details"]["plugin_provider"] == "tcp" and "tcp" in fab["details"]["rdm"], fab
    assert "the LIBFABRIC plugin will use tcp on" in fab["summary"] and "test transport" in fab["summary"]
    assert "host memory only" in fab["summary"]  # NIXL's plugin takes device memory on efa alone
    standin = json.loads((Path(os.environ[lf_env.PREFIX_ENV]) / lf_env.MARKER).read_text())["cuda_standin"]
    assert fab["details"]["cuda_standin"] is bool(standin)
    assert ("kvpush's CPU stand-in" in fab["summary"]) is bool(standin)
    st = f["selftest:host@LIBFABRIC"]
    assert st["status"] == "ok" and st["details"]["verified"] is True, st
    assert "self-test push (host over LIBFABRIC)" in text and f["selftest:host"]["title"].endswith("over UCX)")


def test_doctor_names_a_provider_filter_that_leaves_the_plugin_nothing(tmp_path: Path) -> None:
    """FI_PROVIDER=shm: libfabric offers only shm, which NIXL's plugin never uses, so it does not load;
    the doctor says so from fi_getinfo, not from a guess."""
    env = {**_libfabric_env(), "FI_PROVIDER": "shm"}
    _, _, findings = doctor(tmp_path, "--no-self-test", env=env)
    f = by_key(findings)
    assert f["LIBFABRIC"]["status"] == "missing", f["LIBFABRIC"]
    fab = f["libfabric"]
    assert fab["status"] == "missing" and "no provider NIXL's plugin uses" in fab["summary"], fab
    assert "FI_PROVIDER=shm" in fab["why"] and "shm (shm)" in fab["why"], fab
    assert list(fab["details"]["rdm"]) == ["shm"]
