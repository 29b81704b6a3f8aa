"""The connector's scheduler half: which requests keep blocks, and what workers are told."""

import pytest

from kvpush.errors import ConfigError
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
