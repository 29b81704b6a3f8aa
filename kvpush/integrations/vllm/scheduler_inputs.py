"""What the scheduler half reads from vLLM's scheduler objects, and the one change it makes to a request.

Rule: ``scheduler_side.SchedulerSide`` takes plain values only; vLLM's
``SchedulerOutput`` and ``Request`` are read (``scheduled_chunks``) or
changed (``drop_prompt_tail``) here, by attribute, at the hook that gets
them. Reason: the scheduler's bookkeeping stays testable without an engine,
and every read of vLLM's scheduler structures is in one place when they
change between versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's part of a scheduler step, as read from vLLM's ``SchedulerOutput``.

    ``block_ids`` are the request's new blocks (appended to what it had) or,
    when ``replace``, all of them (a new or resumed request).
    """

    request_id: str
    block_ids: tuple[tuple[int, ...], ...] | None
    replace: bool
    num_computed: int
    num_scheduled: int


def scheduled_chunks(out: SchedulerOutput) -> list[ScheduledChunk]:
    """The step's scheduled requests as plain values (new, resumed and running ones).

    A resumed request (preempted, scheduled again) gets all its blocks anew:
    vLLM before 0.34 lists it among the cached requests, named in
    ``resumed_req_ids``; vLLM 0.34 re-sends it in full among the new ones and
    its cached requests have no ``resumed_req_ids`` (their blocks are always
    appended).
    """
    n = out.num_scheduled_tokens
    chunks = [
        ScheduledChunk(r.req_id, tuple(tuple(g) for g in r.block_ids), True, r.num_computed_tokens, n.get(r.req_id, 0))
        for r in out.scheduled_new_reqs
    ]
    c = out.scheduled_cached_reqs
    resumed = getattr(c, "resumed_req_ids", ())
    for i, rid in enumerate(c.req_ids):
        new = c.new_block_ids[i]
        blocks = None if new is None else tuple(tuple(g) for g in new)
        chunks.append(ScheduledChunk(rid, blocks, rid in resumed, c.num_computed_tokens[i], n.get(rid, 0)))
    return chunks


def skips_external_kv(request: Request) -> bool:
    """Whether vLLM loads no connector KV for this request (it computes past its local prefix hit itself), so P
    must keep its whole prompt: vLLM 0.34's ``skip_reading_external_kv`` (a request whose prefix-cache hits are
    bounded: prompt logprobs), before it ``skip_reading_prefix_cache``."""
    if hasattr(request, "skip_reading_external_kv"):
        return bool(request.skip_reading_external_kv)
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def drop_prompt_tail(
    request: Request, drop: int, hash_block_size: int | None = None, hash_lookahead_tokens: int = 0
) -> None:
    """Remove the last ``drop`` prompt tokens of a request vLLM has not scheduled yet (``core.recurrent``'s backoff).

    The request then ends after one token (its answer is computed from the
    shorter prompt; routers discard it). Prompt embeddings are shortened alike.
    Where vLLM can drop the block hashes of removed tokens (0.34's
    ``truncate_block_hashes``, with the KV-cache config's ``hash_block_size``)
    they go too, as vLLM's own connector does: a hash of the full prompt's
    last block no longer describes the request's tokens.
    """
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-drop:]
    elif request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:-drop]
    del request._all_token_ids[-drop:]
    request.num_prompt_tokens -= drop
    request.max_tokens = 1
    truncate = getattr(request, "truncate_block_hashes", None)
    if truncate is not None and hash_block_size:
        truncate(hash_block_size, hash_lookahead_tokens)
