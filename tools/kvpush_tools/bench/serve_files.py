"""The result files of ``kvpush bench serve``: one JSON per (mode, router, QPS, lengths, iteration), named so a
folder can be read back (:func:`load_results`) and compacted for the repository (:func:`compact`).

The files use the keys of ``vllm bench serve``'s result file where the two overlap (see
:mod:`kvpush_tools.bench.loadgen`), so vLLM's own tooling reads them; kvpush's bookkeeping sits under ``"kvpush"``.
Pure: no process, no socket."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpush_tools.bench.loadgen import DEFAULT_ROUTER, MODES, ROUTERS

_NAME_RE = re.compile(
    r"^(?P<mode>[A-Za-z0-9-]+?)(?:_via-(?P<router>[A-Za-z0-9-]+))?"
    r"_qps(?P<qps>[0-9.]+|inf)_in(?P<inp>\d+)_out(?P<out>\d+)_iter(?P<it>\d+)\.json$"
)


def fmt_qps(qps: float) -> str:
    """``0.5`` -> ``"0.5"``, ``4.0`` -> ``"4"``, ``inf`` -> ``"inf"``."""
    return "inf" if math.isinf(qps) else f"{qps:g}"


def result_name(
    mode: str, qps: float, input_len: int, output_len: int, iteration: int, router: str | None = None
) -> str:
    """``<mode>[_via-<router>]_qps<q>_in<in>_out<out>_iter<i>.json``: the seed's naming, plus the router
    when one is named (a sweep always names it; files without it, the seed's and ``vllm bench serve``'s
    renamed ones, count as :data:`DEFAULT_ROUTER`'s)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if router is not None and router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; expected one of {ROUTERS}")
    via = f"_via-{router}" if router is not None else ""
    return f"{mode}{via}_qps{fmt_qps(qps)}_in{input_len}_out{output_len}_iter{iteration}.json"


def parse_result_name(name: str) -> tuple[str, float, int, int, int] | None:
    """Inverse of :func:`result_name` but the router (:func:`router_of_name`); None for other file names."""
    m = _NAME_RE.match(Path(name).name)
    if m is None or m["mode"] not in MODES or (m["router"] is not None and m["router"] not in ROUTERS):
        return None
    return m["mode"], float(m["qps"]), int(m["inp"]), int(m["out"]), int(m["it"])


def router_of_name(name: str) -> str:
    """The router a run file's name says (:data:`DEFAULT_ROUTER` when it names none)."""
    m = _NAME_RE.match(Path(name).name)
    return (m["router"] if m is not None else None) or DEFAULT_ROUTER


def write_result(directory: Path, result: Mapping[str, Any]) -> Path:
    """Write one run's JSON under its canonical name (from ``result["kvpush"]``)."""
    k = result["kvpush"]
    path = Path(directory) / result_name(
        k["mode"], k["qps"], k["input_len"], k["output_len"], k["iteration"], k.get("router")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=True) + "\n")
    return path


def load_results(directory: Path) -> list[dict[str, Any]]:
    """Every run JSON in ``directory`` whose name follows :func:`result_name`.

    The point's coordinates come from the file name (the contract), so files
    from another tool that only share the naming still load.
    """
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        key = parse_result_name(path.name)
        if key is None:
            continue
        data = json.loads(path.read_text())
        mode, qps, inp, outl, it = key
        data.setdefault("kvpush", {}).update(
            {
                "mode": mode,
                "router": router_of_name(path.name),
                "qps": qps,
                "input_len": inp,
                "output_len": outl,
                "iteration": it,
            }
        )
        out.append(data)
    return out


def compact(result: Mapping[str, Any]) -> dict[str, Any]:
    """A copy without the per-token ``itls`` and texts (the bulk of a file).

    What a committed results folder keeps: every statistic, and per request
    its TTFT, latency and token counts, enough to recompute TTFT/TPOT/E2E
    percentiles across iterations; only ITL percentiles are then frozen at
    the per-run values. The stack description (server flags, connector
    configs), equal for all runs of a sweep, is left to ``sweep.json``.
    """
    out = {k: v for k, v in result.items() if k not in ("itls", "generated_texts")}
    out["itls_dropped"] = True
    if isinstance(out.get("kvpush"), dict) and "stack" in out["kvpush"]:
        # The same for every run of a sweep: sweep.json holds it once.
        out["kvpush"] = {k: v for k, v in out["kvpush"].items() if k != "stack"}
    return out
