"""``kvpush bench soak``, short: real vLLM servers through every fault the long run makes.

A few dozen requests through kvpush's router to a P and a D with kvpush's connector while D is killed and
started again, P is killed and started again, and (where this machine can make network namespaces) the link
between P and the rest is cut for twice ``peer_dead_s`` and healed. The soak must pass its own acceptance:
every completed text equals the single instance's, every failure falls in a fault's window, every fault is
recovered from, KV usage back to zero after the load. Memory is reported but not judged: a slope over a few
dozen requests says nothing (the long run judges it, docs/results.md).

Heavy (three minutes on a quiet host, ten beside other jobs: four vLLM starts on two cores), so CI, which
runs ``-m "not heavy"``, leaves it out; run it on purpose: ``pytest -m heavy tests/e2e/test_e2e_soak.py``.
A D that never gives back the blocks it withheld for a dead P fails it (KV usage not back to zero).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_cluster import ROOT, model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]


def _namespaces() -> bool:
    """Whether the soak can make its namespaces here (root and ``ip``)."""
    return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


def test_a_short_soak_with_every_fault_passes(tmp_path: Path) -> None:
    netns = _namespaces()
    faults, at = ("d,p,net", "0.2,0.45,0.7") if netns else ("d,p", "0.25,0.6")
    cmd = [sys.executable, "-m", "kvpush_tools.bench.soak", "--requests", "90", "--faults", faults]
    cmd += ["--fault-at", at, "--max-slope-mb-per-1k", "inf", "--model-dir", model_dir(), "--out", str(tmp_path)]
    if not netns:
        cmd.append("--no-netns")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    report = tmp_path / "soak.json"
    assert report.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    summary = json.loads(report.read_text())
    print(done.stdout)
    assert done.returncode == 0, summary["verdict"]
    c = summary["counts"]
    assert c["requests"] == 90 and c["ok"] > 0 and c["failed_unexplained"] == 0 and c["mismatched"] == 0, c
    assert [f["name"] for f in summary["faults"]] == [
        {"d": "d_restart", "p": "p_restart", "net": "net_drop"}[f] for f in faults.split(",")
    ]
    assert all(f["recovered"] is not None and f["served_after"] for f in summary["faults"]), summary["faults"]
    assert all(e["zero"] for e in summary["kv_at_end"].values()), summary["kv_at_end"]
    assert report.stat().st_size < 200 * 1024 and (tmp_path / "soak.png").exists()
