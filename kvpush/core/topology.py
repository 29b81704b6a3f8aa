"""Which P rank writes to which D rank when TP degrees differ (pure).

Heads are split as vLLM splits them: rank r of a TP group of size t holds
``max(1, H // t)`` heads starting at ``r * H // t``; when ``t > H`` each head
is replicated on ``t // H`` consecutive ranks. Each D rank takes each of its heads from exactly one P
rank, so replicated P ranks share the work deterministically and both sides
compute the same answer without asking each other.
"""

from __future__ import annotations

import functools

ConnKey = tuple[str, int]
"""A P rank's side channel, (host, port): what D keys its link to that rank by (rank r of a P instance
listens on the instance's port + r)."""


def head_range(rank: int, tp: int, num_heads: int) -> tuple[int, int]:
    local = max(1, num_heads // tp)
    start = rank * num_heads // tp
    return start, start + local


def writers_for(d_rank: int, d_tp: int, p_tp: int, num_heads: int) -> list[int]:
    """P ranks that write into D rank ``d_rank``."""
    return list(_writers(d_rank, d_tp, p_tp, num_heads))


def targets_for(p_rank: int, p_tp: int, d_tp: int, num_heads: int) -> list[int]:
    """D ranks that P rank ``p_rank`` writes into."""
    return list(_targets(p_rank, p_tp, d_tp, num_heads))


@functools.lru_cache(maxsize=4096)
def _writers(d_rank: int, d_tp: int, p_tp: int, num_heads: int) -> tuple[int, ...]:
    """``writers_for``, remembered: P asks it on every registration (tens of microseconds at TP 8), and
    its inputs are a handful of small integers per deployment."""
    dlo, dhi = head_range(d_rank, d_tp, num_heads)
    groups: dict[tuple[int, int], list[int]] = {}
    for p in range(p_tp):
        lo, hi = head_range(p, p_tp, num_heads)
        if max(lo, dlo) < min(hi, dhi):
            groups.setdefault((lo, hi), []).append(p)
    return tuple(sorted(ranks[d_rank % len(ranks)] for ranks in groups.values()))


@functools.lru_cache(maxsize=4096)
def _targets(p_rank: int, p_tp: int, d_tp: int, num_heads: int) -> tuple[int, ...]:
    """``targets_for``, remembered (see ``_writers``)."""
    return tuple(d for d in range(d_tp) if p_rank in _writers(d, d_tp, p_tp, num_heads))


def writer_channels(host: str, port: int, p_tp: int, d_rank: int, d_tp: int, num_heads: int) -> dict[int, ConnKey]:
    """The P ranks that write into D rank ``d_rank`` and their side channels (rank r listens on ``port + r``)."""
    return {p: (host, port + p) for p in writers_for(d_rank, d_tp, p_tp, num_heads)}


def bystander_channels(host: str, port: int, p_tp: int, d_tp: int, num_heads: int) -> dict[int, ConnKey]:
    """The P ranks that write into no D rank (they hold replicated KV other P ranks write) and their side
    channels: D tells them at once that their copy is not needed, so each frees its prefill without a lease."""
    idle = [p for p in range(p_tp) if not targets_for(p, p_tp, d_tp, num_heads)]
    return {p: (host, port + p) for p in idle}
