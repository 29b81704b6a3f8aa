"""Per-request timelines: one structured log line per transfer per side, and the tool that joins them.

Why lines in the server log and not a trace exporter: P and D already write
logs, operators already collect them, and one JSON object per transfer per
side is enough to answer "where did this request's time go?" across the two
processes. With ``KVPUSH_LOG_LEVEL=DEBUG`` every engine logs, when a
transfer ends on its side::

    ... kvpush.timeline {"v":1,"side":"prefill","transfer_id":"…","t":{"registered":1717…,…},…}

The engine records ``time.monotonic()``; this module converts to wall-clock
time (``time.time()``) at emission, because two processes (two hosts) share
no monotonic clock. Cross-process differences (D sent → P received, P done →
D notified) therefore include the clock offset between the hosts; ``kvpush
doctor --peer`` measures it.

``kvpush timeline P.log D.log [--png out.png]`` (``kvpush.cli.timeline``) joins the lines by transfer
id and prints, per stage, the median and p90 and, per request, where its time
went; ``--png`` draws a waterfall of a sample of requests.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpush.core.outcome import Result

LOGGER = logging.getLogger("kvpush.timeline")
MARKER = "kvpush.timeline "
VERSION = 1


# --------------------------------------------------------------------------- #
# Emission (engine thread).
# --------------------------------------------------------------------------- #


def record(side: str, engine: str, result: Result, wall_offset: float | None = None) -> dict[str, Any]:
    """The timeline record of one ended transfer, times in wall-clock seconds."""
    from kvpush.observability.metrics import plan_of

    off = (time.time() - time.monotonic()) if wall_offset is None else wall_offset
    return {
        "v": VERSION,
        "side": side,
        "transfer_id": result.transfer_id,
        "request_id": result.request_id,
        "engine": engine,
        "ok": result.ok,
        "reason": result.reason,
        "cause": result.cause.value if result.cause is not None else "",
        "plan": plan_of(result),
        "bytes": int(result.stats.bytes),
        "descriptors": int(result.stats.descriptors),
        "t": {k: round(v + off, 6) for k, v in sorted(result.times.as_dict().items(), key=lambda kv: kv[1])},
    }


def log_result(side: str, engine: str, result: Result) -> None:
    """Log one ``kvpush.timeline`` log line for ``result`` if debug logging is on for it (cheap otherwise)."""
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("%s%s", MARKER, json.dumps(record(side, engine, result), separators=(",", ":")))


# --------------------------------------------------------------------------- #
# Parsing and joining (the command).
# --------------------------------------------------------------------------- #


def parse_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """Timeline records found in log lines (any prefix before the marker), and how many were unreadable."""
    out: list[dict[str, Any]] = []
    bad = 0
    for line in lines:
        i = line.find(MARKER + "{")
        if i < 0:
            continue
        try:
            rec = json.loads(line[i + len(MARKER) :].strip())
        except ValueError:
            bad += 1
            continue
        if not isinstance(rec, dict) or "transfer_id" not in rec or rec.get("side") not in ("prefill", "decode"):
            bad += 1
            continue
        out.append(rec)
    return out, bad


@dataclass
class Joined:
    """One transfer as both sides logged it; ``p``/``d`` are the ``t`` maps (wall-clock seconds)."""

    transfer_id: str
    p: dict[str, float]
    d: dict[str, float]
    ok: bool
    plan: str
    bytes: int
    p_ranks: int


@dataclass(frozen=True)
class Stage:
    """A joined stage: from event ``a`` on side ``sa`` to event ``b`` on side ``sb``."""

    name: str
    what: str
    sa: str
    a: str
    sb: str
    b: str

    @property
    def cross(self) -> bool:
        """Spans two processes: its length includes the clock offset between them."""
        return self.sa != self.sb

    def seconds(self, j: Joined) -> float | None:
        ta = (j.p if self.sa == "p" else j.d).get(self.a)
        tb = (j.p if self.sb == "p" else j.d).get(self.b)
        if ta is None or tb is None:
            return None
        if self.name == "registration_wait":
            return max(0.0, tb - ta)
        return tb - ta


STAGES = (
    Stage("d_handshake", "D: blocks registered -> Register sent to P", "d", "registered", "d", "sent"),
    Stage("register_delivery", "Register sent (D) -> received (P)", "d", "sent", "p", "registered"),
    Stage("registration_wait", "P: prefill done -> D's registration there", "p", "prefill_done", "p", "registered"),
    Stage("rendezvous_wait", "P: registration there -> push starts", "p", "registered", "p", "push_start"),
    Stage("plan", "P: pieces mapped, plan chosen", "p", "push_start", "p", "planned"),
    Stage("ready_wait", "P: planned -> KV-written marker (layer-wise: the forward)", "p", "planned", "p", "ready"),
    Stage("pack", "P: gather into staging (first part)", "p", "ready", "p", "packed"),
    Stage("post", "P: WRITE posted to NIXL", "p", "packed", "p", "posted"),
    Stage("completion", "P: WRITE in flight", "p", "posted", "p", "completed"),
    Stage("notify", "P WRITE done -> D saw the completion", "p", "completed", "d", "completed"),
    Stage("d_finish", "D: completion -> result to vLLM", "d", "completed", "d", "result"),
)
TOTAL = Stage("total", "D: blocks registered -> KV arrived", "d", "registered", "d", "result")


def join(records: Iterable[dict[str, Any]]) -> tuple[list[Joined], int, int]:
    """Join records by transfer id: (joined transfers, ids only P logged, ids only D logged).

    With several P ranks (TP) writing one transfer, the rank whose WRITE
    completed last stands for P: D waits for it, so it is the critical path.
    """
    by: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        by.setdefault(str(r["transfer_id"]), {"prefill": [], "decode": []})[r["side"]].append(r)
    out: list[Joined] = []
    only_p = only_d = 0
    for tid, sides in by.items():
        ps, ds = sides["prefill"], sides["decode"]
        if not ps:
            only_d += 1
            continue
        if not ds:
            only_p += 1
            continue
        p = max(ps, key=lambda r: r["t"].get("completed", r["t"].get("released", 0.0)))
        d = max(ds, key=lambda r: r["t"].get("result", 0.0))
        out.append(
            Joined(
                tid,
                {k: float(v) for k, v in p["t"].items()},
                {k: float(v) for k, v in d["t"].items()},
                all(r.get("ok") for r in ps + ds),
                str(d.get("plan") or p.get("plan") or ""),
                int(d.get("bytes") or 0),
                len(ps),
            )
        )
    out.sort(key=lambda j: j.d.get("registered", 0.0))
    return out, only_p, only_d


def _q(values: Sequence[float], q: float) -> float:
    from kvpush.observability.metrics import quantile

    return quantile(sorted(values), q)


def summarize(joined: Sequence[Joined]) -> dict[str, dict[str, float]]:
    """Per stage (and total): count, median, p90, mean and share of the summed total."""
    totals = [t for j in joined if (t := TOTAL.seconds(j)) is not None]
    all_total = sum(totals)
    out: dict[str, dict[str, float]] = {}
    for st in (*STAGES, TOTAL):
        vals = [v for j in joined if (v := st.seconds(j)) is not None]
        if not vals:
            continue
        out[st.name] = {
            "n": float(len(vals)),
            "median": _q(vals, 0.5),
            "p90": _q(vals, 0.9),
            "mean": sum(vals) / len(vals),
            "share": (sum(vals) / all_total) if all_total > 0 else math.nan,
        }
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1e3:.2f}"


def render_table(joined: Sequence[Joined], only_p: int, only_d: int, top: int = 20) -> str:
    """Where the time went: per stage median/p90, then the slowest requests stage by stage."""
    lines = [
        f"{len(joined)} transfers joined ({sum(not j.ok for j in joined)} failed); "
        f"{only_p} only in P's log, {only_d} only in D's log"
    ]
    if not joined:
        return "\n".join(lines)
    summ = summarize(joined)
    lines.append("")
    lines.append(f"{'stage':<20} {'median ms':>10} {'p90 ms':>10} {'share':>7}  what")
    for st in (*STAGES, TOTAL):
        s = summ.get(st.name)
        if s is None:
            continue
        overlaps = st.name == "registration_wait"  # on P before D's registration arrives: not in D's wait
        share = "" if overlaps or math.isnan(s["share"]) else f"{s['share'] * 100:.1f}%"
        mark = " *" if st.cross else (" +" if overlaps else "")
        lines.append(f"{st.name:<20} {_ms(s['median']):>10} {_ms(s['p90']):>10} {share:>7}  {st.what}{mark}")
    lines.append("* spans two processes: includes the clock offset between P and D hosts (kvpush doctor --peer)")
    lines.append("+ P's finished prefill waiting for D's registration: may start before D registered, so no share")
    skew = [v for j in joined for st in STAGES if st.cross and (v := st.seconds(j)) is not None and v < 0]
    if skew:
        lines.append(
            f"! {len(skew)} cross-process spans are negative (down to {min(skew) * 1e3:.2f} ms): the clocks "
            "differ by about that much, or (notify, a few ms) P noticed its WRITE done after D saw the completion"
        )
    lines.append("")
    names = [st.name for st in STAGES]
    short = {
        "d_handshake": "hshake",
        "register_delivery": "reg->P",
        "registration_wait": "reg_wait",
        "rendezvous_wait": "rdv_wait",
        "ready_wait": "ready",
        "completion": "complete",
        "d_finish": "d_fin",
    }
    head = f"{'transfer':<14} {'total':>8} " + " ".join(f"{short.get(n, n):>8}" for n in names) + "  plan    MB"
    slowest = sorted(joined, key=lambda j: -(TOTAL.seconds(j) or 0.0))[:top]
    lines.append(f"slowest {len(slowest)} transfers (ms):")
    lines.append(head)
    for j in slowest:
        cells = " ".join(f"{_ms(st.seconds(j)):>8}" for st in STAGES)
        ok = "" if j.ok else "  FAILED"
        lines.append(
            f"{j.transfer_id[:14]:<14} {_ms(TOTAL.seconds(j)):>8} {cells}  {j.plan:<7} {j.bytes / 2**20:.2f}{ok}"
        )
    return "\n".join(lines)


_COLORS = {
    "d_handshake": "#9e9e9e",
    "wait_kv": "#d0d0d0",
    "d_finish": "#607d8b",
    "registration_wait": "#ffcc80",
    "rendezvous_wait": "#ffe0b2",
    "ready_wait": "#b39ddb",
    "plan": "#64b5f6",
    "pack": "#4db6ac",
    "post": "#e57373",
    "completion": "#81c784",
}


def draw_waterfall(joined: Sequence[Joined], path: str | Path, sample: int = 20) -> int:
    """Draw a PNG: per request a D bar and a P bar on one wall-clock axis (ms from D's registration).

    Returns how many requests were drawn (an evenly spaced sample of at most ``sample``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = list(joined)
    if len(rows) > sample:
        step = len(rows) / sample
        rows = [rows[int(i * step)] for i in range(sample)]
    height = 1.6 + 0.45 * max(1, len(rows))
    fig, ax = plt.subplots(figsize=(11, height))
    d_segments = (
        ("d_handshake", "registered", "sent"),
        ("wait_kv", "sent", "completed"),
        ("d_finish", "completed", "result"),
    )
    p_stages = [s for s in STAGES if s.sa == "p" and s.sb == "p"]
    for i, j in enumerate(rows):
        t0 = j.d.get("registered", min(j.d.values(), default=0.0))
        y = len(rows) - 1 - i
        for name, a, b in d_segments:
            if a in j.d and b in j.d and j.d[b] >= j.d[a]:
                ax.barh(y + 0.18, (j.d[b] - j.d[a]) * 1e3, left=(j.d[a] - t0) * 1e3, height=0.32, color=_COLORS[name])
        for st in p_stages:
            # registration_wait (prefill done -> registration) is drawn only when the prefill came first.
            if st.a in j.p and st.b in j.p and j.p[st.b] > j.p[st.a]:
                a0, b0 = j.p[st.a], j.p[st.b]
                ax.barh(y - 0.18, (b0 - a0) * 1e3, left=(a0 - t0) * 1e3, height=0.32, color=_COLORS[st.name])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{j.transfer_id[:10]} D/P" for j in reversed(rows)], fontsize=7)
    ax.set_xlabel("ms since D registered the blocks (wall clock; P bars include the P-D clock offset)")
    ax.set_title(f"kvpush transfer waterfall ({len(rows)} of {len(joined)} transfers)")
    fig.legend(handles=[Patch(color=c, label=n) for n, c in _COLORS.items()], fontsize=7, ncol=5, loc="lower center")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))  # room for the legend below the axis label
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(rows)
