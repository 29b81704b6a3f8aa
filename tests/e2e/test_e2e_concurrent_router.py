"""End to end: vllm-router dispatching P and D at once, kvpush unchanged, and the overlap kept.

vllm-router's one concurrent P/D mode (0.1.17: ``--kv-connector moriio``
with instances that announce a ``WRITE`` transfer mode to its service
discovery) sends P and D their requests together, names a transfer id in
both, and P's side channel only in the request id
(``___prefill_addr_<P's announced address>___...``). kvpush's P and D
announce themselves as vLLM's connectors do (``proxy_ip``,
``proxy_ping_port``, ``http_port``). Greedy outputs equal a plain server's,
D's counters show every prompt token came by transfer, D registered while
P was still computing (P's timeline), and nothing is held afterwards.

The announcing P and D (the announcement is part of their configuration)
start with the session's servers, in parallel (``e2e_announcing``), and
stop when this module ends; the plain server is the session's.

The same P and D are then the second P and D of a 2P2D fleet with the
session's P and D (the fleet fault tests, below the concurrent one; what
each router does is in docs/routers.md, "Losing an instance"):
``kvpush router`` and vllm-router both in front of all four; this module's
D is killed while streams decode on it, then its P is frozen, given
requests and killed with them in hand (through both routers at once: one
loss serves both); then both restart on their addresses and both routers
send to them again. Each step checks the outputs against the plain server,
what each router answered for the requests on the lost instance, its
health, and the blocks left on the survivors. Killing only this module's
instances leaves the session's servers intact for the modules after it; a
restart of two servers in parallel is most of the fleet tests' time.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2e_fleet as fl
import pytest
from e2e_cluster import AnnouncingPair, E2EServers
from test_e2e_vllm import _get, _metric, _post, _stream_text

from kvpush.observability.timeline import parse_lines
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
LENGTHS = [40, 700, 1500, 2000]


class Stack:
    def __init__(self, model: str, single: str, pair: AnnouncingPair, router: str) -> None:
        self.model, self.single, self.pair, self.router = model, single, pair, router
        self.p, self.d, self.kv_port = pair.p.url, pair.d.url, pair.kv_port

    @property
    def p_proc(self) -> launcher.ServerProcess:
        return self.pair.p

    def complete(self, base: str, prompt: str) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return _post(base + "/v1/completions", body)["choices"][0]["text"]


@pytest.fixture(scope="module")
def stack(
    e2e_pair: E2EServers, e2e_single: str, e2e_announcing: AnnouncingPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """vllm-router in its concurrent mode, finding the announcing P and D by their announcements."""
    logs = tmp_path_factory.mktemp("concurrent")
    r_port, prom, discovery = launcher.free_port(), launcher.free_port(), e2e_announcing.discovery
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--kv-connector", "moriio"]
    cmd += ["--vllm-discovery-address", f"127.0.0.1:{discovery}", "--host", "127.0.0.1", "--port", str(r_port)]
    cmd += ["--prometheus-port", str(prom), "--policy", "round_robin"]
    router = launcher.ServerProcess(
        name="vllm-router-discovery",
        cmd=cmd,
        url=f"http://127.0.0.1:{r_port}",
        log_path=Path(logs) / "vllm-router.log",
        ports=(r_port, prom, discovery),
    )
    try:
        router.start()
        launcher.wait_all_healthy([router], timeout=120)
        s = Stack(e2e_pair.model, e2e_single, e2e_announcing, router.url)
        wait_registered(s)
        yield s
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([router])


def wait_registered(s: Stack, timeout: float = 60.0) -> None:
    """Until the router has both instances from their announcements (it answers 503 before)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s.complete(s.router, "hello")
            return
        except urllib.error.HTTPError as exc:
            assert time.monotonic() < deadline, f"the router never saw P and D announce: {exc.read()[:300]!r}"
            time.sleep(1.0)


def test_concurrent_dispatch_outputs_equal_single_and_d_registers_while_p_computes(stack: Stack) -> None:
    s = stack
    prompts = [prompt_words(n, seed=700 + i) for i, n in enumerate(LENGTHS)]
    expected = [s.complete(s.single, p) for p in prompts]
    counts = ("vllm:prompt_tokens_by_source_total",)
    pushed0 = _metric(s.d, *counts, source="external_kv_transfer")
    computed0 = _metric(s.d, *counts, source="local_compute")
    got = [s.complete(s.router, p) for p in prompts[:-1]]
    body = {"model": s.model, "prompt": prompts[-1], "max_tokens": MAX_TOKENS, "temperature": 0}
    got.append(_stream_text(s.router + "/v1/completions", body))
    assert got == expected
    pushed = _metric(s.d, *counts, source="external_kv_transfer") - pushed0
    computed = _metric(s.d, *counts, source="local_compute") - computed0
    assert (pushed, computed) == (sum(LENGTHS), 0)
    # The overlap: D's registration reached P before P's prefill had finished, for some of these.
    records, _ = parse_lines(s.p_proc.log_path.read_text(errors="replace").splitlines())
    mine = [r["t"] for r in records if r["side"] == "prefill" and str(r["transfer_id"]).startswith("tx-")]
    assert len(mine) >= len(LENGTHS)
    ahead = [t for t in mine if "registered" in t and "prefill_done" in t and t["registered"] < t["prefill_done"]]
    assert ahead, "D never registered before P's prefill finished: the requests were not concurrent"
    deadline = time.monotonic() + 20
    while (usage := [_metric(u, "vllm:kv_cache_usage_perc") for u in (s.p, s.d)]) != [0.0, 0.0]:
        assert time.monotonic() < deadline, f"KV blocks still held: {usage}"
        time.sleep(0.25)


# --------------------------------------------------------------------------------------------------------- #
# The fleet: the session's P and D and this module's, behind both routers; this module's D, then its P, lost.
# --------------------------------------------------------------------------------------------------------- #

WORDS = 12  # tokens of the non-streamed requests, and of a stream compared with the plain server (its first ones)
LONG = 400  # tokens of a streamed request: still decoding when its D is lost
IN_FLIGHT = 4  # requests per router in flight at a loss
# vllm-router keeps sending new requests to a lost instance until its health check takes it out (2 failed
# checks 1 s apart here); new requests go to it this long after a loss, with room for a loaded machine.
VLLM_ROUTER_HEALTH_WINDOW = 6.0


class Fleet:
    """Two P and two D behind ``kvpush router`` and vllm-router; the second P and D are this module's."""

    def __init__(self, stack: Stack, pair: E2EServers, kvpush: str, vllm_router: str) -> None:
        self.stack, self.pair = stack, pair
        self.kvpush, self.vllm_router = kvpush, vllm_router
        self.routers = {"kvpush": kvpush, "vllm-router": vllm_router}
        self._reference: dict[tuple[str, int], str] = {}

    def body(self, prompt: str, tokens: int = WORDS, stream: bool = False) -> dict[str, Any]:
        return {"model": self.stack.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": stream}

    def reference(self, prompt: str, tokens: int = WORDS) -> str:
        """The plain server's greedy output (``ignore_eos`` as the fleet's requests)."""
        if (prompt, tokens) not in self._reference:
            body = {**self.body(prompt, tokens), "ignore_eos": True}
            self._reference[prompt, tokens] = _post(self.stack.single + "/v1/completions", body)["choices"][0]["text"]
        return self._reference[prompt, tokens]

    def health(self) -> dict[str, Any]:
        """``kvpush router``'s ``/health`` (its 503 body too): each instance's health."""
        try:
            return json.loads(_get(self.kvpush + "/health"))
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def pending(self) -> dict[str, Any]:
        return json.loads(_get(self.kvpush + "/kvpush/pending"))

    def send(self, base: str, prompts: list[str], tokens: int = WORDS, stream: bool = False) -> list[fl.Outcome]:
        """``prompts`` at once through ``base`` (``ignore_eos``: every request its full length)."""
        started = [fl.start(base, {**self.body(p, tokens, stream), "ignore_eos": True}) for p in prompts]
        for _, t in started:
            t.join()
        return [o for o, _ in started]

    def check_equal(self, outcomes: list[fl.Outcome], prompts: list[str], where: str) -> None:
        bad = [(o, p) for o, p in zip(outcomes, prompts, strict=True) if not o.done or o.text != self.reference(p)]
        assert not bad, f"{where}: not the plain server's output: {[o for o, _ in bad]}"


def fleet_vllm_router(prefill: list[str], decode: list[str], log_dir: Path) -> launcher.ServerProcess:
    """vllm-router over the fleet, health-checked every second (its default is a minute): an instance is out
    after 2 failed checks and back after 1 answered one."""
    port, prom = launcher.free_port(), launcher.free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    for p in prefill:
        cmd += ["--prefill", p]
    for d in decode:
        cmd += ["--decode", d]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prom), "--policy", "round_robin"]
    cmd += ["--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--health-success-threshold", "1"]
    cmd += ["--log-level", "info"]
    return launcher.ServerProcess(
        name="vllm-router-fleet", cmd=cmd, url=f"http://127.0.0.1:{port}", log_path=log_dir / "vllm-router-fleet.log"
    )


@pytest.fixture(scope="module")
def fleet(stack: Stack, e2e_pair: E2EServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet")
    prefill, decode = [e2e_pair.p, stack.p], [e2e_pair.d, stack.d]
    args = ["--prefill", e2e_pair.p, "--prefill-kv", f"127.0.0.1:{e2e_pair.kv_port}"]
    args += ["--prefill", stack.p, "--prefill-kv", f"127.0.0.1:{stack.kv_port}"]
    args += ["--decode", e2e_pair.d, "--decode", stack.d, "--health-interval", "1"]
    kvpush = srv.router_server(args, launcher.free_port(), log_dir=logs, keys=e2e_pair.keys)
    vr = fleet_vllm_router(prefill, decode, logs)
    try:
        kvpush.start()
        vr.start()
        launcher.wait_all_healthy([kvpush, vr], timeout=120)
        yield Fleet(stack, e2e_pair, kvpush.url, vr.url)
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([kvpush, vr])


def fleet_prompts(seed: int, n: int, words: int) -> list[str]:
    return [prompt_words(words, seed=seed * 100 + i) for i in range(n)]


def wait_released(urls: list[str], fleet: Fleet, timeout: float = 30.0) -> None:
    """Until none of ``urls`` holds a KV block and ``kvpush router`` has nothing pending."""
    deadline = time.monotonic() + timeout
    while True:
        usage = [_metric(u, "vllm:kv_cache_usage_perc") for u in urls]
        pending = fleet.pending()
        if not any(usage) and (pending["pending"], pending["pending_prefill"]) == (0, 0):
            return
        assert time.monotonic() < deadline, f"blocks or transfers left: usage {usage} of {urls}, router {pending}"
        time.sleep(0.25)


def prompt_tokens(url: str, decode: bool) -> float:
    """Prompt tokens an instance has taken: a D's by transfer, a P's prefilled."""
    if decode:
        return _metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    return _metric(url, "vllm:prompt_tokens_total")


def held_blocks(url: str) -> int:
    """KV blocks the instance holds now (vLLM's usage fraction times its number of blocks)."""
    info = next(line for line in _get(url + "/metrics").splitlines() if line.startswith("vllm:cache_config_info{"))
    total = int(info.split('num_gpu_blocks="')[1].split('"')[0])
    return round(_metric(url, "vllm:kv_cache_usage_perc") * total)


def quarantined_since(log: Path, offset: int) -> int:
    """Blocks D's log says it withholds (quarantine: their writer may be frozen, not dead) since ``offset``."""
    text = log.read_bytes()[offset:].decode("utf-8", "replace")
    return sum(int(line.split("; its ")[1].split()[0]) for line in text.splitlines() if "stay quarantined" in line)


def test_losing_a_decode_mid_stream(fleet: Fleet) -> None:
    """This module's D is killed while streams decode on it, through both routers at once.

    ``kvpush router``: a stream on the lost D ends at once with an error event marked retryable naming it
    (in place of ``data: [DONE]``); the others complete as the plain server says; the router's health marks
    the D at once (the failed request's check, not the periodic one). vllm-router: a stream on the lost D
    just ends, neither ``[DONE]`` nor an error event (the client sees it cut short), the others complete.
    Then new requests through either router go to the survivors and equal the plain server's (vllm-router's
    once its health check has taken the D out: before, it sends new requests to the dead D), and the
    survivors hold nothing."""
    f = fleet
    prompts = {name: fleet_prompts(820 + k, IN_FLIGHT, 60) for k, name in enumerate(f.routers)}
    streams = {
        name: [fl.start(base, {**f.body(p, LONG, stream=True), "ignore_eos": True}) for p in prompts[name]]
        for name, base in f.routers.items()
    }
    for runs in streams.values():
        for out, _ in runs:
            assert out.started.wait(120), "a stream never started"
    fl.kill(f.stack.pair.d)
    t_kill = time.monotonic()
    for runs in streams.values():
        for _, t in runs:
            t.join()
    for name, runs in streams.items():
        outs = [o for o, _ in runs]
        print(name, [(o.done, o.error is not None, o.broken != "", round(o.seconds, 1)) for o in outs])
        for o, p in zip(outs, prompts[name], strict=True):
            want = f.reference(p).split()
            assert o.words(WORDS) == want[: len(o.words(WORDS))], f"{name}: a stream is not the plain server's"
            assert o.done or len(o.text.split()) < LONG, f"{name}: a stream with all its tokens did not end well"
        cut = [o for o in outs if not o.done]
        assert cut, f"{name}: no stream was on the lost D"
        assert len(cut) < len(outs), f"{name}: every stream was lost, none went to the surviving D"
        if name == "kvpush":
            for o in cut:
                assert o.error is not None and o.retryable_error, f"not a retryable error event: {o}"
                assert (o.error["instance"], o.error["role"]) == (f.stack.d, "decode"), o.error
        else:
            assert all(o.broken and o.error is None for o in cut), f"vllm-router: {cut}"
    decode = f.health()["decode"]
    assert [d["healthy"] for d in decode] == [True, False] and "Cannot connect" in decode[1]["last_error"], decode
    served = decode[1]["served"]
    for k, (name, base) in enumerate(f.routers.items()):
        if name == "vllm-router":
            time.sleep(max(0.0, VLLM_ROUTER_HEALTH_WINDOW - (time.monotonic() - t_kill)))
        ps = fleet_prompts(840 + k, IN_FLIGHT, 40)
        f.check_equal(f.send(base, ps), ps, f"{name} after the D was lost")
    assert f.health()["decode"][1]["served"] == served
    wait_released([f.pair.p, f.stack.p, f.pair.d], f)


def test_losing_a_prefill_in_flight(fleet: Fleet) -> None:
    """This module's P is frozen, given requests through both routers, and killed with them in hand.

    ``kvpush router``: the requests on the lost P are retried on the surviving P (D's half abandoned), so
    every request completes as the plain server says; the P is marked unhealthy at once. vllm-router: a
    request on the lost P is answered HTTP 500 naming it (no retry on the other P); the others complete.
    New requests go to the survivors (vllm-router's once its health check has taken the P out: before, it
    answers them HTTP 500 too). P's survivor holds nothing; D's holds only the blocks of the lost
    P's transfers, which it withholds (quarantine) until that P is fenced: its restart gives them back."""
    f = fleet
    prompts = {name: fleet_prompts(860 + k, IN_FLIGHT, 300) for k, name in enumerate(f.routers)}
    for ps in prompts.values():
        for p in ps:
            f.reference(p)
    log = f.pair.pair[1].log_path
    offset = log.stat().st_size
    failures = f.health()["prefill"][1]["failures"]
    fl.freeze(f.stack.pair.p)
    runs = {
        name: [fl.start(base, {**f.body(p), "ignore_eos": True}) for p in prompts[name]]
        for name, base in f.routers.items()
    }
    deadline = time.monotonic() + 60
    while f.pending()["prefill"][1]["in_flight"] < IN_FLIGHT // 2:
        assert time.monotonic() < deadline, "kvpush router did not send the frozen P its share"
        time.sleep(0.1)
    time.sleep(1.0)  # vllm-router's requests reach the frozen P too (nothing to poll there)
    fl.kill(f.stack.pair.p)
    t_kill = time.monotonic()
    for rs in runs.values():
        for _, t in rs:
            t.join()
    for name, rs in runs.items():
        outs = [o for o, _ in rs]
        print(name, [(o.done, o.status, round(o.seconds, 1)) for o in outs])
        if name == "kvpush":
            f.check_equal(outs, prompts[name], "kvpush router with a P lost under its requests")
            continue
        lost = [o for o in outs if not o.done]
        assert lost and len(lost) < len(outs), f"vllm-router: {outs}"
        assert all(o.status == 500 and f.stack.p in o.error["message"] for o in lost), lost
        kept = [(o, p) for o, p in zip(outs, prompts[name], strict=True) if o.done]
        f.check_equal([o for o, _ in kept], [p for _, p in kept], name)
    prefill = f.health()["prefill"]
    assert [p["healthy"] for p in prefill] == [True, False], prefill
    assert prefill[1]["failures"] - failures >= IN_FLIGHT // 2, prefill  # kvpush's share was on the lost P
    for k, (name, base) in enumerate(f.routers.items()):
        if name == "vllm-router":
            time.sleep(max(0.0, VLLM_ROUTER_HEALTH_WINDOW - (time.monotonic() - t_kill)))
        ps = fleet_prompts(880 + k, IN_FLIGHT, 40)
        f.check_equal(f.send(base, ps), ps, f"{name} after the P was lost")
    wait_released([f.pair.p], f)
    # D declares the frozen-then-lost P dead after peer_dead_s, fails its transfers and withholds their blocks.
    deadline = time.monotonic() + 30
    while (held := held_blocks(f.pair.d)) != (quarantined := quarantined_since(log, offset)) or not quarantined:
        assert time.monotonic() < deadline, f"D holds {held} blocks, {quarantined} withheld for the lost P"
        time.sleep(0.25)


def test_lost_instances_come_back(fleet: Fleet) -> None:
    """Both restarted (same addresses): ``kvpush router``'s periodic check re-admits them, and vllm-router's
    too; requests through either router reach all four instances again and equal the plain server's; the
    blocks D withheld for the lost P come back once the restarted P fences the old session; nothing held."""
    f = fleet
    pair = f.stack.pair
    pair.p, pair.d = fl.restarted(pair.p), fl.restarted(pair.d)
    launcher.wait_all_healthy([pair.p, pair.d], timeout=900)
    deadline = time.monotonic() + 60
    while not all(i["healthy"] for role in ("prefill", "decode") for i in f.health()[role]):
        assert time.monotonic() < deadline, f"kvpush router did not re-admit them: {f.health()}"
        time.sleep(0.2)
    time.sleep(3.0)  # vllm-router's check: every second, healthy after one answer
    urls = [f.pair.p, f.stack.p, f.pair.d, f.stack.d]
    for k, (name, base) in enumerate(f.routers.items()):
        prompts = fleet_prompts(900 + k, 8, 40)
        before = [prompt_tokens(u, i >= 2) for i, u in enumerate(urls)]
        f.check_equal(f.send(base, prompts), prompts, f"{name} after the restart")
        used = [prompt_tokens(u, i >= 2) - b for i, (u, b) in enumerate(zip(urls, before, strict=True))]
        print(name, "prompt tokens of P1, P2, D1, D2 after the restart:", used)
        assert all(used), f"{name} left an instance unused (prompt tokens of P1, P2, D1, D2): {used}"
    wait_released(urls, f)
