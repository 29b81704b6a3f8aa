"""Reading kv_transfer_params in both dialects (vLLM's NIXL connectors and kvpush's), and what P answers.

A router written for vLLM's connectors must drive kvpush unchanged, and a bad
field must fail where the request enters with the field's name, not as a
transfer that times out a minute later.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.core.errors import ConfigError
from kvpush.engine.types import PeerAddress
from kvpush.integrations.vllm.params import (
    DecodeSide,
    PrefillAdvert,
    PrefillSide,
    SubRequest,
    parse,
    prefill_answer,
    sub_request,
)

KVPUSH_D = {
    "do_remote_prefill": True,
    "transfer_id": "t1",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_tp_size": 2,
}
# What vLLM's NixlPushConnector proxy sends D up front (P's coordinates, no transfer id).
VLLM_PUSH_D = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p-engine",
    "remote_request_id": "tid-1",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 2,
}
# What vllm-router's default (NIXL) mode sends P.
VLLM_ROUTER_P = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_not_disaggregated() -> None:
    assert parse(None, "r") is None
    assert parse({}, "r") is None
    assert parse({"do_remote_prefill": False, "do_remote_decode": False}, "r") is None


def test_kvpush_spelling_on_d() -> None:
    assert parse(dict(KVPUSH_D), "r") == DecodeSide("t1", PeerAddress("10.0.0.7", 5600, 2))


def test_vllm_push_spelling_on_d_pairs_by_request_id() -> None:
    """No transfer id: both sides name the pair by the request id the router sent both (vLLM's rule)."""
    d = parse(dict(VLLM_PUSH_D), "cmpl-tid-1-0-0123abcd")
    p = parse({"do_remote_decode": True}, "cmpl-tid-1-0-89abcdef")
    assert d == DecodeSide("cmpl-tid-1", PeerAddress("10.0.0.7", 5600, 2))
    assert isinstance(p, PrefillSide) and p.transfer_id == d.transfer_id


def test_vllm_router_prefill_request_and_p_answer_drive_d() -> None:
    """vllm-router's sequential flow: P's request, P's answer handed to D unchanged, same transfer on both."""
    rid = "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_0f1e2d3c4b5a69788796a5b4c3d2e1f0"
    p_role = parse(dict(VLLM_ROUTER_P), f"cmpl-{rid}-0-1234abcd")
    assert isinstance(p_role, PrefillSide)
    answer = prefill_answer(PrefillAdvert("p-engine", "10.0.0.7", 5600, 1), p_role, f"cmpl-{rid}-0-1234abcd")
    assert answer["remote_host"] == "10.0.0.7" and answer["remote_port"] == 5600 and answer["tp_size"] == 1
    assert answer["remote_engine_id"] == "p-engine" and answer["remote_request_id"] == f"cmpl-{rid}-0-1234abcd"
    d_role = parse(answer, f"cmpl-{rid}-0-9999aaaa")
    assert d_role == DecodeSide(p_role.transfer_id, PeerAddress("10.0.0.7", 5600, 1))


@pytest.mark.parametrize("prompts", [2, 6])
def test_each_prompt_of_a_list_gets_its_own_transfer_on_both_sides(prompts: int) -> None:
    """vLLM splits a prompt list into sub-requests sharing one kv_transfer_params: each pairs with its twin only."""
    p_ids = [parse({"do_remote_decode": True, "transfer_id": "T"}, f"cmpl-X-{i}-{i:08x}") for i in range(prompts)]
    assert all(isinstance(p, PrefillSide) and p.shared_id == "T" for p in p_ids)
    answer = prefill_answer(PrefillAdvert("e", "h", 1, 1), p_ids[0], "cmpl-X-0-00000000")  # type: ignore[arg-type]
    d_ids = [parse(answer, f"cmpl-X-{i}-{i + 100:08x}") for i in range(prompts)]
    p_tids = [p.transfer_id for p in p_ids]  # type: ignore[union-attr]
    assert p_tids == [d.transfer_id for d in d_ids]  # type: ignore[union-attr]
    assert len(set(p_tids)) == prompts
    assert p_tids[0] == "T"  # the first keeps the router's id


def test_sub_request_rules() -> None:
    assert sub_request("r") == SubRequest("r")
    assert sub_request("cmpl-abc-3-deadbeef") == SubRequest("cmpl-abc", 3)
    assert sub_request("cmpl-abc-3") == SubRequest("cmpl-abc", 3)  # randomisation switched off
    assert sub_request("2_cmpl-abc-1-deadbeef") == SubRequest("cmpl-abc", 1, 2)  # n > 1: child 2 of prompt 1
    assert sub_request("chatcmpl-abc-7-deadbeef") == SubRequest("chatcmpl-abc-7")  # chat: one prompt
    assert SubRequest("b", 1, 0).transfer_id("T") == "T/1.0" != SubRequest("b", 0, 1).transfer_id("T")
    # vLLM writes its indexes in ASCII digits: another script's digits are part of the id, not an index
    assert sub_request("cmpl-abc-\u0663-deadbeef") == SubRequest("cmpl-abc-\u0663")
    assert sub_request("\u0662_cmpl-abc-1-deadbeef") == SubRequest("\u0662_cmpl-abc-1")
    assert sub_request("cmpl-abc-3\n") == SubRequest("cmpl-abc-3\n")  # a whole id, not one before a newline


def test_p_address_from_a_service_discovery_request_id() -> None:
    """vllm-router with service discovery names P's registered address in the request id, not in the params."""
    params = {"do_remote_prefill": True, "transfer_id": "tx-1", "remote_tp_size": 1, "remote_engine_id": None}
    rid = "cmpl-___prefill_addr_10.1.2.3:5601___decode_addr_10.1.2.4:5700_abc-0-0123abcd"
    assert parse(params, rid) == DecodeSide("tx-1", PeerAddress("10.1.2.3", 5601, 1))


BAD: list[tuple[dict[str, Any], str]] = [
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ({"do_remote_decode": 1}, "do_remote_decode"),
    ({**KVPUSH_D, "transfer_id": ""}, "transfer_id"),
    ({**KVPUSH_D, "transfer_id": 42}, "transfer_id"),
    ({**KVPUSH_D, "transfer_id": "x" * 257}, "transfer_id"),
    ({**KVPUSH_D, "remote_host": ""}, "remote_host"),
    ({**KVPUSH_D, "remote_host": 7}, "remote_host"),
    ({**KVPUSH_D, "remote_port": None}, "remote_port"),
    ({**KVPUSH_D, "remote_port": 0}, "remote_port"),
    ({**KVPUSH_D, "remote_port": "5600"}, "remote_port"),
    ({**KVPUSH_D, "remote_port": True}, "remote_port"),
    ({**KVPUSH_D, "remote_tp_size": 0}, "remote_tp_size"),
    ({**VLLM_PUSH_D, "tp_size": "2"}, "tp_size"),
    ({**KVPUSH_D, "tp_size": 4}, "disagree"),
    ({**VLLM_PUSH_D, "pp_size": 2}, "pp_size"),
    ({k: v for k, v in KVPUSH_D.items() if k not in ("remote_host", "remote_port")}, "remote_host"),
]


@pytest.mark.parametrize(("params", "field"), BAD)
def test_bad_field_is_named(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(params, "req-9")
    assert field in str(info.value) and "req-9" in str(info.value)


def test_not_an_object() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        parse(["do_remote_prefill"], "r")  # type: ignore[arg-type]


def test_sub_request_part_may_not_overflow_the_wire_limit() -> None:
    with pytest.raises(ConfigError, match="too long"):
        parse({"do_remote_decode": True, "transfer_id": "x" * 256}, "cmpl-a-1-deadbeef")


def test_d_reads_the_capability_and_a_bad_one_is_refused_without_echoing_it() -> None:
    cap = "0123456789abcdef" * 2
    role = parse({**KVPUSH_D, "capability": cap}, "r1")
    assert isinstance(role, DecodeSide) and role.capability == cap
    assert cap not in repr(role), "a role logged must not show its capability"
    assert parse(KVPUSH_D, "r1").capability == ""  # none given: P decides (required: refused)
    for bad in ("short-secret-value", 12345, "x" * 64):
        with pytest.raises(ConfigError, match="capability must be a string of 32") as err:
            parse({**KVPUSH_D, "capability": bad}, "r1")
        assert str(bad) not in str(err.value)


def test_ps_answer_carries_the_capability_of_the_shared_id_which_covers_sub_requests() -> None:
    from kvpush.core.capability import derive_key, mint, valid

    key = derive_key(b"s" * 40)
    advert = PrefillAdvert("eng", "10.0.0.7", 5600, 1, key)
    assert "capability_key" not in repr(advert) and repr(key) not in repr(advert)
    role = parse({"do_remote_decode": True, "transfer_id": "shared"}, "cmpl-x-1-0123abcd")
    assert isinstance(role, PrefillSide) and role.transfer_id == "shared/1.0"
    answer = prefill_answer(advert, role, "cmpl-x-1-0123abcd")
    assert answer["transfer_id"] == "shared" and answer["capability"] == mint(key, "shared")
    d_role = parse(answer, "cmpl-y-1-89abcdef")  # the sequential router hands D P's answer
    assert isinstance(d_role, DecodeSide) and d_role.transfer_id == "shared/1.0"
    assert valid(key, d_role.transfer_id, d_role.capability)
    assert "capability" not in prefill_answer(PrefillAdvert("eng", "h", 1), role, "r"), "no key: none given"
