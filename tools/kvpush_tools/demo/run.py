"""The 1P1D demo: tiny model, a prefill and a decode vLLM server, the router.

``python -m kvpush_tools.demo.run`` (or ``kvpush demo``) builds a tiny random
Qwen3-style model locally, starts P and D with the chosen KV connector,
runs the router in this process, streams a few prompts of different
lengths through it, prints each output with its time to first token, and
shuts everything down, also on Ctrl-C.

``--mode`` picks the connector and the matching router behaviour:
``kvpush`` (ours, the default), ``vllm-pull`` (vLLM's ``NixlConnector``)
or ``vllm-push`` (vLLM's ``NixlPushConnector``). Nothing else changes
between modes, which is the point: same model, same flags, same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.tiny_model import make_tiny_model
from kvpush_tools.demo.words import prompt_words

MODEL_NAME = "tiny-qwen3"
P_ENGINE_ID = "kvpush-demo-prefill"


def say(msg: str) -> None:
    """Progress line with a timestamp (the demo takes minutes on 2 cores)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def split_cpus() -> tuple[str, str]:
    """Disjoint core sets for P and D (halves of the cores we may use), so
    the two engines do not fight over one core."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < 2:
        return str(cores[0]), str(cores[0])
    half = len(cores) // 2
    return ",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))


@dataclass
class Plan:
    """Ports and connector settings of one demo run."""

    mode: str
    p_port: int
    d_port: int
    router_port: int
    p_kv_port: int
    d_kv_port: int
    keys: str = ""
    """kvpush's side-channel key set (P and D share it; made in a private temporary directory)."""

    def prefill_config(self) -> tuple[dict[str, Any], dict[str, str]]:
        if self.mode == "kvpush":
            return srv.kvpush_transfer_config("kv_producer", self.p_kv_port, auth_keys_dir=self.keys), {}
        connector = "NixlConnector" if self.mode == "vllm-pull" else "NixlPushConnector"
        cfg = srv.vllm_nixl_transfer_config(connector, "kv_producer", engine_id=P_ENGINE_ID)
        return cfg, srv.vllm_nixl_env(self.p_kv_port)

    def decode_config(self) -> tuple[dict[str, Any], dict[str, str]]:
        if self.mode == "kvpush":
            # D knows its P: it says hello at start, so the first request pays no connection set-up.
            peers = [f"127.0.0.1:{self.p_kv_port}"]
            cfg = srv.kvpush_transfer_config(
                "kv_consumer", self.d_kv_port, auth_keys_dir=self.keys, prefill_peers=peers
            )
            return cfg, {}
        connector = "NixlConnector" if self.mode == "vllm-pull" else "NixlPushConnector"
        return srv.vllm_nixl_transfer_config(connector, "kv_consumer"), srv.vllm_nixl_env(self.d_kv_port)

    def router_args(self) -> list[str]:
        args = ["--mode", self.mode, "--prefill", f"http://127.0.0.1:{self.p_port}"]
        if self.mode != "vllm-pull":
            args += ["--prefill-kv", f"127.0.0.1:{self.p_kv_port}"]
        if self.mode == "vllm-push":
            args += ["--prefill-engine-id", P_ENGINE_ID]
        if self.mode == "kvpush" and self.keys:
            args += ["--capability-key", self.keys]
        return [*args, "--decode", f"http://127.0.0.1:{self.d_port}"]


async def stream_one(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming request; measure TTFT (first text) and collect the
    text and the completion-token count (from the final usage chunk)."""
    chat = "messages" in body
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    tokens = 0
    async with session.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ").strip()
                if not data or data == b"[DONE]":
                    continue
                msg = json.loads(data)
                if msg.get("usage"):
                    tokens = msg["usage"].get("completion_tokens", 0)
                for choice in msg.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
    return {"text": "".join(text), "ttft": ttft, "total": time.perf_counter() - t0, "tokens": tokens}


def prompt_token_sources(metrics: str) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counter from a /metrics text,
    summed per source (local_compute, local_cache_hit, external_kv_transfer)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="' in line:
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def report(label: str, res: dict[str, Any]) -> bool:
    """Print one request's result; False if it failed."""
    if "error" in res:
        print(f"  {label}: FAILED {res['error']}")
        return False
    ttft = f"{res['ttft'] * 1000:6.0f} ms" if res["ttft"] is not None else "     - "
    print(f"  {label}: TTFT {ttft}, total {res['total']:5.2f} s, {res['tokens']} tokens")
    text = res["text"]
    print(f"      -> {text[:100]!r}{'...' if len(text) > 100 else ''}")
    return True


async def drive(plan: Plan, lengths: list[int], max_tokens: int, concurrent: bool) -> int:
    """Run the router in this event loop and send the demo requests."""
    import aiohttp
    from aiohttp import web

    from kvpush.integrations.router import Router, config_from_args

    router = Router(config_from_args([*plan.router_args(), "--port", str(plan.router_port)]))
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", plan.router_port).start()
    url = f"http://127.0.0.1:{plan.router_port}"
    say(f"router ({plan.mode}) on {url}; the same as: kvpush router {' '.join(plan.router_args())}")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            # The first request through a fresh P/D pair: with kvpush, D said hello to P at start
            # (prefill_peers), so it pays no connection set-up; vLLM's connectors connect now.
            first = {"model": MODEL_NAME, "prompt": prompt_words(8, seed=1), "max_tokens": 2, "temperature": 0}
            t0 = time.perf_counter()
            res = await stream_one(session, url, first)
            if "error" in res:
                say(f"first request FAILED: {res['error']}")
                return 1
            ttft = f"TTFT {res['ttft'] * 1000:.0f} ms, " if res["ttft"] is not None else ""
            say(f"first request: {ttft}done in {time.perf_counter() - t0:.2f} s")
            bodies: list[tuple[str, dict[str, Any]]] = []
            for i, n in enumerate(lengths):
                body = {"model": MODEL_NAME, "prompt": prompt_words(n, seed=1000 + i), "max_tokens": max_tokens}
                bodies.append((f"completion {n:>5} prompt tokens", {**body, "temperature": 0}))
            chat = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hello, tell me about the world"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            bodies.append((f"chat {'':>22}", chat))
            say(f"sending {len(bodies)} streaming requests {'concurrently' if concurrent else 'one by one'}")
            if concurrent:
                results = await asyncio.gather(*(stream_one(session, url, b) for _, b in bodies))
            else:
                results = [await stream_one(session, url, b) for _, b in bodies]
            print()
            failures = sum(not report(label, res) for (label, _), res in zip(bodies, results, strict=True))
            print()
            async with session.get(f"http://127.0.0.1:{plan.d_port}/metrics") as r:
                sources = prompt_token_sources(await r.text())
            if sources:
                say(
                    "decode instance's prompt tokens by source: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in sorted(sources.items()))
                    + " (external_kv_transfer = received from P, not recomputed)"
                )
            async with session.get(url + "/kvpush/pending") as r:
                pending = await r.json()
            say(f"router: {pending['pending']} requests pending, {router.counters['ok']} ok, {failures} failed")
    finally:
        await runner.cleanup()
    return failures


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpush demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("kvpush", "vllm-pull", "vllm-push"), default="kvpush")
    ap.add_argument("--model-dir", default="models/tiny-qwen3", help="where the tiny model is created (reused)")
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--router-port", type=int, default=8000)
    ap.add_argument("--kv-port", type=int, default=5600, help="P's KV side channel (D uses the next port)")
    ap.add_argument("--prompt-lengths", default="12,100,700,2000", help="comma-separated prompt sizes in tokens")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--concurrent", action="store_true", help="send the requests at once, not one by one")
    ap.add_argument("--log-dir", default="results/demo-logs")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument(
        "--faithful",
        action="store_true",
        help="vLLM's default multiprocess executor with OMP core binding (slower start; what benchmarks use)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every request succeeded."""
    args = build_parser().parse_args(argv)
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    plan = Plan(args.mode, args.prefill_port, args.decode_port, args.router_port, args.kv_port, args.kv_port + 1)
    if plan.mode == "kvpush":
        plan.keys = srv.temp_keys()

    # SIGTERM (e.g. from a CI timeout) takes the same clean path as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)

    started: list[launcher.ServerProcess] = []
    t_start = time.monotonic()
    try:
        say(f"creating the tiny model in {args.model_dir} (reused if it exists)")
        model = make_tiny_model(args.model_dir)
        p_cpus, d_cpus = split_cpus()
        p_cfg, p_env = plan.prefill_config()
        d_cfg, d_env = plan.decode_config()
        common = {"log_dir": args.log_dir, "served_model_name": MODEL_NAME, "fast_start": not args.faithful}
        prefill = srv.vllm_server(
            "prefill",
            model,
            plan.p_port,
            cpus=p_cpus,
            kv_transfer_config=p_cfg,
            env=p_env,
            check_ports=(plan.p_kv_port,),
            **common,
        )
        decode = srv.vllm_server(
            "decode",
            model,
            plan.d_port,
            cpus=d_cpus,
            kv_transfer_config=d_cfg,
            env=d_env,
            check_ports=(plan.d_kv_port,),
            **common,
        )
        if not launcher.port_is_free(plan.router_port):
            raise launcher.ServerError(f"router port {plan.router_port} is already in use (--router-port)")
        for s, cpus in ((prefill, p_cpus), (decode, d_cpus)):
            s.start()
            started.append(s)
            say(f"started {s.name} (pid {s.proc.pid if s.proc else '?'}, cores {cpus}) -> {s.url}, log {s.log_path}")
        say("waiting for both servers (about 1-2 minutes on 2 cores)")
        launcher.wait_all_healthy(started, timeout=args.startup_timeout, progress=say)
        failures = asyncio.run(drive(plan, lengths, args.max_tokens, args.concurrent))
        say(f"done in {time.monotonic() - t_start:.0f} s")
        return 1 if failures else 0
    except launcher.ServerError as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if started:
            say("stopping servers")
            with contextlib.suppress(KeyboardInterrupt):
                launcher.stop_all(started)
            say("all stopped")


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Plan", "main", "split_cpus"]
