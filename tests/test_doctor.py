"""kvpush doctor on this machine, for real: NIXL, plugins, backends, a loopback push, port, clock.

What this host is (2 CPUs, UCX, no EFA, no GPU, no Neuron runtime, a NIXL
wheel whose LIBFABRIC plugin cannot load) is what the expectations say; where
a fact depends on the host it is read from the host first (is libfabric
installed?), so the test states what the doctor must say *given* that fact.
"""

from __future__ import annotations

import ctypes.util
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers_local_pair import local_pair

from kvpush.doctor import (
    LIBFABRIC_VERSION_NODE,
    Check,
    SelfTestGeometry,
    apply_requirements,
    check_clock,
    check_port,
    efa_devices,
    has_version_node,
)

ROOT = Path(__file__).resolve().parents[1]


def doctor(tmp: Path, *args: str, timeout: float = 300) -> tuple[int, str, list[dict[str, Any]]]:
    """``kvpush doctor ARGS --json`` in a child process: (exit status, output, findings)."""
    out = tmp / "doctor.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "doctor", "-q", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
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
    assert f["nixl"]["status"] == "ok" and f["nixl"]["details"]["version"] == "1.5.1"
    assert f["UCX"]["status"] == "ok"
    assert "[ ok ] NIXL plugin UCX" in text
    # LIBFABRIC: unavailable here, and the reason names the library the loader could not find.
    lf = f["LIBFABRIC"]
    if ctypes.util.find_library("fabric") is None:
        assert lf["status"] == "missing"
        assert "libfabric.so.1 not found" in lf["why"] and "FABRIC_1.10" in lf["why"]
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
    g = SelfTestGeometry()
    assert st["status"] == "ok", st
    assert st["details"]["verified"] is True
    assert st["details"]["bytes"] == g.tokens * g.layers * 2 * g.num_heads * g.head_dim * 2  # fp16 K and V
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


def test_libfabric_version_node(tmp_path: Path) -> None:
    new, old = tmp_path / "new.so", tmp_path / "old.so"
    new.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.1\0" + LIBFABRIC_VERSION_NODE + b"\0...")
    old.write_bytes(b"\x7fELF...FABRIC_1.0\0FABRIC_1.1\0FABRIC_1.9\0")
    assert has_version_node(new) and not has_version_node(old)
    assert not has_version_node(tmp_path / "absent.so")
