"""``kvpush``'s public surface: every name in ``__all__`` resolves (lazily) to the object of the home module
its ``TYPE_CHECKING`` import names, so what type checkers see and what runs are the same names and objects."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kvpush


def _homes() -> dict[str, str]:
    """Each name ``kvpush/__init__.py`` imports for type checkers, and the module it imports it from."""
    tree = ast.parse(Path(kvpush.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {a.name: str(node.module) for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}


def test_every_public_name_is_its_home_module_s() -> None:
    homes = _homes()
    assert set(kvpush.__all__) == {"__version__", *homes}
    for name, module in homes.items():
        assert getattr(kvpush, name) is getattr(importlib.import_module(module), name), name


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    try:
        kvpush.NotAThing  # noqa: B018
    except AttributeError as exc:
        assert "NotAThing" in str(exc)
    else:
        raise AssertionError("kvpush.NotAThing resolved")
