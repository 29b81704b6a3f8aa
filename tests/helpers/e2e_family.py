"""The end-to-end checks every model family and parallel layout must pass, and the servers they run on.

A family is P, D and a plain reference server (``Family``): its own tiny
model (MLA, sliding+full attention) or the session's tiny Qwen3 with another
parallel layout (TP mismatch, data parallel), reusing the session's servers
(``e2e_cluster.py``) for whatever it does not change. The bar is the one the
whole-request e2e test sets, per family:

* greedy outputs through the router equal the plain server's token for token;
* the swap test: P prefills prompt A under a transfer id, D is sent prompt Q
  (same length, same last token, other words) with that id; D's continuation
  is A's, not Q's, so D decoded over the KV P pushed;
* D's vLLM counters show every prompt token came by transfer, none computed;
* afterwards every block is back in both pools and the router holds nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.tiny_model import make_tiny_model
from kvpush_tools.demo.words import prompt_words

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
_tids = itertools.count()


def family_model(family: str, dtype: str = "float32") -> str:
    """The family's tiny model, built once under ``KVPUSH_MODEL_DIR`` (default ``models/``)."""
    root = Path(os.environ.get("KVPUSH_MODEL_DIR", ROOT / "models"))
    name = f"tiny-{family}" if dtype == "float32" else f"tiny-{family}-{dtype}"
    return str(make_tiny_model(root / name, family=family, dtype=dtype))


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metric(base: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


@dataclass
class Target:
    """Where the checks send requests: P and D (one engine each, or one DP rank), the router, the reference."""

    model: str
    p: str
    d: str
    router: str
    single: str
    p_kv: tuple[str, int]
    p_tp: int = 1
    p_headers: dict[str, str] = field(default_factory=dict)
    """Headers for P's requests (``X-data-parallel-rank`` picks one of P's DP engines)."""
    max_tokens: int = MAX_TOKENS
    logs: dict[str, Path] = field(default_factory=dict)  # server logs of the family's own servers, by role
    keys: str = ""  # the key set of P: D's hand-made kv_transfer_params carry the capability it gives

    def complete(self, base: str, prompt: str, headers: dict[str, str] | None = None, **kw: Any) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, **kw}
        return post(base + "/v1/completions", body, headers)["choices"][0]["text"]

    def pushed(self, tid: str, prompt: str, d_prompt: str | None = None) -> str:
        """P prefills ``prompt`` and D decodes ``d_prompt`` (default the same) under one transfer id, both at once."""
        host, port = self.p_kv
        p_params = {"do_remote_decode": True, "transfer_id": tid}
        d_params = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": host,
            "remote_port": port,
            "remote_tp_size": self.p_tp,
            **({"capability": srv.capability(self.keys, tid)} if self.keys else {}),
        }
        with cf.ThreadPoolExecutor(2) as ex:
            p = ex.submit(self.complete, self.p, prompt, self.p_headers, max_tokens=1, kv_transfer_params=p_params)
            d = ex.submit(self.complete, self.d, d_prompt or prompt, kv_transfer_params=d_params)
            p.result()
            return d.result()


def swap_prompts(n: int, seed: int) -> tuple[str, str]:
    """Two prompts of ``n`` words with the same last word and different others."""
    a = prompt_words(n, seed=seed * 1000 + 900).split()
    q = prompt_words(n, seed=seed * 1000 + 901).split()
    q[-1] = a[-1]
    return " ".join(a), " ".join(q)


def decisive_prefix(t: Target, prompt: str, margin: float) -> tuple[str, int]:
    """The plain server's greedy words up to its first step whose top-1 lead over the runner-up is below
    ``margin`` (log-probability), and how many steps that is: past a near tie the greedy choice is decided
    by rounding, which differs between the prefill and decode paths of the same model."""
    body = {"model": t.model, "prompt": prompt, "max_tokens": t.max_tokens, "temperature": 0, "logprobs": 2}
    choice = post(t.single + "/v1/completions", body)["choices"][0]
    tokens, tops = choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]
    words = choice["text"].split()
    assert len(words) == len(tokens), f"the tiny model's tokens are not its words: {tokens} vs {words}"
    for i, top in enumerate(tops):
        best = sorted(top.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < margin:
            return " ".join(words[:i]), i
    return " ".join(words), len(words)


def check_outputs_and_counters(
    t: Target,
    lengths: Sequence[int],
    seed: int,
    via_router: bool = True,
    concurrent: bool = True,
    near_tie: float = 0.0,
    backoff: int = 0,
) -> None:
    """Greedy outputs equal the reference's; every prompt token reached D by transfer, none computed.

    The reference computes each prompt alone. Through the router the prompts go
    all at once (``concurrent``), so P and D batch them; a family whose model
    computes a prompt differently in a batch than alone sends them one at a
    time, so P, D and the reference see the same batch shapes and any
    difference left is the transfer's. ``near_tie`` > 0: each output must
    equal the reference up to the reference's first near tie
    (``decisive_prefix``), and the prompts together must be decisive for at
    least one step each on average. ``backoff``: the trailing prompt tokens D
    computes itself (1 for models with recurrent state, ``kvpush.core.recurrent``).
    """
    prompts = [prompt_words(n, seed=seed * 1000 + i) for i, n in enumerate(lengths)]  # no shared prefixes
    if near_tie > 0:
        cut = [decisive_prefix(t, p, near_tie) for p in prompts]
        expected = [c[0] for c in cut]
        assert sum(c[1] for c in cut) >= len(prompts), f"too few decisive steps to compare: {cut}"
        print(f"decisive steps compared per prompt ({lengths} tokens): {[c[1] for c in cut]}")
    else:
        expected = [t.complete(t.single, p) for p in prompts]
        assert all(e.strip() for e in expected), f"the model generates no words: {expected}"
    pushed0 = metric(t.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    computed0 = metric(t.d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    if via_router:
        with cf.ThreadPoolExecutor(len(prompts) if concurrent else 1) as ex:
            got = list(ex.map(lambda p: t.complete(t.router, p), prompts))
    else:
        got = [t.pushed(f"fam-{seed}-{next(_tids)}", p) for p in prompts]
    if near_tie > 0:  # the tiny models' tokens are words: compare the decisive words

        def same(g: str, e: str) -> bool:
            return g.split()[: len(e.split())] == e.split()
    else:

        def same(g: str, e: str) -> bool:
            return g == e

    bad = [f"{n} tokens: {g!r} vs {e!r}" for n, e, g in zip(lengths, expected, got, strict=True) if not same(g, e)]
    assert not bad, "disaggregated outputs differ from the plain server's: " + "; ".join(bad)
    pushed = metric(t.d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pushed0
    computed = metric(t.d, "vllm:prompt_tokens_by_source_total", source="local_compute") - computed0
    assert (pushed, computed) == (sum(lengths) - backoff * len(lengths), backoff * len(lengths)), (pushed, computed)


def check_swap(t: Target, n: int, seed: int, near_tie: float = 0.0) -> None:
    """D is sent prompt Q under the transfer id of P's prompt A: it continues A (it used P's KV), not Q.

    Tiny random models lean on the last token, which A and Q share, so the
    first seed from ``seed`` whose A and Q continue differently is used.
    ``near_tie`` > 0: A's continuation is compared up to the reference's first
    near tie (``decisive_prefix``), and Q's must differ from A's within it.
    """
    for s in range(seed, seed + 20):
        a, q = swap_prompts(n, s)
        want_a, want_q = t.complete(t.single, a), t.complete(t.single, q)
        if near_tie > 0:
            want_a = decisive_prefix(t, a, near_tie)[0]
            if want_q.split()[: len(want_a.split())] != want_a.split():
                break
        elif want_a != want_q:
            break
    else:
        raise AssertionError(f"no swap prompts from seed {seed} continue differently: the model ignores context")
    got = t.pushed(f"swap-{s}-{next(_tids)}", a, d_prompt=q)
    print(f"swap test compares {len(want_a.split())} words")
    if near_tie > 0:
        got = " ".join(got.split()[: len(want_a.split())])
    assert got == want_a, f"D continued {got!r}: A's continuation is {want_a!r}, Q's {want_q!r}"


def wait_released(t: Target, timeout: float = 60.0) -> None:
    """Until P and D hold no KV block and the router has nothing pending (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = [metric(u, "vllm:kv_cache_usage_perc") for u in (t.p, t.d)]
        with urllib.request.urlopen(t.router + "/kvpush/pending", timeout=30) as r:
            pending = json.loads(r.read())
        if usage == [0.0, 0.0] and (pending["pending"], pending["pending_prefill"]) == (0, 0):
            return
        assert time.monotonic() < deadline, f"blocks or transfers left: usage {usage}, router {pending}"
        time.sleep(0.5)


@dataclass(frozen=True)
class Server:
    """One vLLM server of a family: its role and parallel layout."""

    role: str  # "prefill", "decode" or "single"
    tp: int = 1
    dp: int = 1
    cpus: str = "0"
    python: str | None = None  # the interpreter whose vLLM serves (another CI lane's); this one's by default

    def start(
        self,
        model: str,
        logs: Path,
        block_size: int,
        kv_port: int,
        extra_cfg: dict[str, Any],
        keys: str,
        args: Sequence[str] = (),
        dtype: str | None = None,
    ) -> launcher.ServerProcess:
        """The server (not yet started); P and D authenticate with the key set ``keys``; ``args`` are extra
        vLLM arguments."""
        port = launcher.free_port()
        ranks = self.tp * self.dp
        kw: dict[str, Any] = {"block_size": block_size, "log_dir": logs, "env": {"KVPUSH_LOG_LEVEL": "DEBUG"}}
        kw["extra_args"] = list(args)
        kw["python"] = self.python
        if dtype is not None:
            kw["dtype"] = dtype
        if ranks > 1:
            # Several workers or engines, all on this server's core: a rank waiting for KV keeps its engine
            # stepping, and a core shared with the peer would starve it (seconds of silence on a 2-core host).
            kw["env"]["VLLM_CPU_OMP_THREADS_BIND"] = "|".join([self.cpus] * ranks)
            kw["extra_args"] += ["--tensor-parallel-size", str(self.tp), "--data-parallel-size", str(self.dp)]
        else:
            kw.update(cpus=self.cpus, fast_start=True)
        if self.role == "prefill":
            ports = tuple(kv_port + i for i in range(ranks))
            kw.update(
                kv_transfer_config=srv.kvpush_transfer_config("kv_producer", kv_port, auth_keys_dir=keys, **extra_cfg)
            )
            kw["check_ports"] = ports
        elif self.role == "decode":
            cfg = srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys, peer_dead_s=5.0, **extra_cfg)
            kw["kv_transfer_config"] = cfg
        return srv.vllm_server(f"{self.role}-tp{self.tp}-dp{self.dp}", model, port, **kw)
