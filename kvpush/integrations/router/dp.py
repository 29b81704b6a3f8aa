"""Data-parallel engines behind one URL: one router instance per DP rank (pure: no HTTP).

vLLM serves a DP deployment from one API server that fronts ``dp_size``
engines; a request names the engine it wants with the ``X-data-parallel-rank``
header (``vllm/entrypoints``: ``_get_data_parallel_rank``), else vLLM's own
balancer picks one. The router must pick P's engine itself, because D has to
register with *that* engine's KV side channel before P finishes: each DP rank
becomes an ``Instance`` of its own (its own load, its own side-channel port),
and every request to it carries the header.

Side-channel ports of DP rank ``k``, from the base port given for the server:
kvpush's connector listens per TP rank from ``side_channel_port + k * tp_size``
(``kvpush.integrations.vllm.layout.dp_port_offset``); vLLM's NIXL connectors
listen once per engine at ``VLLM_NIXL_SIDE_CHANNEL_PORT + k``, with the engine
id ``<engine_id>_dp<k>``. D's DP ranks need no port (D registers with P); the
header only spreads the load.
"""

from __future__ import annotations

from dataclasses import replace

from kvpush.integrations.router.pool import Instance

DP_RANK_HEADER = "X-data-parallel-rank"


def dp_port(mode: str, base: int, dp_rank: int, tp_size: int) -> int:
    """The KV side-channel port of DP rank ``dp_rank`` of a server whose rank 0 listens at ``base``."""
    if dp_rank < 0:
        raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
    return base + dp_rank * (tp_size if mode == "kvpush" else 1)


def dp_engines(inst: Instance, dp_size: int, mode: str) -> list[Instance]:
    """``inst`` (a server of ``dp_size`` DP engines) as one instance per DP rank; unchanged when ``dp_size`` is 1."""
    if dp_size < 1:
        raise ValueError(f"{inst.name}: the data-parallel size must be >= 1, got {dp_size}")
    if dp_size == 1:
        return [inst]
    out = []
    for k in range(dp_size):
        port = None if inst.kv_port is None else dp_port(mode, inst.kv_port, k, inst.tp_size)
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"{inst.name}: DP rank {k}'s side-channel port {port} is out of range")
        eid = None if inst.engine_id is None else f"{inst.engine_id}_dp{k}"
        out.append(replace(inst, kv_port=port, engine_id=eid, dp_rank=k))
    return out


def dp_headers(inst: Instance) -> dict[str, str]:
    """The header that sends a request to ``inst``'s DP engine (none when vLLM may pick)."""
    return {} if inst.dp_rank is None else {DP_RANK_HEADER: str(inst.dp_rank)}
