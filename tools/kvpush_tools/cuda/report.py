"""The GPU push benchmark's report: each row against the peer copy, the finished order against the ahead order,
the layer-wise table, the stage timeline's rows, and the figures."""

from __future__ import annotations

from typing import Any

from kvpush_tools.bench import stages
from kvpush_tools.cuda.options import Options, sim_mode
from kvpush_tools.cuda.side import log_line


def timeline_rows(res: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """Each engine row's median stage times (ms after its start), labelled, for ``stages``; parts 0 is the
    cost model's choice."""
    rows = []
    for e in res.get("engine") or []:
        marks = {k: v for k, v in e.get("timeline_median", {}).items() if not k.endswith("_ms")}
        parts = e["parts"] or f"auto({len(stages.parts_of(marks))})"
        rows.append((f"{e['pattern']} {e['mode']} parts={parts} ({e['plan']}) {e['median_ms']:.2f} ms", marks))
    return rows


def summarize(opts: Options, res: dict[str, Any]) -> dict[str, Any]:
    """Attach ratios to peer copy and build the printed table."""
    peer = res["micro"]["peer_copy_ms"]
    gb = opts.total_bytes / 1e9
    rows = [("peer copy", "-", 1, peer, True)]
    for r in res["raw_write"]:
        rows.append(("raw WRITE", f"{r['descriptors']} descs", r["descriptors"], r["median_ms"], r["verified"]))
    for c in res["cases"]:
        c["x_peer_copy"] = c["median_ms"] / peer
        c["gbps"] = gb / (c["median_ms"] / 1e3)
        # Planning (block ids -> pieces/descriptors) can run before the KV is ready: shown apart.
        c["median_ms_excl_plan"] = c["median_ms"] - c["breakdown"].get("plan_ms", 0.0)
        c["x_peer_copy_excl_plan"] = c["median_ms_excl_plan"] / peer
        rows.append((c["pattern"], c["strategy"], c["descriptors"], c["median_ms"], c["verified"]))
    for e in res["engine"]:
        e["x_peer_copy"] = e["median_ms"] / peer
        label = f"eng:{e.get('mode', 'finished')}/{e.get('parts', 1)}:{e['plan']}"
        rows.append((e["pattern"], label, int(e["stats"].get("descriptors", 0)), e["median_ms"], e["verified"]))
    ahead = {(e["pattern"], e["parts"]): e["median_ms"] for e in res["engine"] if e.get("mode") == "ahead"}
    for e in res["engine"]:
        if e.get("mode") == "finished" and (e["pattern"], e["parts"]) in ahead:
            e["x_ahead"] = e["median_ms"] / ahead[(e["pattern"], e["parts"])]
    plan = {(c["pattern"], c["strategy"]): c["breakdown"].get("plan_ms", 0.0) for c in res["cases"]}
    head = f"{'pattern':>12} {'strategy':>16} {'descs':>8} {'median ms':>10} {'GB/s':>8} {'x peer':>7}"
    lines = [f"{head} {'plan ms':>8} {'x peer w/o plan':>15} ok"]
    for pat, strat, nd, ms, ok in rows:
        p = plan.get((pat, strat), 0.0)
        lines.append(
            f"{pat:>12} {strat:>16} {nd:>8} {ms:>10.3f} {gb / (ms / 1e3):>8.1f} {ms / peer:>7.2f} "
            f"{p:>8.3f} {(ms - p) / peer:>15.2f} {ok}"
        )
    for e in res["engine"]:
        if "x_ahead" in e:
            lines.append(
                f"{e['pattern']:>12} finished/ahead, {e['parts']} parts: {e['median_ms']:.3f} / "
                f"{ahead[(e['pattern'], e['parts'])]:.3f} ms = {e['x_ahead']:.2f}x"
            )
    lw = res.get("layerwise") or []
    if lw:
        # +ms: D's result after the end of the run's own forward (the transfer's tail); /whole: that tail
        # over the whole-request push's (the goal: <= 0.1); fwd: the run's forward, to compare
        # with none's (a push that slowed the forward would add that to TTFT too).
        # ttft: D's result - the start of the forward, less none's forward (what TTFT gains, all told).
        present = list(dict.fromkeys(r["mode"] for r in lw))
        pushing = [m for m in present if m not in ("none", "whole") and sim_mode(m) is None]
        head = [f"{'tokens':>7} {'fwd ms':>7} {'whole +ms':>9} {'fwd':>7} {'ttft':>6}"]
        head += [f"{m + ' +ms':>15} {'/whole':>6} {'fwd':>7} {'ttft':>6}" for m in pushing]
        lines += ["", " ".join(head) + " ok"]
        by = {(r["tokens"], r["mode"]): r for r in lw}
        for tokens in sorted({r["tokens"] for r in lw}):
            if not all((tokens, m) in by for m in ("none", "whole", *pushing)):
                continue
            wh, base = by[(tokens, "whole")], by[(tokens, "none")]["median_forward_ms"]
            for m in ("whole", *pushing):
                by[(tokens, m)]["ttft_added_ms"] = by[(tokens, m)]["median_kv_on_d_ms"] - base
            cells = [f"{tokens:>7} {base:>7.2f}"]
            cells.append(
                f"{wh['median_overhead_ms']:>9.3f} {wh['median_forward_ms']:>7.2f} {wh['ttft_added_ms']:>6.2f}"
            )
            for m in pushing:
                r = by[(tokens, m)]
                r["over_whole"] = r["median_overhead_ms"] / wh["median_overhead_ms"]
                cells.append(
                    f"{r['median_overhead_ms']:>15.3f} {r['over_whole']:>6.3f} {r['median_forward_ms']:>7.2f} "
                    f"{r['ttft_added_ms']:>6.2f}"
                )
            ok = all(by[(tokens, m)]["verified"] for m in ("none", "whole", *pushing))
            lines.append(" ".join(cells) + f" {ok}")
        # Where a forward's time goes (GPU events around vLLM's hook), and the sim_* modes' side copies.
        if any("median_gpu_pre_hook_ms" in r for r in lw):
            cols = ("fwd ms", "+ vs none", "GPU pre", "GPU post", "sim tail")
            lines += ["", f"{'tokens':>7} {'mode':>13} " + " ".join(f"{c:>9}" for c in cols)]
            nan = float("nan")
            for r in lw:
                base = by.get((r["tokens"], "none"), {}).get("median_forward_ms", nan)
                keys = ("gpu_pre_hook_ms", "gpu_post_hook_ms", "sim_tail_ms")
                vals = [r["median_forward_ms"], r["median_forward_ms"] - base]
                vals += [r.get(f"median_{k}", nan) for k in keys]
                lines.append(f"{r['tokens']:>7} {r['mode']:>13} " + " ".join(f"{v:>9.2f}" for v in vals))
    res["table"] = lines
    return res


def plot(res: dict[str, Any], path: str) -> None:
    """Bars of median time per (pattern, strategy), log scale, peer copy as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log_line("matplotlib missing: no plot")
        return
    labels = [f"{c['pattern']} {c['strategy']}" for c in res["cases"]]
    labels += [f"{e['pattern']} eng:{e.get('mode', 'finished')}/{e.get('parts', 1)}:{e['plan']}" for e in res["engine"]]
    vals = [c["median_ms"] for c in res["cases"]] + [e["median_ms"] for e in res["engine"]]
    fig, ax = plt.subplots(figsize=(max(8, len(vals) * 0.45), 5.5))
    ax.bar(range(len(vals)), vals, color="tab:blue")
    ax.axhline(res["micro"]["peer_copy_ms"], color="tab:red", ls="--", label="peer copy")
    ax.axhline(1.5 * res["micro"]["peer_copy_ms"], color="tab:orange", ls=":", label="1.5x peer copy (goal)")
    ax.set_yscale("log")
    ax.set_ylabel("ms, P ready -> D in place (median)")
    ax.set_xticks(range(len(vals)), labels, fontsize=7, rotation=60, ha="right")
    ax.legend()
    ax.set_title(f"{res['config']['tokens']} tokens, {res['config']['total_bytes'] >> 20} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_layerwise(res: dict[str, Any], path: str) -> None:
    """By prompt length: what each mode leaves after P's forward (left), and what it adds to the time
    from the forward's start to KV on D over the no-transfer forward (right; forward slowdowns count
    there), each with the goal (10% of the whole-request push's tail)."""
    lw = res.get("layerwise") or []
    if not lw:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({r["tokens"] for r in lw})
    by = {(r["tokens"], r["mode"]): r for r in lw}
    goal = [0.1 * by[(t, "whole")]["median_overhead_ms"] if (t, "whole") in by else float("nan") for t in tokens]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (
        ("median_overhead_ms", "ms from the end of P's forward to KV on D"),
        ("ttft_added_ms", "ms added: KV on D - no-transfer forward"),
    )
    # The pushing modes this run measured (the sim_* modes push nothing to D).
    modes = [m for m in dict.fromkeys(r["mode"] for r in lw) if m != "none" and sim_mode(m) is None]
    colors = dict(zip(modes, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for mode in modes:
            if mode == "layer_1gemm" and key == "ttft_added_ms":
                continue  # a different forward (one GEMM after the hook): not comparable with none's
            vals = [by.get((t, mode), {}).get(key, float("nan")) for t in tokens]
            ax.plot(tokens, vals, marker="o", label=mode, color=colors.get(mode))
        ax.plot(tokens, goal, ls=":", color="black", label="goal: 10% of whole's tail")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"{label} (median)", fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"layer-wise push, {res['config']['layers']} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
