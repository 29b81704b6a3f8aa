"""``kvpush bench layerwise``: TTFT of disaggregated serving vs prompt length, with and without the transfer.

Three modes, side by side in one run (issue #9, layer-wise push):

* ``single``: one plain vLLM server, no connector, no router, pinned to the
  prefill cores. It prefills and samples the first token itself: TTFT with
  no KV transfer at all, the baseline.
* ``request``: kvpush 1P1D behind the router, whole-request push (the
  default): P pushes the request's KV once its prefill has finished.
* ``layer``: the same pair with ``"layerwise": true`` in
  ``kv_connector_extra_config`` on P and D (``--layer-config``): P pushes
  each layer's KV while it computes the next ones, so only the tail of the
  transfer should remain after the prefill.

Requests go **one at a time** (no concurrency: this measures latency, not
load), streamed, ``max_tokens`` 4 with ``ignore_eos``, each a distinct prompt
of exactly the length asked (:func:`kvpush_tools.demo.tiny_model.prompt_words`;
prefix caching is off, so every request transfers its whole prompt).

**Interleaving.** For each repetition, for each prompt length, every mode
sends one request, the mode order rotated from point to point, so the modes
of one point run seconds apart and a burst of other people's load (load
average 4-14 here) hits them alike. All stacks stay up; the ones not being
measured are paused with SIGSTOP (:func:`kvpush_tools.bench.stacks.activate`), as
in ``bench serve``:
restarting vLLM costs minutes per pair here, so keeping one stack at a time
would forbid interleaving, and drift of this shared machine (other people's
jobs) would then land on whichever mode ran last; idle kvpush and plain vLLM
servers cost little CPU, but a paused one costs none and cannot take the
core from the measured P. Each request follows a resume and two short
warm-up requests, which absorb the pause's side effects (peers looking
silent, re-handshakes).

**What is reported**, per (mode, length): the median client TTFT; the
overhead ``TTFT(mode) - TTFT(single)`` (difference of the medians, and the
median of the per-repetition paired differences, more robust to drift);
for ``layer`` the fraction of the whole-request overhead that remains,
``(layer - single) / (request - single)``. The overhead contains more than the
transfer (router hop, D's registration, D's first step); the transfer itself
comes from kvpush's own histograms, scraped from P's and D's ``/metrics``
around every request (``kvpush_transfer_latency_seconds``,
``kvpush_transfer_stage_seconds``, ``kvpush_transfer_size_bytes``; see
docs/operability.md), and vLLM's ``request_prefill_time`` on P (``single``:
on its server) gives the prefill compute of that same request.

Writes ``layerwise.json`` (every request, the summary, the model's shape and
the exact stacks; well under 100 KiB) and ``layerwise.png``;
``--report DIR`` redraws both and the table from an existing run.

**Model** (:data:`MODEL_SHAPE`): :func:`kvpush_tools.demo.tiny_model.make_tiny_model`
with 32 layers, 2 KV heads (and 2 query heads) x 128 dims, hidden 256, fp32:
64 KiB of KV per token (16x the demo model's), 16 MiB at 256 tokens, 128 MiB
at 2048, 256 MiB at 4096. Chosen by measuring plain vLLM-CPU servers (one
core each, machine load average about 10) on two candidates:

==========================  ========  ========  =========  =========
TTFT, ms (2 requests)       256 tok   1024 tok  2048 tok   4096 tok
==========================  ========  ========  =========  =========
32 layers, 2 KV x 128       459-812   2444-2635 11708-14235 43353-49574
24 layers, 8 KV x 128       1349-1600 10756-11437  -          -
==========================  ========  ========  =========  =========

The brief asked for hundreds of MiB at 4k tokens with a prefill well under a
few seconds; on this CPU that cannot be had. Attention costs about
``2 * seq^2 * q_dim`` flops per layer and stores ``8 * seq * kv_dim`` bytes of
fp32 KV, with ``q_dim >= kv_dim``: whatever the layers and heads, a prompt of
``seq`` tokens computes at least ``seq / 4`` flops per byte of KV it will
transfer (1024 flops per byte at 4096 tokens), and vLLM-CPU's attention ran
here at a few GFLOP/s per core. So a 4096-token prompt with 256 MiB of KV
took 45 s to prefill, and one with 32 MiB would still take seconds while
its push takes about 10 ms. The transfer is relatively largest at short and
middle lengths, where per-layer overheads, not attention, dominate prefill;
hence 32 layers (fine-grained for a layer-wise pipeline) with the smallest
head count that gives tens of MiB there (``num_heads = num_kv_heads``, the
cheapest attention per KV byte), and default lengths 256-2048 (4096 is one
``--lengths`` away, at about 45 s per prefill on a loaded machine). The 8-KV-head
shape puts 4x the KV per token but also 4x the prefill time, gaining nothing
in the ratio that matters (push time over TTFT).

Examples::

    kvpush bench layerwise                                   # all three modes (needs the layerwise key)
    kvpush bench layerwise --modes single,request --reps 3   # the harness without the layer mode
    kvpush bench layerwise --report results/bench_layerwise/run-...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush_tools.bench.stacks import (
    SINGLE,
    Stack,
    StackOptions,
    activate,
    add_stack_arguments,
    build_stack,
    comma_list,
    http_get,
    ints,
    run_with_stacks,
    stack_options,
    start_stacks,
)

MODES = ("single", "request", "layer")
DEFAULT_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_REPS = 5
DEFAULT_MAX_TOKENS = 4
DEFAULT_LAYER_CONFIG = (
    '{"layerwise": true, "layerwise_min_tokens": 0, "layerwise_min_part_bytes": 0, "layerwise_lead_layers": 1000}'
)
COLORS = {"single": "#7f7f7f", "request": "#1f77b4", "layer": "#d62728"}
LABELS = {
    "single": "single vLLM (no transfer)",
    "request": "kvpush 1P1D, whole-request push",
    "layer": "kvpush 1P1D, layer-wise push",
}

# The model: make_tiny_model's keyword arguments (why: "Model" in the module docstring).
MODEL_SHAPE: dict[str, Any] = {
    "num_layers": 32,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "dtype": "float32",
}
DEFAULT_MODEL_DIR = "models/tiny-qwen3-lw"


def kv_bytes_per_token(shape: Mapping[str, Any]) -> int:
    """K and V of every layer for one token (fp32: 4 bytes per element)."""
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[shape.get("dtype", "float32")]
    return 2 * int(shape["num_layers"]) * int(shape["num_kv_heads"]) * int(shape["head_dim"]) * elem


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# Plan (pure)
# --------------------------------------------------------------------------- #


def visit_plan(modes: Sequence[str], reps: int, lengths: Sequence[int]) -> list[tuple[int, int, str]]:
    """(repetition, length, mode) of every measured request, in run order.

    For each repetition, for each length, every mode once, the order rotated
    by one from point to point: the modes of one point run within seconds of
    each other (a burst of other people's load hits them alike), and each
    mode goes first, second and third equally often."""
    out = []
    k = 0
    for rep in range(reps):
        for length in lengths:
            r = k % len(modes)
            out.extend((rep, length, m) for m in [*modes[r:], *modes[:r]])
            k += 1
    return out


def prompt_seed(seed: int, rep: int, length: int) -> int:
    """The prompt of (repetition, length): the same for every mode, distinct otherwise."""
    return seed * 1_000_003 + rep * 10_007 + length


# --------------------------------------------------------------------------- #
# Prometheus scraping (pure parsing)
# --------------------------------------------------------------------------- #

HistKey = tuple[str, tuple[tuple[str, str], ...]]  # (metric name, sorted labels without vLLM's)
_DROP_LABELS = {"model_name", "engine", "le"}


# Counters kept as [value, value]: their delta's "count" is how much they grew.
COUNTERS = ("kvpush_transfer_parts_total", "kvpush_layerwise_prefills_total", "kvpush_layer_reports_total")


def parse_histograms(text: str, prefixes: Sequence[str] = ("kvpush_", "vllm:request_prefill_time")) -> dict[str, Any]:
    """``{"name|k=v,k=v": [sum, count]}`` of every histogram whose name starts
    with one of ``prefixes`` (vLLM's ``model_name``/``engine`` labels dropped and
    summed over), and ``[value, value]`` of the :data:`COUNTERS`."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(tuple(prefixes)):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name.endswith("_sum"):
            base, slot = name[:-4], 0
        elif name.endswith("_count"):
            base, slot = name[:-6], 1
        elif name in COUNTERS:
            base, slot = name, 2
        else:
            continue
        pairs = []
        for item in labels.rstrip("}").split(","):
            k, _, v = item.partition("=")
            if k and k not in _DROP_LABELS:
                pairs.append((k.strip(), v.strip().strip('"')))
        key = base + "|" + ",".join(f"{k}={v}" for k, v in sorted(pairs))
        try:
            v = float(value)
        except ValueError:
            continue
        cell = out.setdefault(key, [0.0, 0.0])
        for i in (0, 1) if slot == 2 else (slot,):
            cell[i] += v
    return out


def histogram_delta(before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Per key with new observations: ``[mean of the new observations, how many]``."""
    out = {}
    for key, (s1, c1) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        if c1 > c0:
            out[key] = [(s1 - s0) / (c1 - c0), round(c1 - c0)]
    return out


def scrape(url: str | None) -> dict[str, Any]:
    if not url:
        return {}
    status, text = http_get(url + "/metrics", timeout=5.0)
    return parse_histograms(text) if status == 200 else {}


def _metric(delta: Mapping[str, Sequence[float]], name: str, **labels: str) -> float | None:
    key = name + "|" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    v = delta.get(key)
    return float(v[0]) if v else None


def transfer_fields(p_delta: Mapping[str, Any], d_delta: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of one request worth keeping (ms, MiB), from the two deltas."""
    out: dict[str, Any] = {}

    def put(field: str, v: float | None, scale: float) -> None:
        if v is not None:
            out[field] = round(v * scale, 3)

    put("p_prefill_ms", _metric(p_delta, "vllm:request_prefill_time_seconds"), 1e3)
    put("d_prefill_ms", _metric(d_delta, "vllm:request_prefill_time_seconds"), 1e3)
    put("p_transfer_ms", _metric(p_delta, "kvpush_transfer_latency_seconds", side="prefill"), 1e3)
    put("d_transfer_ms", _metric(d_delta, "kvpush_transfer_latency_seconds", side="decode"), 1e3)
    put("size_mib", _metric(p_delta, "kvpush_transfer_size_bytes", side="prefill"), 1 / 2**20)
    for field, name in (("p_parts", "kvpush_transfer_parts_total"), ("p_layerwise", "kvpush_layerwise_prefills_total")):
        grown = p_delta.get(name + "|side=prefill")
        if grown:
            out[field] = grown[1]
    stages: dict[str, float] = {}
    for delta, side in ((p_delta, "prefill"), (d_delta, "decode")):
        for key, (mean, _n) in delta.items():
            if key.startswith("kvpush_transfer_stage_seconds|") and f"side={side}" in key:
                stage = dict(kv.split("=", 1) for kv in key.split("|", 1)[1].split(",")).get("stage", "?")
                stages[f"{side[0]}_{stage}"] = round(mean * 1e3, 3)
    if stages:
        out["stages_ms"] = stages
    return out


# --------------------------------------------------------------------------- #
# Summary (pure)
# --------------------------------------------------------------------------- #


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    v = sorted(xs)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def summarize(records: Sequence[Mapping[str, Any]], modes: Sequence[str], lengths: Sequence[int]) -> dict[str, Any]:
    """Per (mode, length): medians; per length: overheads against ``single``
    and the layer/request fraction. Failed requests are counted, not timed."""
    by: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in records:
        by.setdefault((r["mode"], r["length"]), []).append(r)
    points: dict[str, dict[str, Any]] = {}
    for length in lengths:
        row: dict[str, Any] = {}
        ttft: dict[str, float | None] = {}
        for mode in modes:
            rs = by.get((mode, length), [])
            ok = [r for r in rs if r.get("ok")]
            ttft[mode] = _median(r["ttft_ms"] for r in ok)
            cell: dict[str, Any] = {
                "n": len(rs),
                "failed": len(rs) - len(ok),
                "median_ttft_ms": _r(ttft[mode]),
                "p25_ttft_ms": _r(_percentile([r["ttft_ms"] for r in ok], 25)),
                "p75_ttft_ms": _r(_percentile([r["ttft_ms"] for r in ok], 75)),
                "min_ttft_ms": _r(min((r["ttft_ms"] for r in ok), default=None)),
                "max_ttft_ms": _r(max((r["ttft_ms"] for r in ok), default=None)),
            }
            after = _median(r["ttft_ms"] - r["p_prefill_ms"] for r in ok if r.get("p_prefill_ms") is not None)
            if after is not None:
                cell["median_after_prefill_ms"] = _r(after)
            if any("p_parts" in r for r in ok):
                cell["median_p_parts"] = _median(r.get("p_parts") for r in ok)
                cell["layerwise_prefills"] = sum(r.get("p_layerwise", 0) for r in ok)
            for f in ("p_prefill_ms", "d_prefill_ms", "p_transfer_ms", "d_transfer_ms", "size_mib"):
                m = _median(r.get(f) for r in ok)
                if m is not None:
                    cell["median_" + f] = _r(m, 3 if f == "size_mib" else 2)
            stage_names = sorted({s for r in ok for s in r.get("stages_ms", {})})
            if stage_names:
                cell["median_stages_ms"] = {
                    s: _r(_median(r.get("stages_ms", {}).get(s) for r in ok), 3) for s in stage_names
                }
            row[mode] = cell
        base = ttft.get(SINGLE)
        for mode in modes:
            if mode == SINGLE or base is None or ttft.get(mode) is None:
                continue
            row[mode]["overhead_ms"] = _r(ttft[mode] - base)  # type: ignore[operator]
            row[mode]["overhead_paired_ms"] = _r(_paired_median(by, mode, length))
        base_after = row.get(SINGLE, {}).get("median_after_prefill_ms")
        for mode in modes:
            after = row[mode].get("median_after_prefill_ms")
            if mode != SINGLE and base_after is not None and after is not None:
                row[mode]["overhead_net_ms"] = _r(after - base_after)
        for key, field in (("layer_fraction", "overhead_ms"), ("layer_fraction_net", "overhead_net_ms")):
            req, lay = row.get("request", {}).get(field), row.get("layer", {}).get(field)
            if req is not None and lay is not None:
                row[key] = round(lay / req, 3) if req > 0 else None
        points[str(length)] = row
    return {"points": points}


def _paired_median(by: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]], mode: str, length: int) -> float | None:
    """Median over repetitions of TTFT(mode) - TTFT(single), both of the same repetition."""
    base = {r["rep"]: r["ttft_ms"] for r in by.get((SINGLE, length), []) if r.get("ok")}
    diffs = [r["ttft_ms"] - base[r["rep"]] for r in by.get((mode, length), []) if r.get("ok") and r["rep"] in base]
    return statistics.median(diffs) if diffs else None


def _fmt(x: float | None, nd: int = 0) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(doc: Mapping[str, Any]) -> str:
    """The summary as text: one line per prompt length."""
    modes = doc["modes"]
    pts = doc["summary"]["points"]
    kv_modes = [m for m in modes if m != SINGLE]
    both = "layer" in modes and "request" in modes
    cols: list[tuple[str, Any]] = [(f"{m} TTFT", (m, "median_ttft_ms", 0)) for m in modes]
    cols += [(f"{m} P-pref", (m, "median_p_prefill_ms", 0)) for m in modes]
    cols += [(f"{m} ovh", (m, "overhead_ms", 0)) for m in kv_modes]
    cols += [("layer/req", (None, "layer_fraction", 2))] if both else []
    cols += [(f"{m} net", (m, "overhead_net_ms", 0)) for m in kv_modes]
    cols += [("net l/r", (None, "layer_fraction_net", 2))] if both else []
    cols += [(f"{m} push", (m, "median_p_transfer_ms", 1)) for m in kv_modes]
    widths = [max(len(name), 7) for name, _ in cols]
    head = f"{'tokens':>6} {'KV MiB':>6} " + " ".join(f"{n:>{w}}" for (n, _), w in zip(cols, widths, strict=True))
    lines = [head, "-" * len(head)]
    bpt = doc.get("model", {}).get("kv_bytes_per_token")
    for length in doc["lengths"]:
        row = pts.get(str(length), {})
        kv = _fmt(length * bpt / 2**20, 0) if bpt else "-"
        cells = []
        for (_, (mode, field, nd)), w in zip(cols, widths, strict=True):
            v = row.get(field) if mode is None else row.get(mode, {}).get(field)
            cells.append(f"{_fmt(v, nd):>{w}}")
        lines.append(f"{length:>6} {kv:>6} " + " ".join(cells))
    lines.append(
        "ms, medians over repetitions. P-pref: vLLM's request_prefill_time on P (single: on its server); "
        "ovh: TTFT(mode) - TTFT(single); layer/req: (layer - single) / (request - single); "
        "net: the same on TTFT - P-pref per request (prefill noise removed); "
        "push: kvpush_transfer_latency_seconds on P, first WRITE posted to last done "
        "(layer-wise: it spans the forward)"
    )
    failed = sum(c.get("failed", 0) for row in pts.values() for c in row.values() if isinstance(c, dict))
    if failed:
        lines.append(f"{failed} request(s) FAILED (see 'requests' in the JSON)")
    return "\n".join(lines)


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Three panels against prompt length. Left: median TTFT per mode (p25-p75
    band). Middle: overhead over ``single`` per kvpush mode (difference of the
    medians, and median of the paired differences). Right: what comes after
    the prefill, TTFT minus P's prefill time, per mode (robust to the prefill's
    noise), with kvpush's push time on P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, lengths, pts = doc["modes"], doc["lengths"], doc["summary"]["points"]

    def series(mode: str, field: str) -> tuple[list[int], list[float]]:
        xs = [n for n in lengths if pts.get(str(n), {}).get(mode, {}).get(field) is not None]
        return xs, [pts[str(n)][mode][field] for n in xs]

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.4))
    for mode in modes:
        xs, ys = series(mode, "median_ttft_ms")
        if not xs:
            continue
        c = COLORS.get(mode)
        a1.plot(xs, ys, "o-", color=c, label=LABELS.get(mode, mode))
        _, lo = series(mode, "p25_ttft_ms")
        _, hi = series(mode, "p75_ttft_ms")
        if len(lo) == len(xs) == len(hi):
            a1.fill_between(xs, lo, hi, color=c, alpha=0.12)
        if mode != SINGLE:
            a2.plot(*series(mode, "overhead_ms"), "o-", color=c, label=f"{mode}: difference of medians")
            a2.plot(*series(mode, "overhead_paired_ms"), "^:", color=c, label=f"{mode}: median of paired differences")
            if mode == "request":  # a layer-wise push spans the forward: not an after-prefill time
                push = series(mode, "median_p_transfer_ms")
                a3.plot(*push, "s--", color=c, alpha=0.7, label=f"{mode}: the push on P (kvpush metric)")
        a3.plot(*series(mode, "median_after_prefill_ms"), "o-", color=c, label=f"{mode}: TTFT - prefill")
    a1.set_ylabel("TTFT (ms): median, band p25-p75")
    a1.set_title("Time to first token, one request at a time")
    a2.set_ylabel("ms")
    a2.set_title("TTFT(mode) - TTFT(single)")
    a2.axhline(0, color="k", lw=0.6)
    a3.set_ylabel("ms, medians")
    a3.set_title("After the prefill: TTFT - P's prefill time")
    for ax in (a1, a2, a3):
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    shape = doc.get("model", {}).get("shape", {})
    if shape:
        fig.suptitle(
            f"tiny Qwen3: {shape.get('num_layers')} layers, {shape.get('num_kv_heads')} KV heads x "
            f"{shape.get('head_dim')}, {shape.get('dtype')}: "
            f"{doc['model'].get('kv_bytes_per_token', 0) // 1024} KiB of KV per token; "
            f"{doc.get('reps', '?')} repetitions",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    try:  # a palette PNG is a third of the size: results are committed
        from PIL import Image

        with Image.open(path) as im:
            im.convert("RGB").quantize(colors=64).save(path, optimize=True)
    except (ImportError, OSError):
        pass
    return path


# --------------------------------------------------------------------------- #
# Running
# --------------------------------------------------------------------------- #


def measure_one(stack: Stack, prompt: str, length: int, max_tokens: int) -> dict[str, Any]:
    """One streamed request through ``stack``, with the kvpush and vLLM
    histograms of P and D scraped around it."""
    from kvpush_tools.bench.client import request_body, run_load, wait_drained

    p_url = stack.prefill.url if stack.prefill is not None else None
    d_url = stack.d_url if stack.decode is not None else None
    p0, d0 = scrape(p_url), scrape(d_url)
    body = request_body(prompt, max_tokens)
    outs, _ = asyncio.run(run_load(stack.url, [body["prompt"]], [length], [0.0], max_tokens, timeout_s=600))
    res = outs[0]
    wait_drained(stack)
    p1 = _scrape_until(p_url, p0, "kvpush_transfer_latency_seconds|side=prefill", stack.decode is not None)
    d1 = scrape(d_url)
    rec: dict[str, Any] = {"ok": res.ok, "ttft_ms": round(res.ttft * 1e3, 2) if res.ok else None}
    if res.ok:
        rec["e2e_ms"] = round(res.latency * 1e3, 2)
        rec["output_tokens"] = res.output_tokens
    else:
        rec["error"] = res.error[:300]
    rec.update(transfer_fields(histogram_delta(p0, p1), histogram_delta(d0, d1)))
    return rec


def _scrape_until(
    url: str | None, before: Mapping[str, Any], key: str, expect: bool, timeout: float = 3.0
) -> dict[str, Any]:
    """Scrape ``url`` until ``key``'s count grew (P reports a transfer in the
    engine step after it completed; vLLM keeps stepping while a push is
    pending, so this is quick), or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = scrape(url)
        if not expect or now.get(key, (0, 0))[1] > before.get(key, (0, 0))[1] or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def run_visits(args: argparse.Namespace, stacks: Mapping[str, Stack]) -> list[dict[str, Any]]:
    """Every request of :func:`visit_plan`; the stack measured is resumed (the
    others paused) and warmed up before each."""
    from kvpush_tools.bench.client import warm_up
    from kvpush_tools.demo.tiny_model import prompt_words

    records: list[dict[str, Any]] = []
    for i, (rep, length, mode) in enumerate(visit_plan(args.modes, args.reps, args.lengths)):
        stack = stacks[mode]
        activate(stacks, stack)
        warm = warm_up(stack, 256, seed=args.seed + 7919 + i, n=args.warmup)
        time.sleep(args.settle)
        prompt = prompt_words(length, seed=prompt_seed(args.seed, rep, length))
        load = os.getloadavg()[0]
        rec: dict[str, Any] = {"mode": mode, "rep": rep, "length": length, "seq": i, "loadavg": round(load, 2)}
        rec.update(measure_one(stack, prompt, length, args.max_tokens))
        if warm["failed"]:
            rec["warmup_failed"] = warm["failed"]
        records.append(rec)
        stack.pause()
        say(
            f"rep {rep} {length:>5} tokens {mode:<8}: "
            + (f"TTFT {rec['ttft_ms']:8.1f} ms" if rec["ok"] else f"FAILED {rec.get('error', '')[:120]}")
            + (f", P prefill {rec['p_prefill_ms']:.0f} ms" if "p_prefill_ms" in rec else "")
            + (f", push {rec['p_transfer_ms']:.1f} ms" if "p_transfer_ms" in rec else "")
            + (
                f" ({rec['size_mib']:.0f} MiB" + (f", {rec['p_parts']} parts" if "p_parts" in rec else "") + ")"
                if "size_mib" in rec
                else ""
            )
            + (", layer-wise" if rec.get("p_layerwise") else "")
            + f", load {load:.1f}"
        )
    return records


def check_layer_config(extra: Mapping[str, Any]) -> str | None:
    """Why kvpush here would refuse the layer mode's config (None: accepted).

    Servers import this same kvpush, so an unknown key fails here in
    milliseconds instead of after minutes of server startup."""
    from kvpush.config import Config
    from kvpush.core.errors import ConfigError

    try:
        Config.from_dict(dict(extra))
    except ConfigError as exc:
        return str(exc)
    return None


def build(
    modes: Sequence[str], model: Path, log_dir: Path, opts: StackOptions, layer_extra: Mapping[str, Any]
) -> dict[str, Stack]:
    """The stacks of ``modes``: ``single`` one plain server, the two kvpush
    modes a kvpush pair each, ``layer`` with ``layer_extra`` on P and D."""
    stacks = {}
    for mode in modes:
        kw = opts.kwargs()
        if mode == SINGLE:
            stacks[mode] = build_stack(SINGLE, model, log_dir, **kw)
        else:
            extra = dict(kw.pop("kvpush_extra") or {})
            if mode == "layer":
                extra.update(layer_extra)
            stacks[mode] = build_stack("kvpush", model, log_dir, name=mode, kvpush_extra=extra or None, **kw)
    return stacks


def source_state() -> dict[str, Any]:
    from kvpush_tools.bench.client import source_state as state

    return state()


def report(out_dir: Path, plot_it: bool = True) -> int:
    doc = json.loads((out_dir / "layerwise.json").read_text())
    doc["summary"] = summarize(doc["requests"], doc["modes"], doc["lengths"])
    (out_dir / "layerwise.json").write_text(json.dumps(doc, indent=1) + "\n")
    if plot_it:
        plot(doc, out_dir / "layerwise.png")
    print(table(doc))
    print(f"layerwise.json{' and layerwise.png' if plot_it else ''} in {out_dir}")
    failed = sum(not r.get("ok") for r in doc["requests"])
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvpush bench layerwise",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--lengths", type=ints, default=list(DEFAULT_LENGTHS), help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=DEFAULT_REPS, help="repetitions (one request per mode and length)")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens per request")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests after each resume")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds between warm-up and the measured request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layer-config",
        default=DEFAULT_LAYER_CONFIG,
        metavar="JSON",
        help="kv_connector_extra_config keys of the layer mode (P and D)",
    )
    ap.add_argument("--out", type=Path, default=None, help="results folder (default results/bench_layerwise/<time>)")
    ap.add_argument("--report", type=Path, default=None, metavar="DIR", help="only redo table and plot of a run")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + output, rounded up")
    add_stack_arguments(ap, model_dir=DEFAULT_MODEL_DIR, kv_cache_mib=0, vllm_ablation=False)
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parsed and checked options (``SystemExit(2)`` on a bad mode or length)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.modes = comma_list(args.modes)
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if len(set(args.modes)) != len(args.modes):
        ap.error("a mode is listed twice")
    if not args.lengths or min(args.lengths) < 1:
        ap.error("--lengths must be positive")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    args.layer_extra = json.loads(args.layer_config)
    if not isinstance(args.layer_extra, dict):
        ap.error("--layer-config must be a JSON object")
    longest = max(args.lengths) + args.max_tokens
    if args.max_model_len is None:
        args.max_model_len = -(-longest // 512) * 512
    if args.max_model_len < longest:
        ap.error(f"--max-model-len {args.max_model_len} < longest prompt + output ({longest})")
    if args.kv_cache_mib == 0:  # default: two longest requests' worth of KV, at least 512 MiB
        need = 2 * args.max_model_len * kv_bytes_per_token(MODEL_SHAPE)
        args.kv_cache_mib = max(512, -(-need // 2**20))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the three modes; 0 when every request succeeded, 1 if some failed, 2 on a setup error."""
    args = parse_args(argv)
    if args.report is not None:
        return report(args.report, plot_it=not args.no_plot)
    if "layer" in args.modes:
        why = check_layer_config(args.layer_extra)
        if why:
            say(
                f"the layer mode's config {args.layer_config} is refused by this kvpush ({why}); "
                "is layer-wise push (issue #9) in this checkout? Run --modes single,request without it."
            )
            return 2
    out_dir = args.out or Path("results/bench_layerwise") / time.strftime("run-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"results in {out_dir}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    from kvpush_tools.demo.tiny_model import make_tiny_model

    model = make_tiny_model(args.model_dir, **MODEL_SHAPE)
    opts = stack_options(args, max_model_len=args.max_model_len)
    stacks = build(args.modes, model, out_dir / "logs", opts, args.layer_extra)
    records: list[dict[str, Any]] = []

    def run() -> None:
        t0 = time.monotonic()
        start_stacks(list(stacks.values()), say, timeout=args.startup_timeout)
        say(f"all stacks healthy after {time.monotonic() - t0:.0f} s")
        t1 = time.monotonic()
        records.extend(run_visits(args, stacks))
        say(f"measured in {(time.monotonic() - t1) / 60:.1f} min")

    doc: dict[str, Any] = {
        "benchmark": "kvpush bench layerwise",
        "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "modes": args.modes,
        "lengths": args.lengths,
        "reps": args.reps,
        "max_tokens": args.max_tokens,
        "model": {
            "shape": MODEL_SHAPE,
            "kv_bytes_per_token": kv_bytes_per_token(MODEL_SHAPE),
            "max_model_len": args.max_model_len,
        },
        "stacks": {m: s.info for m, s in stacks.items()},
        "source": source_state(),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "loadavg_start": list(os.getloadavg()),
    }
    rc = run_with_stacks(stacks, run, say)
    doc["loadavg_end"] = list(os.getloadavg())
    doc["requests"] = records
    doc["summary"] = summarize(records, args.modes, args.lengths)
    (out_dir / "layerwise.json").write_text(json.dumps(doc, indent=1) + "\n")
    if rc:
        return rc
    if not args.no_plot:
        plot(doc, out_dir / "layerwise.png")
    print(table(doc))
    print(f"layerwise.json and layerwise.png in {out_dir}")
    return 1 if any(not r.get("ok") for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
