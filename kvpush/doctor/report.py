"""The doctor's findings and how they are shown: ``Check``, the text report, ``--require`` and the JSON file.

A check's status is one of three words, because an operator reads them:
``ok`` works; ``missing`` is not available here, which is fine unless it is
``--require``d; ``fail`` is broken (or missing and required) and makes the
exit status 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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


_MARK = {"ok": "[ ok ]", "missing": "[ -- ]", "fail": "[FAIL]"}


def render(checks: Sequence[Check]) -> str:
    """One line a check, then its reason and (unless it is ok) its fix, indented under it."""
    lines = []
    for c in checks:
        lines.append(f"{_MARK.get(c.status, '[ ?? ]')} {c.title}: {c.summary}")
        if c.why:
            lines.append(f"       why: {c.why}")
        if c.fix and c.status != "ok":
            lines.append(f"       fix: {c.fix}")
    return "\n".join(lines)


def tally(checks: Sequence[Check]) -> str:
    """The closing count of the report."""
    failed = sum(c.status == "fail" for c in checks)
    return (
        f"\n{len(checks)} checks: {sum(c.status == 'ok' for c in checks)} ok, "
        f"{sum(c.status == 'missing' for c in checks)} not available here, {failed} failed"
    )


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


def require(checks: list[Check], required: Sequence[str]) -> None:
    """``apply_requirements``, and a failed check for each requirement that names no check."""
    for u in apply_requirements(checks, required):
        checks.append(Check(u, f"requirement {u}", "fail", "no such check ran", fix="see kvpush doctor --help"))


def write_json(checks: Sequence[Check], path: Path) -> None:
    """The findings as a JSON list of the checks' fields (``--json``)."""
    path.write_text(json.dumps([asdict(c) for c in checks], indent=1, default=str))
