"""What ``kvpush bench serve --profile multi-turn`` reports from its run files: TTFT per turn index, TPOT, D's
prompt tokens by source and the turn routes, per cell (mode, router) and point (turn length). Pure: no process,
no socket.

A run file (``multiturn_<cell>_tok<N>_iter<i>.json``, :func:`run_name`) holds one cell's conversations of one
(iteration, point): per request its conversation, turn (1-based), prompt length, TTFT, latency, output tokens.
Rules of the summary:

* **per turn index**, the requests of all conversations and iterations pooled: median and p90 TTFT; each
  iteration's median too, and their min..max is the **spread** (one cell of a shared 2-core host moves
  several fold between runs, so a number is only worth its spread);
* **TPOT** ``(latency - ttft) / (output_tokens - 1)`` as ``vllm bench serve`` defines it, pooled per turn;
* **ratios** against ``kvpush`` (today's path) per turn, of pooled medians and per iteration: the two cells
  of one iteration ran back to back on the same conversations, so their ratio shares that moment's load;
* **later turns** (index >= 2) pooled, against ``kvpush``: the issue's goal is ``kvpush``'s median over
  ``kvpush-multi-turn``'s of at least 2 at 4k-token turns, with TPOT no worse.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench.loadgen import percentile

BASE = "kvpush"
_NAME_RE = re.compile(r"^multiturn_(?P<cell>[A-Za-z0-9_.-]+)_tok(?P<tok>\d+)_iter(?P<it>\d+)\.json$")


def run_name(cell_label: str, turn_tokens: int, iteration: int) -> str:
    """``multiturn_<cell>_tok<N>_iter<i>.json`` (a cell label's spaces become ``_``)."""
    return f"multiturn_{cell_label.replace(' ', '_')}_tok{turn_tokens}_iter{iteration}.json"


def parse_run_name(name: str) -> tuple[str, int, int] | None:
    """(cell label, turn tokens, iteration) of a run file's name; None for other names."""
    m = _NAME_RE.match(Path(name).name)
    if m is None:
        return None
    return m["cell"].replace("_", " "), int(m["tok"]), int(m["it"])


def tpot(ttft: float, latency: float, output_tokens: int) -> float | None:
    """Seconds per output token after the first; None with fewer than two tokens."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else None


Key = tuple[int, str, int]  # (turn tokens, cell label, turn)


def per_turn(runs: Iterable[Mapping[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Per (turn tokens, cell, turn): pooled median/p90 TTFT and median TPOT (ms), each iteration's medians,
    their min..max, requests and failures."""
    pool: dict[Key, dict[str, Any]] = {}
    for run in runs:
        k = run["kvpush"]
        for r in run["requests"]:
            key = (int(k["turn_tokens"]), str(k["cell"]), int(r["turn"]))
            p = pool.setdefault(key, {"ttft": [], "tpot": [], "it_ttft": {}, "it_tpot": {}, "n": 0, "failed": 0})
            p["n"] += 1
            if r.get("error"):
                p["failed"] += 1
                continue
            it = int(k["iteration"])
            p["ttft"].append(r["ttft"])
            p["it_ttft"].setdefault(it, []).append(r["ttft"])
            t = tpot(r["ttft"], r["latency"], int(r["output_tokens"]))
            if t is not None:
                p["tpot"].append(t)
                p["it_tpot"].setdefault(it, []).append(t)
    out: dict[Key, dict[str, Any]] = {}
    for key, p in sorted(pool.items()):
        it_ttft = [percentile(p["it_ttft"][i], 50) * 1000 for i in sorted(p["it_ttft"])]
        it_tpot = [percentile(p["it_tpot"][i], 50) * 1000 for i in sorted(p["it_tpot"])]
        out[key] = {
            "turn_tokens": key[0],
            "cell": key[1],
            "turn": key[2],
            "requests": p["n"],
            "failed": p["failed"],
            "median_ttft_ms": percentile(p["ttft"], 50) * 1000,
            "p90_ttft_ms": percentile(p["ttft"], 90) * 1000,
            "median_tpot_ms": percentile(p["tpot"], 50) * 1000,
            "iterations": sorted(p["it_ttft"]),
            "iter_median_ttft_ms": it_ttft,
            "iter_median_tpot_ms": it_tpot,
            "ttft_spread_ms": [min(it_ttft), max(it_ttft)] if it_ttft else None,
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _iter_medians(
    runs: Sequence[Mapping[str, Any]], tokens: int, cell: str, turns: str, metric: str
) -> dict[int, float]:
    """Each iteration's median ``metric`` (ms) of ``cell`` at ``tokens``, over the first turn (``turns``
    ``"first"``) or the later ones (``"later"``)."""
    per: dict[int, list[float]] = {}
    for run in _of(runs, tokens, cell):
        per.setdefault(int(run["kvpush"]["iteration"]), []).extend(_values(run, turns, metric))
    return {i: percentile(v, 50) * 1000 for i, v in sorted(per.items()) if v}


def _of(runs: Sequence[Mapping[str, Any]], tokens: int, cell: str) -> list[Mapping[str, Any]]:
    return [r for r in runs if int(r["kvpush"]["turn_tokens"]) == tokens and r["kvpush"]["cell"] == cell]


def later_turns(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (turn tokens, cell): median TTFT and TPOT of turns >= 2 (and of turn 1), pooled and per iteration,
    and ``kvpush``'s median over the cell's (a speedup: above 1, the cell is faster) with its min..max over
    the iterations both ran."""
    cells = sorted({(int(r["kvpush"]["turn_tokens"]), str(r["kvpush"]["cell"])) for r in runs})
    rows = []
    for tokens, cell in cells:
        row: dict[str, Any] = {"turn_tokens": tokens, "cell": cell}
        for turns in ("first", "later"):
            for metric in ("ttft", "tpot"):
                mine = _iter_medians(runs, tokens, cell, turns, metric)
                vals = [v for run in _of(runs, tokens, cell) for v in _values(run, turns, metric)]
                row[f"{turns}_median_{metric}_ms"] = percentile(vals, 50) * 1000 if vals else None
                row[f"{turns}_iter_median_{metric}_ms"] = list(mine.values())
                if metric == "ttft" and turns == "later":
                    base = _iter_medians(runs, tokens, BASE, turns, metric)
                    per = [_ratio(base[i], mine[i]) for i in sorted(set(base) & set(mine))]
                    ok = [x for x in per if x is not None]
                    row["later_speedup_vs_kvpush"] = None
                    row["later_speedup_per_iteration"] = per
                    row["later_speedup_spread"] = [min(ok), max(ok)] if ok else None
        rows.append(row)
    by = {(r["turn_tokens"], r["cell"]): r for r in rows}
    for r in rows:
        b = by.get((r["turn_tokens"], BASE))
        if b is not None:
            r["later_speedup_vs_kvpush"] = _ratio(b["later_median_ttft_ms"], r["later_median_ttft_ms"])
            r["later_tpot_vs_kvpush"] = _ratio(r["later_median_tpot_ms"], b["later_median_tpot_ms"])
    return rows


def _values(run: Mapping[str, Any], turns: str, metric: str) -> list[float]:
    out = []
    for r in run["requests"]:
        if r.get("error") or (int(r["turn"]) >= 2) != (turns == "later"):
            continue
        v = r["ttft"] if metric == "ttft" else tpot(r["ttft"], r["latency"], int(r["output_tokens"]))
        if v is not None:
            out.append(v)
    return out


def sources(runs: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ``<cell> tok<N>``: D's prompt tokens by source (vLLM's ``local_cache_hit``,
    ``external_kv_transfer``, ``local_compute``), P's computed ones, and the router's turn routes, summed over
    the runs."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        k = run["kvpush"]
        row = out.setdefault(f"{k['cell']} tok{k['turn_tokens']}", {"d": {}, "p": {}, "routes": {}, "runs": 0})
        row["runs"] += 1
        for side, name in (
            ("d", "d_prompt_tokens_by_source"),
            ("p", "p_prompt_tokens_by_source"),
            ("routes", "routes"),
        ):
            for src, v in (k.get(name) or {}).items():
                row[side][src] = row[side].get(src, 0) + v
    return out


def table(turn_rows: Mapping[Key, Mapping[str, Any]], later: Sequence[Mapping[str, Any]]) -> str:
    """Per point: median TTFT (ms) per turn and cell [iteration min..max], then each cell's later turns
    against ``kvpush``."""
    lines = []
    for tokens in sorted({k[0] for k in turn_rows}):
        cells = list(dict.fromkeys(k[1] for k in turn_rows if k[0] == tokens))
        turns = sorted({k[2] for k in turn_rows if k[0] == tokens})
        lines.append(f"turn length {tokens} tokens: median TTFT ms [iteration medians min..max], p90")
        lines.append(f"{'turn':>4} | " + " | ".join(f"{c:^28}" for c in cells))
        for t in turns:
            cols = []
            for c in cells:
                r = turn_rows.get((tokens, c, t))
                if r is None:
                    cols.append(f"{'-':^28}")
                    continue
                lo, hi = r["ttft_spread_ms"] or (float("nan"), float("nan"))
                cols.append(f"{r['median_ttft_ms']:7.0f} [{lo:6.0f}..{hi:6.0f}] {r['p90_ttft_ms']:6.0f}")
            lines.append(f"{t:>4} | " + " | ".join(cols))
        for r in later:
            if r["turn_tokens"] != tokens:
                continue
            sp = r.get("later_speedup_spread") or [None, None]
            speed, tp = _f(r.get("later_speedup_vs_kvpush"), ".2f"), _f(r.get("later_tpot_vs_kvpush"), ".2f")
            lines.append(
                f"  {r['cell']:<24} turns>=2: TTFT {_f(r['later_median_ttft_ms'])} ms, TPOT "
                f"{_f(r['later_median_tpot_ms'], '.1f')} ms; kvpush/this TTFT {speed}"
                f" [{_f(sp[0], '.2f')}..{_f(sp[1], '.2f')}], TPOT this/kvpush {tp}"
            )
        lines.append("")
    return "\n".join(lines)


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def summary_json(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``multi_turn_summary.json``: the per-turn rows, the later turns against ``kvpush``, the sources."""
    rows = per_turn(runs)
    return {"per_turn": list(rows.values()), "later_turns": later_turns(runs), "sources": sources(runs)}
