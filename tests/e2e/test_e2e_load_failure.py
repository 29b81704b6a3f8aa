"""End to end: a push that fails never decodes unloaded KV, on every supported vLLM.

Real servers: P, and two D's that register with it, one with
``kv_load_failure_policy`` ``"recompute"`` and one with vLLM's default
``"fail"``. Each D gets a request whose KV P is to push (a transfer P has no
prefill for, so P parks D's registration and never WRITEs), then P is
killed (SIGKILL). D declares P dead after ``peer_dead_s`` and holds the
blocks past ``quarantine_s`` (a P only frozen could still write them: the
quarantine is overdue, never released on that timer) until P is started
again at its address and answers D's fencing hello; then the transfer fails,
once. vLLM must then learn of the failure (``failed_recving``, or the
blocks through ``get_block_ids_with_load_errors`` where vLLM has no
``failed_recving``: ``kvpush.integrations.vllm.compat``):

* recompute: D computes the prompt itself; its output equals the same
  prompt computed plainly (asked of the other D, whose cache never held it);
* fail: the request ends with an error, not with text.

Reported as loaded instead, D would decode from blocks no one wrote, and
both checks fail.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import model_dir
from helpers_prometheus import sample_sum

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PEER_DEAD_S = 5.0
QUARANTINE_S = 3.0
"""A killed P is fenced only by a P started again at its address: past this, D's quarantine is overdue, and holds."""
SMALL_STAGING = 4096
"""decode-fail's staging region: one page, less than any prompt of max_model_len tokens of the tiny model."""


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return sample_sum(r.read().decode(), name)


def _usage(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")
    )


class Trio:
    def __init__(
        self,
        p: launcher.ServerProcess,
        d_recompute: launcher.ServerProcess,
        d_fail: launcher.ServerProcess,
        kv: int,
        keys: str,
        restart: Any,
    ):
        self.p, self.d_recompute, self.d_fail, self.kv_port, self.keys = p, d_recompute, d_fail, kv, keys
        self.model = model_dir()
        self.restart = restart
        """Start a P again at the same side-channel address (a new process: it answers D's fencing hello)."""

    def body(self, prompt: str, **kw: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}

    def pushed(self, transfer_id: str) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.kv_port,
            "remote_tp_size": 1,
            "capability": srv.capability(self.keys, transfer_id),
        }


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    logs = tmp_path_factory.mktemp("load-failure-logs")
    keys = srv.temp_keys()
    model = model_dir()
    kv_port = launcher.free_port()

    def decode(name: str, cpus: str, staging_bytes: int | None = None, **policy: str) -> launcher.ServerProcess:
        extra: dict[str, float] = {"peer_dead_s": PEER_DEAD_S, "quarantine_s": QUARANTINE_S}
        if staging_bytes is not None:
            extra["staging_bytes"] = staging_bytes
        cfg = {**srv.kvpush_transfer_config("kv_consumer", 0, auth_keys_dir=keys, **extra), **policy}
        return srv.vllm_server(
            name, model, launcher.free_port(), log_dir=logs, cpus=cpus, kv_transfer_config=cfg, fast_start=True
        )

    def prefill(name: str) -> launcher.ServerProcess:
        return srv.vllm_server(
            name,
            model,
            launcher.free_port(),
            log_dir=logs,
            cpus="0",
            kv_transfer_config=srv.kvpush_transfer_config("kv_producer", kv_port, auth_keys_dir=keys),
            check_ports=(kv_port,),
            fast_start=True,
        )

    servers = [
        prefill("prefill"),
        decode("decode-recompute", "1", kv_load_failure_policy="recompute"),
        # No push here is ever written: its staging region only has to be too small for the start-time check.
        decode("decode-fail", "1", staging_bytes=SMALL_STAGING),
    ]

    def restart() -> None:
        again = prefill("prefill-again")
        servers.append(again)
        again.start()
        launcher.wait_all_healthy([again], timeout=900)

    try:
        for s in servers:
            s.start()
        launcher.wait_all_healthy(servers, timeout=900)
        yield Trio(*servers, kv=kv_port, keys=keys, restart=restart)
    finally:
        launcher.stop_all(servers)


def _wait_holding_blocks(bases: list[str], timeout: float = 120.0) -> None:
    """Until every D holds blocks: its request was admitted and registered with P (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not all(_usage(b) > 0 for b in bases):
        assert time.monotonic() < deadline, "a D never allocated blocks for its pushed request"
        time.sleep(0.2)


def test_p_killed_after_registration_never_decodes_unloaded_kv(trio: Trio) -> None:
    prompt_a, prompt_b = prompt_words(300, seed=401), prompt_words(200, seed=402)
    # Computed plainly on the other D (it never sees prompt A otherwise): the single-instance answer.
    want_a = _post(trio.d_fail.url + "/v1/completions", trio.body(prompt_a))["choices"][0]["text"]
    assert _usage(trio.d_recompute.url) == 0.0 and _usage(trio.d_fail.url) == 0.0

    def ask(base: str, prompt: str, tid: str) -> dict[str, Any] | urllib.error.HTTPError:
        try:
            return _post(base + "/v1/completions", trio.body(prompt, kv_transfer_params=trio.pushed(tid)))
        except urllib.error.HTTPError as exc:
            return exc

    with cf.ThreadPoolExecutor(2) as ex:
        recompute = ex.submit(ask, trio.d_recompute.url, prompt_a, "load-failure-recompute")
        fail = ex.submit(ask, trio.d_fail.url, prompt_b, "load-failure-fail")
        _wait_holding_blocks([trio.d_recompute.url, trio.d_fail.url])
        # SIGKILL of P's process group (the launcher's guard, vLLM and its engine): P parked both
        # registrations and wrote nothing.
        assert trio.p.proc is not None
        os.killpg(trio.p.proc.pid, signal.SIGKILL)
        trio.p.proc.wait()
        # D cannot tell a killed P from a frozen one: past quarantine_s the blocks stay out (overdue), the
        # requests wait.
        deadline = time.monotonic() + 120
        bases = [trio.d_recompute.url, trio.d_fail.url]
        while not all(_metric(b, "kvpush_quarantines_overdue_total") >= 1 for b in bases):
            assert time.monotonic() < deadline, "no D reported its quarantine overdue"
            time.sleep(0.5)
        assert not recompute.done() and not fail.done(), "a request ended while its blocks were quarantined"
        assert all(_metric(b, "kvpush_quarantined_blocks") > 0 for b in bases)
        trio.restart()  # the new P answers D's fencing hello: the blocks can be given back, the failure told
        got_recompute, got_fail = recompute.result(timeout=300), fail.result(timeout=300)

    # Both verdicts first, so a failure names every policy that decoded unloaded KV.
    problems = []
    if isinstance(got_recompute, urllib.error.HTTPError):
        problems.append(f"recompute policy: the request failed ({got_recompute}) instead of being recomputed")
    elif got_recompute["choices"][0]["text"] != want_a:
        problems.append("recompute policy: D decoded KV the failed push never wrote (output differs from plain)")
    if not isinstance(got_fail, urllib.error.HTTPError):
        choice = got_fail["choices"][0]
        if choice["finish_reason"] != "error":
            problems.append(f"fail policy: D answered {choice['text']!r} ({choice['finish_reason']}) from unloaded KV")
    elif got_fail.code < 500:
        problems.append(f"fail policy: HTTP {got_fail.code}, not a server-side failure")
    assert not problems, problems
    # Both D's freed the failed requests' blocks and still serve (the failure reached vLLM once).
    for base in (trio.d_recompute.url, trio.d_fail.url):
        deadline = time.monotonic() + 30
        while _usage(base) != 0.0:
            assert time.monotonic() < deadline, f"{base} kept the failed request's blocks"
            time.sleep(0.5)
    assert _post(trio.d_recompute.url + "/v1/completions", trio.body(prompt_a))["choices"][0]["text"] == want_a
    assert _post(trio.d_fail.url + "/v1/completions", trio.body(prompt_b))["choices"][0]["text"]


def test_logs_name_the_failure(trio: Trio) -> None:
    """D's log says which request's KV did not arrive and why (after the test above killed P)."""
    if trio.p.alive:
        pytest.skip("runs after the kill test")
    for s in (trio.d_recompute, trio.d_fail):
        text = Path(s.log_path).read_text(errors="replace")
        assert "did not arrive" in text, f"{s.name}: no kvpush failure line"


def test_a_d_whose_staging_region_cannot_hold_the_longest_prompt_says_so_at_start(trio: Trio) -> None:
    """The connector checks ``staging_bytes`` against vLLM's ``max_model_len`` as the caches are registered: the
    D with a one-page staging region names the size that would stage every prompt, the D with the default
    region (which holds this model's longest prompt) says nothing."""
    small = Path(trio.d_fail.log_path).read_text(errors="replace")
    default = Path(trio.d_recompute.log_path).read_text(errors="replace")
    line = f"staging_bytes {SMALL_STAGING} holds pushes of up to"
    assert line in small and "to stage prompts up to max_model_len" in small, "no staging warning at start"
    assert "holds pushes of up to" not in default
