"""The backend conformance suite in CI: who must pass it, and proof that it can fail.

Each case runs ``kvpush conformance`` as a user would, in a subprocess (the
suite spawns its own P/D worker processes and NIXL agents, which must not
share this process), and reads the outcome of every packaged test from a
JUnit report. The host backend, the Neuron backend on its stand-in runtime
(both modes) and the minimal example backend must pass everything; a backend
with known bugs must fail exactly the tests that name those contracts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.util import find_spec
from pathlib import Path

import helpers_libfabric as lf
import pytest

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ROOT / "examples" / "minimal_backend"
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SUITE_TIMEOUT_S = 300


def run_suite(
    tmp_path: Path,
    backend: str,
    *options: str,
    pythonpath: tuple[Path, ...] = (),
    extra: tuple[str, ...] = (),
    nixl_backend: str = "UCX",
    nixl_log: bool = False,
) -> tuple[int, dict[str, str], str]:
    """Run the suite; returns (exit status, outcome per test id, output)."""
    report = tmp_path / f"junit-{len(list(tmp_path.iterdir()))}.xml"
    cmd = [sys.executable, "-m", "kvpush.cli", "conformance", "--backend", backend, "--nixl-backend", nixl_backend]
    cmd += [f"--option={o}" for o in options]
    cmd += ["--", "-q", f"--junitxml={report}", *extra]
    env = lf.child_env() if nixl_backend == "LIBFABRIC" else dict(os.environ)
    if nixl_log:
        env["NIXL_LOG_LEVEL"] = "INFO"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S, check=False)
    out = proc.stdout + proc.stderr
    outcomes: dict[str, str] = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
            outcomes[f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"] = (
                kinds[0] if kinds else "passed"
            )
    return proc.returncode, outcomes, out


def assert_conforms(rc: int, outcomes: dict[str, str], out: str, skipped: int = 0) -> None:
    bad = {k: v for k, v in outcomes.items() if v not in ("passed", "skipped")}
    assert rc == 0 and not bad, f"exit {rc}; not passed: {bad}\n{out[-6000:]}"
    assert len(outcomes) >= 30, f"only {len(outcomes)} tests ran:\n{out[-6000:]}"
    assert sum(v == "skipped" for v in outcomes.values()) == skipped, outcomes


def test_host_backend_conforms(tmp_path: Path, nixl_backend: str) -> None:
    """Over each NIXL backend. NIXL's own log (kept in the JUnit report) proves which one carried the
    pushes: LIBFABRIC's rails over the tcp provider, or none of them on UCX."""
    logged = ("-o", "junit_logging=all")
    rc, outcomes, out = run_suite(tmp_path, "host", nixl_backend=nixl_backend, extra=logged, nixl_log=True)
    assert_conforms(rc, outcomes, out)
    report = max(tmp_path.glob("junit-*.xml"), key=lambda p: p.stat().st_mtime).read_text()
    rails = report.count("rails using provider=tcp")
    assert (rails > 0) == (nixl_backend == "LIBFABRIC"), (nixl_backend, rails)


PEER_CASES = 3
"""Cases of ``suite/test_peer.py``: skipped, not failed, for a backend without ``PeerCopy`` (optional)."""


@pytest.mark.parametrize(("mode", "skipped"), [("direct", PEER_CASES), ("host_staging", 8 + PEER_CASES)])
def test_neuron_backend_conforms_on_the_standin(tmp_path: Path, mode: str, skipped: int) -> None:
    """Host staging registers no KV, so the 8 cases that force a direct plan are skipped, not failed; the
    Neuron backend has no peer copies, so the peer cases skip in both modes."""
    if find_spec("kvpush_neuron") is None:
        pytest.skip("kvpush-neuron is not installed (pip install -e backends/neuron)")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build the stand-in Neuron runtime")
    assert_conforms(*run_suite(tmp_path, "neuron", f"mode={mode}"), skipped=skipped)


def test_minimal_example_backend_conforms(tmp_path: Path) -> None:
    """The example of docs/backends.md passes, uninstalled, named as module:Class (no peer copies: those skip)."""
    rc, outcomes, out = run_suite(tmp_path, "kvpush_minimal:MinimalBackend", pythonpath=(MINIMAL,))
    assert_conforms(rc, outcomes, out, skipped=PEER_CASES)


# Each bug of the broken backend and the tests whose contracts it breaks; every other test must pass.
EXPECTED_FAILURES = {
    "test_push::test_interoperates_with_the_host_reference[backend-to-host]": "swap_kv",
    "test_push::test_interoperates_with_the_host_reference[host-to-backend]": "swap_kv",
    "test_backend::test_foreign_tensors_are_refused": "accept_foreign",
    "test_push::test_data_written_just_before_handoff_arrives[direct]": "late_write",
    "test_push::test_data_written_just_before_handoff_arrives[staged]": "late_write",
    "test_push::test_data_written_just_before_a_parked_handoff_arrives[direct]": "late_write",
    "test_push::test_data_written_just_before_a_parked_handoff_arrives[staged]": "late_write",
    "test_push::test_layer_by_layer_push_waits_for_each_layer[direct]": "late_write",
    "test_push::test_layer_by_layer_push_waits_for_each_layer[staged]": "late_write",
}


def test_suite_catches_a_broken_backend(tmp_path: Path) -> None:
    """The suite is able to fail: a K/V swap that cancels out between two instances of one backend,
    a describe that accepts foreign memory, and a ready marker that misses late writes are each caught
    by the test named for that contract, and by no other."""
    bugs = ",".join(sorted(set(EXPECTED_FAILURES.values())))
    rc, outcomes, out = run_suite(
        tmp_path, "helpers_broken_backend:BrokenBackend", f"bug={bugs}", pythonpath=(MINIMAL, HELPERS)
    )
    failed = {k for k, v in outcomes.items() if v in ("failure", "error")}
    assert rc != 0, out[-6000:]
    want = sorted(EXPECTED_FAILURES)
    assert failed == set(EXPECTED_FAILURES), f"failed {sorted(failed)}, expected {want}\n{out[-6000:]}"


def test_docs_show_the_minimal_backend_verbatim() -> None:
    """docs/backends.md shows the example file itself, so the page cannot drift from the code CI runs."""
    code = (MINIMAL / "kvpush_minimal.py").read_text()
    doc = (ROOT / "docs" / "backends.md").read_text()
    assert f"```python\n{code}```" in doc, "update the code block in docs/backends.md from the example file"
