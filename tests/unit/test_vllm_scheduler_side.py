"""The connector's scheduler half: which requests keep blocks, and what workers are told."""

import pytest

from kvpush.core.errors import ConfigError
from kvpush.integrations.vllm.params import PrefillAdvert
from kvpush.integrations.vllm.scheduler_side import SchedulerSide

D_PARAMS = {"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "127.0.0.1", "remote_port": 5600}


def test_plain_request_passes_through():
    s = SchedulerSide()
    assert s.matched_tokens("r", None, 100, 0) == (0, False)
    s.after_alloc("r", None, ([1, 2],), 0, 0)
    assert s.finished("r", None, True, ([1, 2],), 100) is False
    orders = s.take_orders()
    assert not orders.registrations and not orders.prefills and not orders.aborts
    assert not s.has_pending_work()


def test_decode_registers_only_uncached_tokens_once():
    s = SchedulerSide()
    params = dict(D_PARAMS)
    # D already holds 32 tokens of the 100-token prompt (prefix cache).
    assert s.matched_tokens("r", params, 100, 32) == (68, True)
    s.after_alloc("r", params, ([7, 8, 9, 10],), 32, 68)
    (reg,) = s.take_orders().registrations
    assert (reg.transfer_id, reg.num_tokens, reg.start_token) == ("t1", 100, 32)
    assert reg.block_ids == ((7, 8, 9, 10),)
    # Asked again after the load: nothing more is remote.
    assert s.matched_tokens("r", params, 100, 100) == (0, False)
    s.after_alloc("r", params, ([7, 8, 9, 10],), 100, 0)
    assert not s.take_orders().registrations
    s.on_output(set(), {"r"})
    assert s.finished("r", params, True, ([7, 8, 9, 10],), 100) is False


def test_decode_abort_before_kv_arrives_keeps_blocks_until_fenced():
    s = SchedulerSide()
    params = dict(D_PARAMS)
    s.matched_tokens("r", params, 64, 0)
    s.after_alloc("r", params, ([1, 2],), 0, 64)
    s.take_orders()
    assert s.finished("r", params, False, ([1, 2],), 64) is True
    (abort,) = s.take_orders().aborts
    assert (abort.request_id, abort.side) == ("r", "decode")
    assert s.has_pending_work()
    s.on_output({"r"}, set())
    assert not s.has_pending_work()


def test_prefill_holds_blocks_until_sent_and_abort_is_forwarded():
    s = SchedulerSide()
    p = {"do_remote_decode": True, "transfer_id": "t9"}
    assert s.finished("a", p, True, ([3, 4],), 40) is True
    (pre,) = s.take_orders().prefills
    assert (pre.transfer_id, pre.block_ids, pre.num_tokens) == ("t9", ((3, 4),), 40)
    assert s.has_pending_work()
    s.on_output({"a"}, set())
    assert not s.has_pending_work()
    # Aborted on P: blocks are freed now, D is told through the engine.
    assert s.finished("b", {"do_remote_decode": True, "transfer_id": "t10"}, False, ([5],), 10) is False
    (abort,) = s.take_orders().aborts
    assert (abort.transfer_id, abort.side) == ("t10", "prefill")


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"do_remote_prefill": True, "remote_port": 5600}, "remote_host"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": "x"}, "remote_port"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_tp_size": 0}, "remote_tp_size"),
        ({"do_remote_decode": True, "transfer_id": 5}, "transfer_id"),
    ],
)
def test_bad_params_name_the_field(params, needle):
    with pytest.raises(ConfigError, match=needle):
        SchedulerSide().matched_tokens(
            "r", params, 10, 0
        ) if "do_remote_prefill" in params else SchedulerSide().finished("r", params, True, ([1],), 10)


# -- layer-wise (P side) ---------------------------------------------------------------

P_PARAMS = {"do_remote_decode": True, "transfer_id": "tp"}


def _chunk(rid, blocks, computed, scheduled, replace=False):
    from kvpush.integrations.vllm.scheduler_inputs import ScheduledChunk

    return ScheduledChunk(rid, None if blocks is None else (tuple(blocks),), replace, computed, scheduled)


def test_layerwise_announces_only_the_final_chunk_with_all_blocks():
    s = SchedulerSide(layerwise=True)
    s.prefill_admitted("r", dict(P_PARAMS), 100, 1)
    s.scheduled([_chunk("r", [1, 2], 0, 64, replace=True)])  # chunk 1 of 2
    assert not s.take_orders().layer_prefills
    s.scheduled([_chunk("r", [3, 4], 64, 36)])  # final chunk: blocks appended
    (lp,) = s.take_orders().layer_prefills
    assert (lp.request_id, lp.transfer_id, lp.block_ids, lp.num_tokens) == ("r", "tp", ((1, 2, 3, 4),), 100)
    # Announced once; the finish keeps the blocks without a second (whole-request) order.
    s.scheduled([_chunk("r", None, 100, 1)])
    assert s.finished("r", dict(P_PARAMS), True, ([1, 2, 3, 4],), 100) is True
    orders = s.take_orders()
    assert not orders.layer_prefills and not orders.prefills and not orders.aborts
    assert s.has_pending_work()
    s.on_output({"r"}, set())
    assert not s.has_pending_work()


def test_layerwise_resumed_request_replaces_its_blocks():
    s = SchedulerSide(layerwise=True)
    s.prefill_admitted("r", dict(P_PARAMS), 100, 1)
    s.scheduled([_chunk("r", [1, 2], 0, 64, replace=True)])
    s.scheduled([_chunk("r", [7, 8, 9, 10], 0, 100, replace=True)])  # preempted, resumed from scratch
    (lp,) = s.take_orders().layer_prefills
    assert lp.block_ids == ((7, 8, 9, 10),)


def test_layerwise_abort_after_announce_keeps_blocks_and_forwards_the_abort():
    s = SchedulerSide(layerwise=True)
    s.prefill_admitted("r", dict(P_PARAMS), 40, 1)
    s.scheduled([_chunk("r", [5, 6], 0, 40, replace=True)])
    s.take_orders()
    assert s.finished("r", dict(P_PARAMS), False, ([5, 6],), 40) is True  # a layer may be in flight
    (ab,) = s.take_orders().aborts
    assert (ab.request_id, ab.transfer_id, ab.side) == ("r", "tp", "prefill")
    s.on_output({"r"}, set())
    assert not s.has_pending_work()


@pytest.mark.parametrize(
    ("layerwise", "params", "max_tokens"),
    [(False, P_PARAMS, 1), (True, P_PARAMS, 16), (True, None, 1), (True, D_PARAMS, 1)],
    ids=["mode-off", "keeps-decoding-on-P", "plain-request", "decode-request"],
)
def test_layerwise_leaves_other_requests_alone(layerwise, params, max_tokens):
    s = SchedulerSide(layerwise=layerwise, layerwise_min_tokens=40)
    s.prefill_admitted("r", None if params is None else dict(params), 40, max_tokens)
    s.scheduled([_chunk("r", [5, 6], 0, 40, replace=True)])
    assert not s.take_orders().layer_prefills


def test_layerwise_skips_prompts_below_the_threshold():
    s = SchedulerSide(layerwise=True, layerwise_min_tokens=41)
    s.prefill_admitted("r", dict(P_PARAMS), 40, 1)
    s.scheduled([_chunk("r", [5, 6], 0, 40, replace=True)])
    assert not s.take_orders().layer_prefills
    s.prefill_admitted("q", dict(P_PARAMS), 41, 1)
    s.scheduled([_chunk("q", [7, 8], 0, 41, replace=True)])
    assert [lp.request_id for lp in s.take_orders().layer_prefills] == ["q"]


def test_layerwise_candidate_aborted_before_its_final_chunk_is_forgotten():
    s = SchedulerSide(layerwise=True)
    s.prefill_admitted("r", dict(P_PARAMS), 100, 1)
    s.scheduled([_chunk("r", [1, 2], 0, 64, replace=True)])
    assert s.finished("r", dict(P_PARAMS), False, ([1, 2],), 100) is False  # nothing was pushed yet
    s.scheduled([_chunk("r", [3], 64, 36)])
    orders = s.take_orders()
    assert not orders.layer_prefills
    assert [a.side for a in orders.aborts] == ["prefill"]


def test_decode_request_aborted_before_it_got_blocks_tells_p() -> None:
    """D never registered (aborted while waiting for blocks): P's parked prefill is named at once."""
    s = SchedulerSide()
    params = {**D_PARAMS, "tp_size": 2}
    assert s.matched_tokens("r", params, 64, 0) == (64, True)
    assert s.finished("r", params, False, ([],), 64) is False  # no blocks to keep
    (cancel,) = s.take_orders().cancels
    assert (cancel.request_id, cancel.transfer_id, cancel.host, cancel.port, cancel.tp_size) == (
        "r",
        "t1",
        "127.0.0.1",
        5600,
        2,
    )
    assert s.finished("r", params, False, ([],), 64) is False  # said once
    assert not s.take_orders().cancels


def test_registered_decode_request_is_not_cancelled_but_fenced() -> None:
    s = SchedulerSide()
    params = dict(D_PARAMS)
    s.matched_tokens("r", params, 64, 0)
    s.after_alloc("r", params, ([1, 2],), 0, 64)
    s.take_orders()
    s.on_output(set(), {"r"})
    assert s.finished("r", params, True, ([1, 2],), 64) is False
    orders = s.take_orders()
    assert not orders.cancels and not orders.aborts


def test_prefill_answers_with_vllms_field_names_only_when_its_blocks_wait() -> None:
    advert = PrefillAdvert("p-engine", "10.0.0.7", 5600, 2)
    s = SchedulerSide(advert=advert)
    p = {"do_remote_decode": True, "transfer_id": "t9"}
    parked = s.finished("cmpl-x-0-deadbeef", p, True, ([3, 4],), 40)
    answer = s.answer("cmpl-x-0-deadbeef", p, parked)
    assert answer == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p-engine",
        "remote_request_id": "cmpl-x-0-deadbeef",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 2,
        "transfer_id": "t9",
    }
    assert s.answer("cmpl-x-1-deadbeef", {"do_remote_decode": True, "transfer_id": "t9"}, True)["transfer_id"] == "t9"
    assert s.answer("a", p, False) is None  # aborted, or no blocks: D must not wait for it
    assert s.answer("a", None, True) is None
    assert s.answer("a", {**D_PARAMS}, True) is None
    assert SchedulerSide().answer("a", p, True) is None  # no advert (free port): nothing to tell


def test_sub_requests_of_a_prompt_list_get_their_own_transfers() -> None:
    s = SchedulerSide()
    p = {"do_remote_decode": True, "transfer_id": "T"}
    for i in range(3):
        assert s.finished(f"cmpl-X-{i}-0000000{i}", dict(p), True, ([i],), 10)
    assert [o.transfer_id for o in s.take_orders().prefills] == ["T", "T/1.0", "T/2.0"]


def test_prefill_states_follow_p_scheduler_queue():
    """P tells its workers where each prefill stands: queued behind the prompt tokens before it, then running;
    only changes are ordered, and a finished or aborted prefill is forgotten."""
    s = SchedulerSide()
    for rid, tid, n in (("a", "ta", 100), ("b", "tb", 300), ("c", "tc", 50)):
        s.prefill_arrived(rid, {"do_remote_decode": True, "transfer_id": tid}, n)
    s.prefill_arrived("plain", None, 1000)  # not a kvpush prefill: not reported, not counted ahead
    s.step_states({"a", "plain"})
    told = [(o.transfer_id, o.state.value, o.tokens_ahead) for o in s.take_orders().prefill_states]
    assert told == [("ta", "running", 0), ("tb", "queued", 0), ("tc", "queued", 300)]
    s.step_states({"a"})
    assert not s.take_orders().prefill_states  # nothing changed
    assert s.finished("b", {"do_remote_decode": True, "transfer_id": "tb"}, False, ([],), 300) is False
    s.step_states(set())
    orders = s.take_orders()
    assert [(o.transfer_id, o.tokens_ahead) for o in orders.prefill_states] == [("tc", 0)]
    assert [a.transfer_id for a in orders.aborts] == ["tb"]
    assert s.pending()["queued_prefills"] == 1 and s.pending()["running_prefills"] == 1


def test_decode_registers_late_beyond_the_bound_per_p():
    """At most ``max_waiting_registrations`` registrations wait on one P; a request beyond them holds no blocks
    (vLLM asks again next step) until one of them ends; other P instances are not affected."""
    s = SchedulerSide(max_waiting_registrations=2)

    def params(tid: str, port: int = 5600) -> dict:
        return {**D_PARAMS, "transfer_id": tid, "remote_port": port}

    for rid in ("r1", "r2"):
        assert s.matched_tokens(rid, params(rid), 64, 0) == (64, True)
        s.after_alloc(rid, params(rid), ([1],), 0, 64)
    assert s.matched_tokens("r3", params("r3"), 64, 0) == (None, False)
    assert s.matched_tokens("o1", params("o1", 5700), 64, 0) == (64, True)
    assert s.counters["deferred_registrations"] == 1
    s.on_output(set(), {"r1"})
    assert s.matched_tokens("r3", params("r3"), 64, 0) == (64, True)
    s.after_alloc("r3", params("r3"), ([2],), 0, 64)
    assert s.finished("r2", params("r2"), False, ([1],), 64) is True  # aborted: fencing, not waiting on P
    assert s.waiting_on(("127.0.0.1", 5600)) == 1


def test_decode_finished_in_the_step_its_transfer_ended_is_not_fenced():
    """vLLM fails a request whose load failed (``kv_load_failure_policy`` fail) before it reads that step's
    finished_recving, then frees its blocks on it: no fence is left pending, no abort goes to the workers."""
    s = SchedulerSide()
    params = dict(D_PARAMS)
    assert s.matched_tokens("r", params, 100, 0) == (100, True)
    s.after_alloc("r", params, ([7, 8, 9, 10],), 0, 100)
    s.take_orders()
    assert s.finished("r", params, False, ([7, 8, 9, 10],), 100) is True
    s.on_output(set(), {"r"})
    assert not s.take_orders().aborts
    assert not s.has_pending_work()
    assert s.pending()["fencing"] == 0


def test_decode_failed_early_holds_its_blocks_until_the_workers_release_them():
    """vLLM fails (or recomputes) a request whose load failed while a dead P may still write its blocks: in the
    step vLLM hears of it the scheduler half takes its blocks (before vLLM frees them), keeps the engine
    stepping while it holds them, and gives them back once the workers say they are fenced."""
    s = SchedulerSide()
    s.null_block = 0
    params = dict(D_PARAMS)
    s.matched_tokens("r", params, 100, 0)
    s.after_alloc("r", params, ([0, 7, 8], [9]), 0, 100)
    s.take_orders()
    assert s.finished("r", params, False, ([0, 7, 8], [9]), 100) is True  # policy fail: vLLM ends it first
    assert s.on_output(set(), {"r"}, {"r": 1}, {}) == ([7, 8, 9], [])
    assert not s.take_orders().aborts
    assert s.has_pending_work() and s.pending()["withheld_blocks"] == 3
    assert s.on_output(set(), set(), {}, {"r": 1}) == ([], [7, 8, 9])
    assert not s.has_pending_work()
