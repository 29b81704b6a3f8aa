"""The vLLM compatibility layer against the running vLLM's real classes (every lane runs it).

``detect()`` must find what each lane's vLLM offers; a failed push must
reach that vLLM the way it reads failures (``failed_recving``, or blocks
through ``get_block_ids_with_load_errors``, which vLLM's own
``_update_requests_with_invalid_blocks`` turns back into computed tokens);
and what such a vLLM cannot run safely is refused at start.
"""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler

from kvpush.config import Config
from kvpush.core.errors import ConfigError
from kvpush.core.outcome import Result
from kvpush.integrations.vllm import compat
from kvpush.integrations.vllm.connector import KVPushConnector, KVPushWorkerMetadata
from kvpush.integrations.vllm.orders import AbortOrder, Registration, StepOrders
from kvpush.integrations.vllm.worker_side import WorkerSide

# What each lane's vLLM offers (tests may name versions; the connector never does).
OLD = dict(
    transfer_results=False,
    failed_recving=False,
    cache_hit_source=False,
    loaded_group_ids=False,
    binds_kv_cache_manager=False,
    sleep_mode_hook=False,
    zeroes_loaded_blocks=True,
    kv_cache_access=False,
)
V032 = dict(
    transfer_results=True,
    failed_recving=True,
    cache_hit_source=True,
    loaded_group_ids=True,
    binds_kv_cache_manager=True,
    sleep_mode_hook=False,
    zeroes_loaded_blocks=False,
    kv_cache_access=False,
)
EXPECTED = {
    "0.24": OLD,
    "0.29": OLD,
    "0.32": V032,
    # 0.34: its Python sources over the main lane's packages (tools/kvpush_tools/newest_vllm.py); its CUDA wheel
    # cannot start a server here.
    "0.34": {**V032, "sleep_mode_hook": True, "kv_cache_access": True},
}
LANE = ".".join(vllm.__version__.split(".")[:2])
BS = 16


def test_detect_finds_this_lanes_features() -> None:
    f = compat.detect()
    assert f.version == vllm.__version__
    if LANE not in EXPECTED:
        pytest.skip(f"no expectation recorded for vLLM {vllm.__version__}")
    got = {k.name: getattr(f, k.name) for k in fields(f) if k.name != "version"}
    assert got == EXPECTED[LANE]


def test_transfer_results_and_hit_source_follow_the_features() -> None:
    f = compat.detect()
    cls = compat.transfer_results_class()
    assert (cls is not compat.TransferResults) == f.transfer_results
    r = cls({"a"}, {"b"}, {"b"})
    assert (r.finished_sending, r.finished_recving, r.failed_recving) == ({"a"}, {"b"}, {"b"})
    source = compat.p2p_cache_hit_source()
    assert (source is not None) == f.cache_hit_source
    hook = getattr(KVPushConnector, "get_external_cache_hit_sources", None)  # vLLM's, where it counts sources
    if hook is not None:  # vLLM's default hook counts the tokens under the connector's source
        assert hook(object.__new__(KVPushConnector), None, 5) == {source: 5}


def test_the_running_vllm_starts() -> None:
    """Every need of ``compat.NEEDS`` is met by this lane's vLLM; it starts without a word inside the tested range
    (and with the warning only where the newest published vLLM is checked beyond it)."""
    verdict = compat.check_vllm(vllm.__version__, compat.read_surface(), compat.read_layouts())
    assert verdict.refusal == ""
    assert bool(verdict.warning) == (compat.TESTED_VLLM.standing(vllm.__version__) == "newer")


def test_check_start_refuses_sleep_mode_where_vllm_never_asks() -> None:
    f = compat.detect()
    for hook in (False, True):
        feats = compat.Features(**{**_as_dict(f), "sleep_mode_hook": hook})
        if hook:
            compat.check_start(feats, consumer=True, num_kv_cache_groups=1, sleep_mode=True)
        else:
            with pytest.raises(ConfigError, match="enable-sleep-mode"):
                compat.check_start(feats, consumer=True, num_kv_cache_groups=1, sleep_mode=True)
    compat.check_start(f, consumer=True, num_kv_cache_groups=1, sleep_mode=False)


def test_check_start_refuses_hybrid_decode_without_failed_recving() -> None:
    f = compat.detect()
    if LANE in EXPECTED:
        assert f.failures_by_request == (EXPECTED[LANE]["transfer_results"] and EXPECTED[LANE]["failed_recving"])
    if f.failures_by_request:
        compat.check_start(f, consumer=True, num_kv_cache_groups=3, sleep_mode=False)
    else:
        with pytest.raises(ConfigError, match="3 KV-cache groups"):
            compat.check_start(f, consumer=True, num_kv_cache_groups=3, sleep_mode=False)
    compat.check_start(f, consumer=False, num_kv_cache_groups=3, sleep_mode=False)  # P receives nothing
    compat.check_start(f, consumer=True, num_kv_cache_groups=1, sleep_mode=False)


def test_connector_refuses_sleep_mode_at_start() -> None:
    """The connector itself runs the check before anything starts (vLLM without the hook)."""
    if compat.detect().sleep_mode_hook:
        pytest.skip("this vLLM asks supports_sleep_mode itself")
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=False),
        model_config=SimpleNamespace(enable_sleep_mode=True),
    )
    with pytest.raises(ConfigError, match="sleep mode"):
        KVPushConnector(config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("start", "tokens", "want"),
    [(0, 40, {10, 11, 12}), (16, 40, {11, 12}), (32, 33, {12}), (48, 48, set()), (0, 16, {10})],
)
def test_load_error_blocks(start: int, tokens: int, want: set[int]) -> None:
    assert compat.load_error_blocks((10, 11, 12, 13), start, tokens, BS) == want


def _vllm_invalid_blocks(blocks: list[int], computed: int, invalid: set[int]) -> tuple[set[str], int]:
    """vLLM's own ``_update_requests_with_invalid_blocks`` on one waiting request; its computed tokens after."""
    request = SimpleNamespace(request_id="r", num_computed_tokens=computed)
    sched = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(get_block_ids=lambda rid: (blocks,)),
        block_size=BS,
    )
    affected, _, _ = Scheduler._update_requests_with_invalid_blocks(sched, [request], invalid, {}, evict_blocks=False)
    return affected, request.num_computed_tokens


@pytest.mark.parametrize("local", [0, 16, 32])
def test_vllm_recomputes_exactly_what_the_failed_push_was_to_load(local: int) -> None:
    """Reported blocks make vLLM's real scheduler code keep D's local prefix and drop every pushed token."""
    blocks, tokens = [10, 11, 12, 13], 57
    invalid = compat.load_error_blocks(tuple(blocks), local, tokens, BS)
    affected, computed = _vllm_invalid_blocks(blocks, tokens, invalid)
    assert affected == {"r"}
    assert computed == local


class _Backend:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record_ready(self) -> str:
        self.log.append("record")
        return "marker"

    def wait_ready(self, marker: Any) -> None:
        self.log.append(f"wait {marker}")


class _Receiver:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.results: list[Result] = []

    def register(self, transfer_id: str, request_id: str, *args: Any) -> None:
        self.log.append(f"register {request_id}")

    def poll(self) -> list[Result]:
        out, self.results = self.results, []
        return out

    def abort(self, transfer_id: str, reason: str) -> None:
        self.log.append(f"abort {transfer_id}")


def _decode_worker(
    failures_by_request: bool = True, recompute: bool = False, bad_start: int = 16
) -> tuple[WorkerSide, _Receiver, list[str]]:
    log: list[str] = []
    w = WorkerSide(
        Config(),
        _Backend(log),  # type: ignore[arg-type]
        "d",
        0,
        1,
        producer=False,
        consumer=True,
        failures_by_request=failures_by_request,
        recompute=recompute,
    )
    w.receiver = _Receiver(log)  # type: ignore[assignment]
    regs = [
        Registration("ok", "t-ok", "h", 1, 1, ((1, 2, 3),), 40, 0),
        Registration("bad", "t-bad", "h", 1, 1, ((4, 5, 6, 7),), 60, bad_start),
    ]
    w.apply(StepOrders(registrations=regs))
    w.receiver.results = [Result("t-ok", "ok", True), Result("t-bad", "bad", False, "P died")]  # type: ignore[union-attr]
    return w, w.receiver, log  # type: ignore[return-value]


def _connector(worker: WorkerSide) -> KVPushConnector:
    c = object.__new__(KVPushConnector)
    c.worker = worker
    c._load_errors = set()
    c._kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BS))]
    )
    return c


def test_get_finished_reports_a_failed_push_as_load_errors_in_the_same_step() -> None:
    """vLLM without failed_recving: the failed request is finished receiving and its pushed blocks are invalid."""
    c = _connector(_decode_worker()[0])
    _, recving = c.get_finished(set())
    assert recving == {"ok", "bad"}
    assert c.get_block_ids_with_load_errors() == {5, 6, 7}  # block 4 holds D's 16-token local prefix
    assert c.get_block_ids_with_load_errors() == set()


def test_get_transfer_results_reports_a_failed_push_by_request() -> None:
    c = _connector(_decode_worker()[0])
    res = c.get_transfer_results(set())
    assert res.finished_recving == {"ok", "bad"}
    assert res.failed_recving == {"bad"}
    assert c.get_block_ids_with_load_errors() == set()  # vLLM reads failed_recving; no block report as well


def _as_dict(f: compat.Features) -> dict[str, Any]:
    return {k.name: getattr(f, k.name) for k in fields(f)}


def test_p_lists_every_block_but_only_the_prompts_tokens_move() -> None:
    """Some vLLM hands ``request_finished`` every block of P's request (its sampled token's block too), not
    the blocks of its computed tokens: the push carries the prompt's tokens, so D needs the prompt's blocks."""
    from helpers_layout import make_side

    from kvpush.core.layout import TokenOrder
    from kvpush.core.pieces import map_pieces
    from kvpush.integrations.vllm.scheduler_side import SchedulerSide

    s = SchedulerSide()
    # 32-token prompt of 16-token blocks, plus the block vLLM allocated for the sampled token.
    assert s.finished("r", {"do_remote_decode": True, "transfer_id": "t"}, True, ([3, 4, 5],), 32) is True
    (order,) = s.take_orders().prefills
    assert (order.block_ids, order.num_tokens) == (((3, 4, 5),), 32)
    kw = dict(block_size=16, num_blocks=8, head_bytes=4, num_heads=4, head_start=0, local_heads=4, num_regions=1)
    src, dst = make_side(**kw, order=TokenOrder.NHD), make_side(**kw, order=TokenOrder.NHD)
    pieces = map_pieces(src.layout, dst.layout, order.block_ids[0], [6, 7], order.num_tokens)
    assert int(pieces[:, 2].sum()) == 32 * 4 * 4  # every prompt token's heads, nothing of block 5


def test_a_failure_reaches_vllm_at_once_and_its_blocks_are_released_only_when_fenced() -> None:
    """A writer declared dead may be frozen mid-WRITE: its failure reaches vLLM at once (vLLM fails the request or
    recomputes it into fresh blocks), once, and the workers tell the scheduler half that its blocks stay withheld
    until the fenced Result, which reaches vLLM as nothing but their release."""
    dead = Result("t-bad", "bad", False, "P silent: dead", fenced=False)
    fenced = Result("t-bad", "bad", False, "P silent: dead", fenced=True)
    # vLLM that reads only block ids, policy fail: reported now, with the blocks after D's local prefix.
    w, receiver, _ = _decode_worker(failures_by_request=False)
    c = _connector(w)
    receiver.results = [Result("t-ok", "ok", True), dead]
    assert c.get_finished(set()) == (set(), {"ok", "bad"})
    assert c.get_block_ids_with_load_errors() == {5, 6, 7}
    meta = c.build_connector_worker_meta()
    assert isinstance(meta, KVPushWorkerMetadata) and (meta.withheld, meta.released) == ({"bad": 1}, {})
    assert c.build_connector_worker_meta() is None
    receiver.results = [fenced]
    assert c.get_finished(set()) == (set(), set())  # vLLM heard of it already
    assert c.get_block_ids_with_load_errors() == set()
    meta = c.build_connector_worker_meta()
    assert isinstance(meta, KVPushWorkerMetadata) and (meta.withheld, meta.released) == ({}, {"bad": 1})
    # By request id, where vLLM reads failed_recving: recompute starts afresh, so it is reported now too.
    w, receiver, _ = _decode_worker(recompute=True)
    c = _connector(w)
    receiver.results = [dead]
    res = c.get_transfer_results(set())
    assert (res.finished_recving, res.failed_recving) == ({"bad"}, {"bad"})
    receiver.results = [fenced]
    res = c.get_transfer_results(set())
    assert (res.finished_recving, res.failed_recving) == (set(), set())
    # vLLM reading block ids under recompute rewinds to the first failed block: after a local prefix hit it
    # would recompute into these very blocks, so that request waits for the fence; without one, it does not.
    w, receiver, _ = _decode_worker(failures_by_request=False, recompute=True)
    c = _connector(w)
    receiver.results = [dead]
    assert c.get_finished(set()) == (set(), set())
    assert c.build_connector_worker_meta() is None
    receiver.results = [fenced]
    assert c.get_finished(set()) == (set(), {"bad"})
    assert c.get_block_ids_with_load_errors() == {5, 6, 7}
    w, receiver, _ = _decode_worker(failures_by_request=False, recompute=True, bad_start=0)
    c = _connector(w)
    receiver.results = [dead]
    assert c.get_finished(set()) == (set(), {"bad"})
    assert c.get_block_ids_with_load_errors() == {4, 5, 6, 7}  # all: vLLM frees them and starts afresh


def test_a_request_aborted_after_its_failure_reached_vllm_is_never_reported_sent() -> None:
    """vLLM freed the request when it heard of the failure: the abort that crossed it must not make the fenced
    Result a ``finished_sending`` (vLLM would look up a request it no longer has); the blocks are released."""
    w, receiver, _ = _decode_worker()
    c = _connector(w)
    receiver.results = [Result("t-bad", "bad", False, "P silent: dead", fenced=False)]
    assert c.get_transfer_results(set()).failed_recving == {"bad"}
    c.build_connector_worker_meta()
    w.apply(StepOrders(aborts=[AbortOrder("bad", "t-bad", "decode")]))
    receiver.results = [Result("t-bad", "bad", False, "P silent: dead", fenced=True)]
    res = c.get_transfer_results({"bad"})
    assert (res.finished_sending, res.finished_recving) == (set(), set())
    meta = c.build_connector_worker_meta()
    assert isinstance(meta, KVPushWorkerMetadata) and meta.released == {"bad": 1}
    assert c.get_transfer_results(set()).finished_sending == set()
    assert not w._fencing and not w._expect, "the worker still waits to report a request vLLM no longer has"


def test_worker_metadata_adds_up_over_the_workers() -> None:
    a = KVPushWorkerMetadata({"r": 1}, {})
    b = KVPushWorkerMetadata({"r": 1, "s": 1}, {"q": 1})
    total = a.aggregate(b)
    assert isinstance(total, KVPushWorkerMetadata)
    assert (total.withheld, total.released) == ({"r": 2, "s": 1}, {"q": 1})
    assert (a.withheld, b.withheld) == ({"r": 1}, {"r": 1, "s": 1})  # the parts are left alone


def test_vllm_that_asks_allocates_the_kv_cache_for_nixl_registration() -> None:
    """vLLM that asks connectors how they reach the KV cache (``kv_cache_access``) learns through its own
    config and factory that kvpush registers it, so it backs each segment with one physical allocation."""
    if not compat.detect().kv_cache_access:
        pytest.skip(f"vLLM {vllm.__version__} does not ask connectors how they reach the KV cache")
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="KVPushConnector",
        kv_connector_module_path="kvpush.integrations.vllm.connector",
        kv_role="kv_consumer",
    )
    assert config.registers_kv_cache_memory()
    assert config.kv_cache_access().needs_single_chunk()
