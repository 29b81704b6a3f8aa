"""What the connector's scheduler half reads from, and changes in, vLLM's real scheduler objects (every lane).

``scheduled_chunks`` reads this lane's real ``SchedulerOutput``: a resumed request is listed among the cached
ones (``resumed_req_ids``) before vLLM 0.34 and re-sent among the new ones from 0.34 on. ``drop_prompt_tail``
shortens a real ``Request`` built with vLLM's own block hasher, and drops the hashes of the removed tokens where
vLLM can (0.34). ``skips_external_kv`` reads the flag this vLLM sets for a request with prompt logprobs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched import output as so
from vllm.v1.request import Request

from kvpush.integrations.vllm.scheduler_inputs import (
    ScheduledChunk,
    drop_prompt_tail,
    scheduled_chunks,
    skips_external_kv,
)

BS = 16
RESUMED_AMONG_CACHED = "resumed_req_ids" in {f.name for f in dataclasses.fields(so.CachedRequestData)}


def build(cls: type, **known: Any) -> Any:
    """One of vLLM's scheduler dataclasses with ``known`` fields and every other required one empty."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in known:
            kw[f.name] = known[f.name]
        elif f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            t = str(f.type)
            kw[f.name] = next((v for k, v in (("list", []), ("set", set()), ("dict", {})) if t.startswith(k)), None)
    return cls(**kw)


def test_scheduled_chunks_of_new_running_and_resumed_requests() -> None:
    """A new request and a resumed one get all their blocks (``replace``); a running one gets its new blocks
    appended, or none."""
    new = [build(so.NewRequestData, req_id="new", block_ids=([1, 2],), num_computed_tokens=0)]
    cached = dict(req_ids=["run", "idle"], new_block_ids=[([3],), None], num_computed_tokens=[16, 32])
    if RESUMED_AMONG_CACHED:  # before vLLM 0.34: a resumed request is a cached one named in resumed_req_ids
        cached = dict(
            req_ids=["run", "idle", "back"],
            new_block_ids=[([3],), None, ([7, 8],)],
            num_computed_tokens=[16, 32, 0],
            resumed_req_ids={"back"},
        )
    else:  # vLLM 0.34 on: re-sent in full among the new requests
        new.append(build(so.NewRequestData, req_id="back", block_ids=([7, 8],), num_computed_tokens=0))
    out = build(
        so.SchedulerOutput,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=build(so.CachedRequestData, **cached),
        num_scheduled_tokens={"new": 20, "run": 1, "back": 20},
    )
    got = {c.request_id: c for c in scheduled_chunks(out)}
    assert got["new"] == ScheduledChunk("new", ((1, 2),), True, 0, 20)
    assert got["run"] == ScheduledChunk("run", ((3,),), False, 16, 1)
    assert got["idle"] == ScheduledChunk("idle", None, False, 32, 0)
    assert got["back"] == ScheduledChunk("back", ((7, 8),), True, 0, 20)


def _request(tokens: int, **sampling: Any) -> Request:
    """A P request as vLLM builds it, its prompt's full blocks hashed by vLLM's own block hasher."""
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    params = SamplingParams(max_tokens=5, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **sampling)
    hasher = kv_cache_utils.get_request_block_hasher(BS, fn)
    return Request("r", list(range(tokens)), params, None, block_hasher=hasher)


@pytest.mark.parametrize("tokens", [32, 33])
def test_drop_prompt_tail_shortens_a_real_request(tokens: int) -> None:
    """The last prompt token goes from every copy vLLM keeps; the request ends after one token; where vLLM can
    drop block hashes (0.34), the hash of a block the removed token completed goes too."""
    r = _request(tokens)
    assert len(r.block_hashes) == tokens // BS
    drop_prompt_tail(r, 1, BS, 0)
    assert list(r.prompt_token_ids) == list(range(tokens - 1))  # type: ignore[arg-type]
    assert list(r._all_token_ids) == list(range(tokens - 1))
    assert (r.num_prompt_tokens, r.num_tokens, r.max_tokens) == (tokens - 1, tokens - 1, 1)
    if hasattr(r, "truncate_block_hashes"):
        assert len(r.block_hashes) == (tokens - 1) // BS
    else:  # older vLLM keeps them, as its own connector does (prefix caching is off for state models)
        assert len(r.block_hashes) == tokens // BS


def test_drop_prompt_tail_without_a_hash_block_size_keeps_the_hashes() -> None:
    r = _request(32)
    drop_prompt_tail(r, 1)
    assert len(r.block_hashes) == 2


def test_a_request_with_prompt_logprobs_loads_no_external_kv() -> None:
    """vLLM recomputes such a request past its local hit instead of loading it (0.34: ``skip_reading_external_kv``,
    before: ``skip_reading_prefix_cache``), so P keeps its whole prompt."""
    assert skips_external_kv(_request(32, prompt_logprobs=1)) is True
    assert skips_external_kv(_request(32)) is False
