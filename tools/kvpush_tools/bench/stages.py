"""The per-stage timeline of a push, shared by the CPU transfer bench and the GPU bench: names, text, figure.

Both benches record, per run, when each stage of the push happened, in ms
after the run's start (``at``: P's KV ready in the ``ahead`` order, D's
register call or P's hand-over otherwise), from the engines' results
(``PushTimes`` on P, ``ReceiveTimes`` on D, with ``PartTimes`` per part), and
keep the median of each. Here they are put in the order a push goes through
them, printed, and drawn: one row per case, one marker per stage, and per part
its pack, WRITE and unpack as bars, so where each hundred microseconds goes
(and whether parts overlap) shows at a glance.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STAGES: tuple[tuple[str, str], ...] = (
    ("p_ready", "ready (P)"),
    ("p_planned", "planned (P)"),
    ("p_packed", "packed (P)"),
    ("p_posted", "posted (P)"),
    ("p_completed", "WRITE done (P)"),
    ("d_first_part", "first notification (D)"),
    ("d_last_part", "last part counted (D)"),
    ("d_completed", "unpacked (D)"),
    ("d_result", "reported (D)"),
)
"""The whole push's stages in the order they happen: (key in the marks, label)."""

PART_STAGES: tuple[tuple[str, str, str], ...] = (
    ("p", "pack", "packed"),
    ("p", "post", "written"),
    ("d", "unpack", "unpacked"),
)
"""A part's spans drawn as bars: (side, start stage, end stage)."""

_PART = re.compile(r"^(p|d)_part(\d+)_(\w+)$")


def parts_of(marks: Mapping[str, float]) -> dict[int, dict[str, float]]:
    """Per part (numbered by first region), its stages as ``<side>_<stage>`` (``p_pack``, ``d_notified``...)."""
    out: dict[int, dict[str, float]] = {}
    for key, v in marks.items():
        m = _PART.match(key)
        if m:
            out.setdefault(int(m[2]), {})[f"{m[1]}_{m[3]}"] = v
    return dict(sorted(out.items()))


def lines(label: str, marks: Mapping[str, float]) -> list[str]:
    """The timeline of one case as text: the whole push's stages, then one line per part (ms after start)."""
    head = "  ".join(f"{name} {marks[k]:.2f}" for k, name in STAGES if k in marks)
    out = [f"{label}: {head}"]
    for i, st in parts_of(marks).items():
        order = sorted(st.items(), key=lambda kv: kv[1])
        out.append(f"    part {i}: " + "  ".join(f"{k} {v:.2f}" for k, v in order))
    return out


def plot(rows: Sequence[tuple[str, Mapping[str, float]]], path: Path, title: str) -> None:
    """Draw ``rows`` (label, marks in ms) as a waterfall: stage markers on a line per case, part spans as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    colors = {"p_pack": "tab:orange", "p_post": "tab:blue", "d_unpack": "tab:green"}
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.8))
    seen: set[str] = set()
    for y, (_label, marks) in enumerate(rows):
        parts = parts_of(marks)
        n = max(1, len(parts))
        for i, st in parts.items():
            for side, a, b in PART_STAGES:
                t0, t1 = st.get(f"{side}_{a}"), st.get(f"{side}_{b}")
                if t0 is None or t1 is None:
                    continue
                key = f"{side}_{a}"
                off = {"p_pack": -0.3, "p_post": -0.1, "d_unpack": 0.1}[key] + 0.18 * i / n
                lab = {"p_pack": "pack (P)", "p_post": "post and WRITE (P)", "d_unpack": "unpack (D)"}[key]
                ax.barh(
                    y + off,
                    max(t1 - t0, 1e-3),
                    left=t0,
                    height=0.16 / n + 0.02,
                    color=colors[key],
                    label=None if lab in seen else lab,
                )
                seen.add(lab)
        for j, (k, name) in enumerate(STAGES):
            if k in marks:
                ax.plot(
                    marks[k],
                    y + 0.35,
                    marker="|v^os*xPD"[j % 9],
                    color=f"C{j % 10}",
                    ms=7,
                    label=None if name in seen else name,
                    linestyle="none",
                )
                seen.add(name)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms after the run's start (ahead: P's KV ready; finished: D's register call)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(fontsize=7, ncol=4, loc="lower center")
    fig.tight_layout(rect=(0, 0.1 if len(rows) > 4 else 0.2, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def medians_ms(result: Mapping[str, Any]) -> dict[str, float]:
    """The CPU bench's median stage times of one result (``at_<key>_s_median``), in ms, keyed as ``STAGES``."""
    out = {}
    for k, v in result.items():
        if k.startswith("at_") and k.endswith("_s_median"):
            out[k[3 : -len("_s_median")]] = 1e3 * v
    return out


def part_times(rec: Any, prefix: str) -> dict[str, float]:
    """A result's per-part stage times (trees since ``PartTimes``), as ``<prefix>part<i>_<stage>``, parts
    numbered by their first region."""
    parts = sorted(getattr(rec, "parts", None) or [], key=lambda pt: (pt.r0, pt.rank))
    return {f"{prefix}part{i}_{stage}": float(t) for i, pt in enumerate(parts) for stage, t in pt.t.items()}
