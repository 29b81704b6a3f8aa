"""Two processes push Neuron-laid-out KV through the kvpush engine and real NIXL agents, byte-exact.

P and D are spawned processes, each with its own runtime (the stand-in here,
libnrt on a trn host), KV tensors filled through the runtime, a
``NeuronBackend`` and a real NIXL agent (UCX here). D's bytes, read back
through the runtime, must equal what an independent model of the layouts
says: the requested tokens of the shared heads replaced, every other byte
untouched.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from _kvmodel import Side, expected_after, random_arrays, same_bytes
from _push_worker import D_SEED, P_SEED, Env, Scenario, run

NIXL = os.environ.get("KVPUSH_NEURON_TEST_NIXL", "UCX")
CORES = os.environ.get("KVPUSH_NEURON_TEST_CORES", "0,1,2").split(",")

SCENARIOS = [
    # vLLM-Neuron to vLLM-Neuron, direct registration: one [2, blocks, heads, tokens, dim] tensor a layer on both
    # sides, P at the platform's default 32-token blocks, D at 16 with a 20-token prefix already cached.
    Scenario(
        "direct-vllm_neuron-paged32-to-paged16",
        mode="direct",
        plan="direct",
        p=Side("paged", 3, 4, 0, 1, 16, "float16", 32, 6),
        p_blocks=[4, 1, 3],
        d=Side("paged", 3, 4, 0, 1, 16, "float16", 16, 12),
        d_blocks=[7, 2, 10, 0, 5],
        num_tokens=75,
        start_token=20,
    ),
    # Direct registration: a standalone NxDI per-sequence cache (slot 1 of 3) into vLLM-Neuron paged blocks.
    Scenario(
        "direct-nxdi_bhsd-to-paged",
        mode="direct",
        plan="direct",
        p=Side("bhsd", 2, 4, 0, 1, 16, "float16", 64, 3),
        p_blocks=[1],
        d=Side("paged", 2, 4, 0, 1, 16, "float16", 16, 8),
        d_blocks=[5, 2, 7, 0],
        num_tokens=50,
    ),
    # Host staging: paged blocks into NxDI's per-sequence cache, D already holding 12 prefix tokens.
    Scenario(
        "host_staging-paged-to-nxdi_bhsd",
        mode="host_staging",
        plan="staged",
        p=Side("paged", 2, 4, 0, 1, 16, "float16", 8, 10),
        p_blocks=[9, 0, 4, 6, 1, 3, 7],
        d=Side("bhsd", 2, 4, 0, 1, 16, "float16", 64, 3),
        d_blocks=[2],
        num_tokens=53,
        start_token=12,
    ),
    # Direct mode, packed on the device (nrt_tensor_copy), with P's KV still being written when handed over.
    Scenario(
        "direct-staged-async_prefill-nxdi_block-to-paged",
        mode="direct",
        plan="staged",
        p=Side("nxdi_block", 2, 4, 0, 1, 16, "float16", 4, 12),
        p_blocks=[3, 11, 0, 7, 5, 9, 2, 8, 1, 10],
        d=Side("paged", 2, 4, 0, 1, 16, "float16", 16, 4),
        d_blocks=[3, 1, 0],
        num_tokens=37,
        delay_s=0.4,
    ),
]


def _recv(conn, who: str, timeout: float = 60.0) -> tuple[str, str, object]:
    if not conn.poll(timeout):
        raise AssertionError(f"{who} worker sent nothing in {timeout}s")
    return conn.recv()


@pytest.fixture(scope="module")
def pushed(nrt_lib: str, is_standin: bool) -> dict[str, dict]:
    """Run every scenario in one P process and one D process (NIXL's import dominates start-up)."""
    scenarios = [s for s in SCENARIOS if is_standin or not s.delay_s]
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    p = ctx.Process(target=run, args=("P", scenarios, Env(nrt_lib, NIXL, CORES[1]), p_child), daemon=True)
    d = ctx.Process(target=run, args=("D", scenarios, Env(nrt_lib, NIXL, CORES[2]), d_child), daemon=True)
    p.start()
    d.start()
    out: dict[str, dict] = {}
    try:
        for sc in scenarios:
            tag, _, p_first = _recv(p_conn, "P")
            d_conn.send(p_first if tag == "addr" else None)
            d_tag, _, d_payload = _recv(d_conn, "D")
            if tag == "addr":
                p_conn.send("done")
                tag, _, p_first = _recv(p_conn, "P")
            out[sc.name] = {"p": (tag, p_first), "d": (d_tag, d_payload)}
    finally:
        for proc in (p, d):
            proc.join(15)
            if proc.is_alive():
                proc.kill()
    return out


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_two_process_push_is_byte_exact(sc: Scenario, pushed: dict[str, dict], is_standin: bool) -> None:
    if sc.delay_s and not is_standin:
        pytest.skip("simulating an in-flight prefill needs the stand-in's delayed write")
    (p_tag, p_out), (d_tag, d_out) = pushed[sc.name]["p"], pushed[sc.name]["d"]
    assert p_tag == "ok", f"P worker failed:\n{p_out}"
    assert d_tag == "ok", f"D worker failed:\n{d_out}"
    assert d_out["ok"], f"D: {d_out['reason']}"
    assert p_out["ok"], f"P: {p_out['reason']}"
    if sc.delay_s:
        assert p_out["elapsed"] >= sc.delay_s * 0.9, "P pushed before its prefill's device work completed"
    assert p_out["source_ok"], "P's KV changed while being pushed"
    assert p_out["stats"].get(f"plan_{sc.plan}_total") == 1, p_out["stats"]

    src = random_arrays(sc.p, P_SEED)
    before = random_arrays(sc.d, D_SEED)
    want = expected_after(sc.p, src, sc.p_blocks, sc.d, before, sc.d_blocks, sc.num_tokens, sc.start_token)
    got = [raw.view(sc.d.dtype).reshape(shape) for raw, shape in zip(d_out["after"], sc.d.shapes(), strict=True)]
    assert not same_bytes(before, want), "the scenario must change D's cache"
    assert same_bytes(got, want), "D's KV differs from P's requested tokens (or bytes outside them changed)"
