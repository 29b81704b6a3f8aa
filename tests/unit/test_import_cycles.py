"""The import-cycle check (``kvpush_tools.imports``, run by ``.ci/test``): a cycle among a package's modules is
reported with the lines that make it and fails the run, however the import hides (in a function, under
``TYPE_CHECKING``, relative); a package without one passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush_tools.imports import main


def package(root: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``root`` with these modules (path relative to the package: source)."""
    pkg = root / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


OWNER = "from pkg.worker import Worker\n\nclass Owner:\n    def __init__(self):\n        self.w = Worker(self)\n"
PORT = "from typing import Protocol\n\nclass Port(Protocol):\n    def send(self, x: int) -> None: ...\n"


@pytest.mark.parametrize(
    ("back_reference", "kind"),
    [
        ("from pkg.owner import Owner\n", "module"),
        ("def f():\n    from pkg import owner\n    return owner\n", "function"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .owner import Owner\n", "typing"),
        ("import pkg.owner\n", "module"),
    ],
)
def test_a_cycle_is_reported_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], back_reference: str, kind: str
) -> None:
    pkg = package(tmp_path, {"owner.py": OWNER, "worker.py": back_reference + "\nclass Worker: ...\n"})
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "cycle 1: pkg.owner -> pkg.worker -> pkg.owner" in out
    assert f"pkg.worker -> pkg.owner  ({kind}, " in out
    assert "pkg.owner -> pkg.worker  (module, " in out
    assert "1 import cycle(s)" in out


def test_a_narrow_port_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same two classes, the worker typed against a port of its own module: no cycle."""
    worker = "from pkg.ports import Port\n\nclass Worker:\n    def __init__(self, port: Port): ...\n"
    pkg = package(tmp_path, {"owner.py": OWNER, "worker.py": worker, "ports.py": PORT})
    assert main([str(pkg)]) == 0
    assert "no import cycle among 4 modules" in capsys.readouterr().out


def test_typing_only_cycles_can_be_left_out(tmp_path: Path) -> None:
    """``--kinds module,function``: what would fail at run time only (a ``TYPE_CHECKING`` import runs never)."""
    back = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.owner import Owner\n"
    pkg = package(tmp_path, {"owner.py": OWNER, "worker.py": back})
    assert main([str(pkg), "--kinds", "module,function"]) == 0
    assert main([str(pkg)]) == 1


def test_a_longer_cycle_through_subpackages_and_relative_imports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        "a/__init__.py": "",
        "a/x.py": "from ..b import y\n",  # pkg.b.y
        "b/__init__.py": "",
        "b/y.py": "from pkg.c import z\n",  # a module named by ``from package import module``
        "c/__init__.py": "from .z import thing\n",
        "c/z.py": "from pkg.a.x import *\nthing = 1\n",
    }
    pkg = package(tmp_path, files)
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "cycle 1: pkg.a.x -> pkg.b.y -> pkg.c.z -> pkg.a.x" in out
    assert "pkg.c -> pkg.c.z" not in out  # an __init__ importing its own module is outside the cycle


def test_plain_directories_and_outside_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory of top-level modules (as ``tests/``) is read by their own names; the standard library
    and packages outside the given directories make no edge."""
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "helper.py").write_text("import os\nimport numpy\nfrom user import used\n")
    (flat / "user.py").write_text("import helper\nused = 1\n")
    assert main([str(flat)]) == 1
    assert "cycle 1: helper -> user -> helper" in capsys.readouterr().out
    (flat / "helper.py").write_text("import os\nimport numpy\n")
    assert main([str(flat)]) == 0


def test_the_project_has_no_import_cycle(capsys: pytest.CaptureFixture[str]) -> None:
    """kvpush, its tools, backends and tests, as ``.ci/test`` checks them: an engine collaborator that imports
    its owner back (even only for a type) fails here."""
    root = Path(__file__).resolve().parents[2]
    dirs = ["kvpush", "tools/kvpush_tools", "backends/cuda/kvpush_cuda", "backends/neuron/kvpush_neuron"]
    dirs += ["tests", *(f"tests/{d}" for d in ("helpers", "unit", "nixl", "e2e", "bench"))]
    dirs += ["backends/cuda/tests", "backends/neuron/tests"]
    assert main([str(root / d) for d in dirs]) == 0, capsys.readouterr().out
