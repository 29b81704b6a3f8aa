"""The import check (``kvpush_tools.imports``, run by ``.ci/test``): a cycle among a package's modules is
reported with the lines that make it and fails the run, however the import hides (in a function, under
``TYPE_CHECKING``, relative); a package without one passes. And the direction: a pure module of kvpush
(``core``, ``prefill``, ``decode``, ``config``) that imports a shell, or runs one's import when it is imported
(through ``config``, through a package's ``__init__``), fails the run naming the import and the chain."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvpush_tools.imports import main

ROOT = Path(__file__).resolve().parents[2]


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
    root = ROOT
    dirs = ["kvpush", "tools/kvpush_tools", "backends/cuda/kvpush_cuda", "backends/neuron/kvpush_neuron"]
    dirs += ["tests", *(f"tests/{d}" for d in ("helpers", "unit", "nixl", "e2e", "bench"))]
    dirs += ["backends/cuda/tests", "backends/neuron/tests"]
    assert main([str(root / d) for d in dirs]) == 0, capsys.readouterr().out


def kvpush_like(root: Path, files: dict[str, str]) -> Path:
    """A package named ``kvpush`` (the direction's rules name kvpush's packages) with pure and shell
    subpackages, each module empty but for ``files`` (path relative to the package: source)."""
    base = {
        "__init__.py": "",
        "config.py": "from kvpush.core.errors import ConfigError\n",
        **{f"{p}/__init__.py": "" for p in ("core", "prefill", "decode", "transport", "engine", "observability")},
        "core/errors.py": "class ConfigError(Exception): ...\n",
        "core/plan.py": "from kvpush.config import ConfigError\n",
        "prefill/hello.py": "from kvpush.core.errors import ConfigError\n",
        "decode/fencing.py": "from kvpush.core import errors\n",
        "transport/interop.py": "import re\n",
        "engine/sender.py": "from kvpush.prefill import hello\nfrom kvpush.transport import interop\n",
        "engine/pushes.py": "import re\n",
        "observability/metrics.py": "import enum\n",
    }
    pkg = root / "kvpush"
    for rel, text in {**base, **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_pure_packages_importing_each_other_as_allowed_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Shells import the machines and each other; the machines import ``core`` and ``config``: no breach."""
    assert main([str(kvpush_like(tmp_path, {}))]) == 0
    assert "and no import against the pure rules' direction" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("module", "bad", "kind", "rule"),
    [
        ("prefill/hello.py", "from kvpush.transport.interop import peer_problem\n", "module", "kvpush.prefill"),
        ("decode/fencing.py", "from kvpush.observability import metrics\n", "module", "kvpush.decode"),
        ("core/plan.py", "def f():\n    import kvpush.engine.pushes\n", "function", "kvpush.core"),
        (
            "core/plan.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvpush.engine.pushes import Runner\n",
            "typing",
            "kvpush.core",
        ),
        ("prefill/hello.py", "from kvpush.decode import fencing\n", "module", "kvpush.prefill"),
        ("core/plan.py", "from ..prefill import hello\n", "module", "kvpush.core"),
    ],
)
def test_a_pure_module_importing_against_the_direction_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], module: str, bad: str, kind: str, rule: str
) -> None:
    """A shell (however the import hides), or a pure package it may not build on (``prefill`` and ``decode``
    never import each other; ``core`` imports neither)."""
    pkg = kvpush_like(tmp_path, {module: bad})
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out
    src = "kvpush." + module.removesuffix(".py").replace("/", ".")
    assert f"forbidden import 1: {src} -> " in out
    assert f"({kind}, " in out and f"{rule} is pure: it may import only {rule}, " in out
    assert "1 import(s) against the direction" in out and "cycle" not in out  # the direction alone fails it


def test_an_import_run_through_config_fails_naming_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``core.plan`` imports ``config`` (allowed); ``config`` importing a shell breaks ``config``'s rule and
    makes every pure module that imports it run the shell."""
    pkg = kvpush_like(tmp_path, {"config.py": "from kvpush.transport.interop import x\n"})
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "forbidden import 1: kvpush.config -> kvpush.transport.interop  (module, " in out
    assert "kvpush.config is pure: it may import only kvpush.config, kvpush.core" in out
    assert (
        "runs when pure kvpush.core is imported: kvpush.core.plan -> kvpush.config -> kvpush.transport.interop" in out
    )


def test_an_import_run_through_a_package_init_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvpush/__init__.py`` runs before every pure module: an eager import of the engine there loads it with
    each of them, though no pure module names it. Under ``TYPE_CHECKING`` (the lazy public surface) it runs
    never, and passes."""
    lazy = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvpush.engine.pushes import Runner\n"
    assert main([str(kvpush_like(tmp_path / "lazy", {"__init__.py": lazy}))]) == 0
    capsys.readouterr()
    pkg = kvpush_like(tmp_path / "eager", {"__init__.py": "from kvpush.engine.pushes import Runner\n"})
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "forbidden import 1: kvpush -> kvpush.engine.pushes  (module, " in out
    assert "runs when pure kvpush.core is imported: kvpush.core -> kvpush -> kvpush.engine.pushes" in out
    assert "cycle" not in out
    pkg = kvpush_like(tmp_path / "sub", {"core/__init__.py": "from kvpush.observability.metrics import enum\n"})
    assert main([str(pkg)]) == 1
    assert "kvpush.core -> kvpush.observability.metrics" in capsys.readouterr().out


def test_a_bad_import_planted_in_the_real_package_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kvpush as it is passes; with D's fencing importing metrics' counters again (as it did), it fails."""
    pkg = tmp_path / "kvpush"
    shutil.copytree(ROOT / "kvpush", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert main([str(pkg)]) == 0
    fencing = pkg / "decode" / "fencing.py"
    fencing.write_text(fencing.read_text() + "\nfrom kvpush.observability.metrics import COUNT_STAT  # noqa\n")
    assert main([str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "forbidden import 1: kvpush.decode.fencing -> kvpush.observability.metrics  (module, " in out
