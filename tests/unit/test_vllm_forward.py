"""The connector on a vLLM newer than tested: stand-ins for a future vLLM made from this lane's real vLLM classes.

A future vLLM that keeps every hook, field and KV-cache layout kvpush needs starts, saying once that it is newer
than tested; one that removes a hook, changes a signature or chooses a layout kvpush does not know is refused at
start, naming what is missing or changed. Every lane runs this against its own vLLM (``compat.NEEDS`` read from
its real classes, ``KVPushConnector`` built by its real base class).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import vllm
from helpers_logs import kvpush_warnings
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvpush.core.errors import ConfigError
from kvpush.core.surface import read_class, read_params
from kvpush.integrations.vllm import compat
from kvpush.integrations.vllm import connector as connector_module
from kvpush.integrations.vllm.connector import KVPushConnector

FUTURE = "0.99.0"
"""A vLLM newer than any tested."""


@pytest.fixture(autouse=True)
def _forget_the_stand_in_version() -> Any:
    """``compat.detect`` keeps what it read once: a version a test made up must not outlive the test."""
    yield
    compat.detect.cache_clear()
    compat.warn_once.cache_clear()


def surface() -> dict[str, dict[str, Any]]:
    """This lane's vLLM surface, copied so that a test can change it."""
    return {k: dict(v) for k, v in compat.read_surface().items()}


def refusal(s: dict[str, dict[str, Any]], **kw: Any) -> str:
    verdict = compat.check_vllm(FUTURE, s, compat.read_layouts(), **kw)
    assert verdict.warning == "" or verdict.refusal == ""
    return verdict.refusal


def test_the_hooks_kvpush_needs_are_the_connectors_own() -> None:
    """``compat.NEEDS``'s hooks take exactly what ``KVPushConnector``'s overrides take: the table cannot drift from
    the connector (a hook vLLM changes to fit a changed override would pass unnoticed)."""
    hooks = [n for n in compat.NEEDS if n.kind == "hook"]
    assert {n.owner for n in hooks} == {"KVConnectorBase_V1", "SupportsHMA"}
    for need in hooks:
        for name in need.names:
            ours = tuple(p.rstrip("=") for p in read_params(getattr(KVPushConnector, name)))
            assert ours == tuple(p.rstrip("=") for p in need.params), name
            assert name in vars(KVPushConnector), f"KVPushConnector does not override {name}"


def _connector(version: str, monkeypatch: pytest.MonkeyPatch, kv_cache_config: Any = None) -> KVPushConnector:
    """A D connector's scheduler half on this lane's vLLM classes, vLLM saying it is ``version``. kvpush's logging
    is left as the test session has it (a real connector hands kvpush's logger to vLLM's handlers for good)."""
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setattr(connector_module, "share_vllm_logging", lambda: None)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_rank=0),
        kv_transfer_config=SimpleNamespace(
            is_kv_consumer=True, is_kv_producer=False, kv_connector_extra_config={}, engine_id="d"
        ),
        model_config=SimpleNamespace(enable_sleep_mode=False, model="m"),
        cache_config=SimpleNamespace(kv_cache_layout=None),
    )
    return KVPushConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)  # type: ignore[arg-type]


def test_a_newer_vllm_with_every_need_starts_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accepted case runs: the connector starts on "0.99.0" and its scheduler half registers a D request."""
    with kvpush_warnings() as said:
        first = _connector(FUTURE, monkeypatch)
        _connector(FUTURE, monkeypatch)
    warned = [line for line in said if "newer" in line]
    assert len(warned) == 1, warned
    assert "tested with vLLM 0.24 to 0.34; this is vLLM 0.99.0, newer" in warned[0]
    params = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1", "remote_port": 5600}
    request = SimpleNamespace(request_id="r", kv_transfer_params=params, num_prompt_tokens=40)
    assert first.get_num_new_matched_tokens(request, 16) == (24, True)  # type: ignore[arg-type]


def test_a_tested_vllm_starts_without_a_word(monkeypatch: pytest.MonkeyPatch) -> None:
    with kvpush_warnings() as said:
        _connector("0.34.0", monkeypatch)
        _connector(FUTURE, monkeypatch)  # the check would have said it here
    assert [line for line in said if "tested with" in line] == [said[-1]] and FUTURE in said[-1]


def test_a_vllm_older_than_0_24_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.24 and later; this is vLLM 0\.23\.2"):
        _connector("0.23.2", monkeypatch)


@pytest.mark.parametrize(
    ("owner", "name", "named"),
    [
        ("KVConnectorBase_V1", "request_finished", "KVConnectorBase_V1.request_finished is missing"),
        ("KVConnectorBase_V1", "on_new_request", "KVConnectorBase_V1.on_new_request is missing"),
        ("SupportsHMA", "request_finished_all_groups", "SupportsHMA.request_finished_all_groups is missing"),
        ("KVConnectorOutput", "finished_recving", "KVConnectorOutput.finished_recving is missing"),
        ("Request", "num_prompt_tokens", "Request.num_prompt_tokens is missing"),
        ("CachedRequestData", "new_block_ids", "CachedRequestData.new_block_ids is missing"),
        ("KVCacheBlocks", "get_block_ids", "KVCacheBlocks.get_block_ids is missing"),
    ],
)
def test_a_hook_or_field_removed_is_refused_naming_it(owner: str, name: str, named: str) -> None:
    s = surface()
    s[owner].pop(name)
    s[owner].pop("...", None)  # as if vLLM's __init__ source were read: it assigns no such attribute
    assert named in refusal(s)


def test_both_names_of_the_results_hook_removed_is_refused_naming_both() -> None:
    s = surface()
    s["KVConnectorBase_V1"].pop("get_transfer_results", None)
    s["KVConnectorBase_V1"].pop("get_finished", None)
    assert "KVConnectorBase_V1.get_transfer_results (or get_finished) is missing" in refusal(s)


def test_optional_hooks_removed_still_start() -> None:
    """What kvpush detects (``compat.Features``) may be absent: vLLM then never asks, and the connector starts."""
    s = surface()
    for name in ("get_loaded_kv_cache_group_ids", "supports_sleep_mode", "kv_cache_access", "get_transfer_results"):
        s["KVConnectorBase_V1"].pop(name, None)
    s.pop("KVCacheLayout", None)
    verdict = compat.check_vllm(FUTURE, s)
    assert verdict.refusal == "" and "newer" in verdict.warning


def test_a_hook_whose_signature_changed_is_refused_naming_it() -> None:
    """A future vLLM that hands ``request_finished`` one more argument would call kvpush's override wrongly."""

    class FutureBase(base.KVConnectorBase_V1):  # type: ignore[misc]
        def request_finished(self, request: Any, block_ids: Any, finish_reason: Any) -> Any: ...

    s = surface()
    s["KVConnectorBase_V1"] = read_class(FutureBase, instance=True)
    got = refusal(s)
    assert "KVConnectorBase_V1.request_finished changed: it takes (request, block_ids, finish_reason), kvpush's " in got
    assert "takes (request, block_ids)" in got
    assert got.count("changed") == 1  # nothing else of the real class is refused


def test_a_method_kvpush_calls_that_now_needs_more_is_refused_naming_it() -> None:
    s = surface()
    s["KVCacheBlocks"]["get_block_ids"] = ("group_ids", "allow_none=")
    assert "KVCacheBlocks.get_block_ids changed: it needs group_ids, which kvpush does not pass" in refusal(s)


@pytest.mark.parametrize("in_use", ["LBNCH", "LBNHC"])
def test_a_layout_unknown_or_changed_is_refused_naming_it(in_use: str) -> None:
    """vLLM chooses the KV-cache layout before the connector starts (the KV-cache config names it): a layout
    kvpush does not know, or a known name whose axis order changed, is refused; one only offered is not."""
    offered = {**(compat.read_layouts() or {}), "LBNCH": (0, 1, 3, 4, 2)}
    if in_use == "LBNHC":
        offered["LBNHC"] = (0, 1, 2, 3, 4)  # the name kvpush knows, another order
    verdict = compat.check_vllm(FUTURE, surface(), offered, in_use)
    assert f"vLLM's KV-cache layout {in_use} " in verdict.refusal
    assert compat.check_vllm(FUTURE, surface(), offered, "LBHNC").refusal == ""
    assert "LBNCH" in compat.unknown_layouts(offered)


def test_the_connector_reads_the_layout_in_use_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimpleNamespace(kv_cache_layout="LBNCH", kv_cache_groups=[])
    with pytest.raises(ConfigError, match="KV-cache layout LBNCH is none kvpush knows"):
        _connector("0.34.0", monkeypatch, config)
