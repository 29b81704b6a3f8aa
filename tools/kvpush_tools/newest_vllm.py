"""The newest published vLLM against kvpush's connector, without a server: CI's early word on the next release.

``bash .ci/test`` runs::

    python -m kvpush_tools.newest_vllm --out results/ci

It asks the registry which vLLM is newest (``pip index versions vllm``),
downloads that wheel once (``--no-deps``, kept extracted under
``~/.cache/kvpush/newest-vllm/VERSION``: its Python sources, not its compiled
kernels), and with those sources ahead of this interpreter's packages (the
main lane's torch and vLLM dependencies) runs the compat probe (``--probe``:
would ``KVPushConnector`` start on it, what does it offer) and the connector's
vLLM unit tests (``TESTS``: compat, the forward policy, the scheduler side,
layouts, metrics) against its real classes. It prints one line, ``newest vLLM X:
compatible`` or ``incompatible because ...`` or ``not checked here: ...``,
and writes it to ``OUT/newest-vllm.json`` (with the tests' JUnit XML,
``OUT/newest-vllm.xml``) for the compatibility table (``kvpush_tools.compat``).

It always exits 0: the verdict is about a vLLM release, not about the commit
under test, and a registry that does not answer (or a newest vLLM whose
sources do not import over this interpreter's packages) is said, not failed.
The rules (reading the registry's answer, the verdict) are pure functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TESTS = (
    "tests/unit/test_vllm_compat.py",
    "tests/unit/test_vllm_forward.py",
    "tests/unit/test_vllm_scheduler_side.py",
    "tests/unit/test_vllm_scheduler_inputs.py",
    "tests/unit/test_vllm_params.py",
    "tests/unit/test_vllm_layout.py",
    "tests/unit/test_vllm_layout_versions.py",
    "tests/unit/test_describe_vllm.py",
    "tests/unit/test_metrics.py::test_vllm_prometheus_hooks_export_kvpush_metrics",
)
"""The connector's unit tests against vLLM's real classes that need no server and no compiled vLLM kernel (those
that do skip, saying so): compat and the forward policy, the scheduler side, layouts, vLLM's metric classes."""

ROOT = Path(__file__).resolve().parents[2]
"""The checkout ``TESTS`` are in."""

REGISTRY_TIMEOUT_S = 60
DOWNLOAD_TIMEOUT_S = 300
RUN_TIMEOUT_S = 300
"""Bounds on each step: a registry or a run that hangs is a check not made, not a CI that hangs."""


def newest_version(index_output: str) -> str | None:
    """The newest version in ``pip index versions``'s answer (``vllm (0.34.0)``); None when it names none."""
    m = re.search(r"^vllm \(([^)\s]+)\)", index_output, re.MULTILINE)
    return m[1] if m else None


@dataclass
class RunResults:
    """What the unit tests did against the newest vLLM's classes (from their JUnit XML)."""

    passed: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Report:
    """The check's verdict: ``status`` ``compatible``, ``incompatible`` or ``not checked``, and its line."""

    version: str
    status: str
    line: str


def verdict(
    version: str | None, why_not: str = "", probe: dict[str, Any] | None = None, tests: RunResults | None = None
) -> Report:
    """The check's line from what each step found.

    - ``why_not``: a step could not run (the registry, the download, vLLM's
      import here): not checked, saying why;
    - the probe's refusal (a need unmet, named) or failed tests: incompatible
      because of those;
    - else compatible, saying whether the connector would warn (newer than
      tested) and what the tests did.
    """
    name = version or ""
    head = f"newest vLLM {name}".rstrip()
    if not why_not and probe is not None and "error" in probe:
        why_not = str(probe["error"])
    if why_not or probe is None or tests is None:
        reason = why_not or "the probe or the tests did not run"
        return Report(name, "not checked", f"{head}: not checked here: {reason}")
    reasons = []
    if probe.get("refusal"):
        reasons.append(str(probe["refusal"]))
    if tests.failed:
        shown = ", ".join(tests.failed[:5]) + (f" and {len(tests.failed) - 5} more" if len(tests.failed) > 5 else "")
        reasons.append(f"{len(tests.failed)} unit tests fail against its classes: {shown}")
    if reasons:
        return Report(name, "incompatible", f"newest vLLM {name}: incompatible because " + "; ".join(reasons))
    warns = "starts with the newer-than-tested warning" if probe.get("warning") else "starts (within the tested range)"
    layouts = probe.get("unknown_layouts") or []
    note = (
        f"; offers KV-cache layouts kvpush does not know ({', '.join(layouts)}), refused if chosen" if layouts else ""
    )
    return Report(
        name,
        "compatible",
        f"newest vLLM {name}: compatible: KVPushConnector {warns}; unit tests against its classes "
        f"passed {tests.passed} (+{tests.skipped} skipped){note}",
    )


# ---------------- the shell ----------------


def ask_registry() -> tuple[str | None, str]:
    """(newest vLLM version, why not) from the registry."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=REGISTRY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"the registry did not answer in {REGISTRY_TIMEOUT_S} s"
    version = newest_version(proc.stdout)
    if version is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no answer"]
        return None, f"the registry named no vLLM ({tail[0][:200]})"
    return version, ""


def fetch_sources(version: str, cache: Path) -> tuple[Path | None, str]:
    """(directory holding vLLM ``version``'s ``vllm/`` Python sources, why not): the cached one, or the wheel
    downloaded (``--no-deps``) and its files but compiled libraries extracted. Older versions' are removed."""
    here = cache / version
    if (here / ".complete").exists():
        return here, ""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:"]
        cmd += ["-d", tmp, "--disable-pip-version-check", "-q", "--timeout", "30"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return None, f"downloading vllm=={version} took over {DOWNLOAD_TIMEOUT_S} s"
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no wheel"]
            return None, f"no wheel of vllm=={version} could be downloaded ({tail[0][:200]})"
        shutil.rmtree(here, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
            wheel.extractall(here, members)
    for old in cache.iterdir():
        if old.is_dir() and old != here:
            shutil.rmtree(old, ignore_errors=True)
    (here / ".complete").write_text(version)
    return here, ""


def _env(sources: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(sources), env.get("PYTHONPATH", "")) if p)
    return env


def run_probe(sources: Path) -> dict[str, Any]:
    """``--probe`` in a child whose vLLM is the one in ``sources``."""
    cmd = [sys.executable, "-m", "kvpush_tools.newest_vllm", "--probe"]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(sources), check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the probe took over {RUN_TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("KVPUSH_PROBE "):
            return dict(json.loads(line[len("KVPUSH_PROBE ") :]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"the probe exited {proc.returncode}: {tail[0][:300]}"}


def probe() -> dict[str, Any]:
    """What the connector makes of the vLLM this process imports (run with the newest's sources ahead)."""
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import base  # noqa: F401

        from kvpush.integrations.vllm import compat

        surface, layouts = compat.read_surface(), compat.read_layouts()
    except Exception as exc:  # its sources need what this interpreter lacks: said, not failed
        return {"error": f"its Python sources do not import over this interpreter's packages: {exc!r}"[:400]}
    verdict_ = compat.check_vllm(str(vllm.__version__), surface, layouts)
    refusal = verdict_.refusal
    try:
        from kvpush.integrations.vllm.connector import KVPushConnector  # noqa: F401
    except Exception as exc:  # vLLM imports, kvpush's connector does not: incompatible
        refusal = "; ".join(r for r in (refusal, f"kvpush's connector does not import against it: {exc!r}") if r)
    features = compat.features(str(vllm.__version__), surface)
    return {
        "version": str(vllm.__version__),
        "file": str(vllm.__file__),
        "refusal": refusal,
        "warning": verdict_.warning,
        "unknown_layouts": compat.unknown_layouts(layouts),
        "features": {k: v for k, v in vars(features).items() if k != "version"},
    }


def run_tests(sources: Path, xml: Path) -> tuple[RunResults | None, str]:
    """``TESTS`` against the vLLM in ``sources``, JUnit XML to ``xml``."""
    xml = xml.resolve()
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--junitxml", str(xml), *TESTS]
    try:
        subprocess.run(
            cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(sources), cwd=ROOT, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"its unit tests took over {RUN_TIMEOUT_S} s"
    if not xml.exists():
        return None, "its unit tests wrote no results"
    return read_junit(xml), ""


def read_junit(xml: Path) -> RunResults:
    out = RunResults()
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.failed.append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}")
        elif case.find("skipped") is not None:
            out.skipped += 1
        else:
            out.passed += 1
    return out


def check(out: Path, cache: Path) -> Report:
    version, why = ask_registry()
    if version is None:
        return verdict(None, why)
    sources, why = fetch_sources(version, cache)
    if sources is None:
        return verdict(version, why)
    found = run_probe(sources)
    if "error" in found:
        return verdict(version, probe=found)
    tests, why = run_tests(sources, out / "newest-vllm.xml")
    return verdict(version, why, found, tests)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/ci"), help="where newest-vllm.json/.xml go")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/kvpush/newest-vllm")
    ap.add_argument("--probe", action="store_true", help="(internal) probe the vLLM this process imports")
    a = ap.parse_args(argv)
    if a.probe:
        print("KVPUSH_PROBE " + json.dumps(probe()), flush=True)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    report = check(a.out, a.cache)
    (a.out / "newest-vllm.json").write_text(json.dumps(vars(report), indent=1) + "\n")
    print(report.line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
