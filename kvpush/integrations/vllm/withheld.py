"""Blocks vLLM must not reuse although the request that held them failed (sans-I/O): the scheduler half's rule.

A P rank D declared dead may only be frozen and still WRITE into the blocks D registered with it, so D
withholds them until that P is fenced (``kvpush.decode.incoming``). The request itself need not wait: its
failed load reaches vLLM at once (``failed_recving``, or its blocks through ``get_block_ids_with_load_errors``)
and vLLM fails it or recomputes it, per ``kv_load_failure_policy``. Either way vLLM then drops its own
reference to those blocks (the request ends, or is rescheduled from scratch into fresh blocks); the scheduler
half keeps one reference of its own on each, taken in the very step vLLM learns of the failure
(``update_connector_output`` runs before vLLM frees them), and drops it once every worker that withheld them
reports its writers fenced. vLLM's block pool counts references, so the blocks stay out of its free queue,
and in its KV-cache usage, exactly that long.

The workers say, per request, that they reported a failure early while withholding its blocks
(``withheld``) and, later, that those blocks are fenced (``released``): one each per worker, summed over the
workers of a step (``KVConnectorWorkerMetadata``). vLLM learns of the load's end when every worker has
reported it (``finished_recving``); by then every worker that withheld has said so, so the blocks are held
when some worker still withholds them (more withheld than released), and given back when the counts meet.
Whether a worker may report early at all is ``reports_early``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def reports_early(failures_by_request: bool, recompute: bool, start_token: int) -> bool:
    """Whether a failed load whose blocks stay withheld may reach vLLM now (else it waits for the fence).

    Yes when vLLM reads failures by request (``failed_recving``): it fails the request, or recomputes it from
    its first token into blocks it allocates anew (its own reference to the old ones dropped). Yes under
    ``fail`` on any vLLM: the request ends. Under ``recompute`` on a vLLM that reads only block ids, vLLM
    rewinds the request to its first failed block and keeps the blocks after it: with no local prefix hit
    (``start_token`` 0) that is the first block, so it frees them all and starts afresh; with one, it would
    recompute into the very blocks the P may still write, so that request waits for the fence instead.
    """
    return failures_by_request or not recompute or start_token == 0


@dataclass
class Withheld:
    """Which D requests' blocks the scheduler half holds for a P that may still write them.

    ``null_block``: vLLM's placeholder id (never held: it is no block of the request).
    """

    null_block: int | None = None
    _blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # registered, load not ended in vLLM
    _held: dict[str, tuple[int, ...]] = field(default_factory=dict)  # held by this half
    _marks: dict[str, list[int]] = field(default_factory=dict)  # request -> [withheld, released] worker reports

    def registered(self, request_id: str, block_ids: Iterable[Iterable[int]]) -> None:
        """D registered these blocks (every group) for a request's load."""
        seen: dict[int, None] = {}
        for group in block_ids:
            for b in group:
                if b != self.null_block:
                    seen.setdefault(int(b), None)
        self._blocks[request_id] = tuple(seen)

    def forget(self, request_id: str) -> None:
        """The request's blocks went back through ``finished_sending`` (an aborted request, fenced): nothing held."""
        self._blocks.pop(request_id, None)
        if request_id not in self._held:
            self._marks.pop(request_id, None)

    def output(
        self,
        finished_recving: Iterable[str],
        withheld: Mapping[str, int],
        released: Mapping[str, int],
    ) -> tuple[list[int], list[int]]:
        """One step's output: (blocks to take a reference on now, blocks to give back now).

        Taken for a request whose load vLLM learns ended in this step while some worker still withholds it;
        given back for a held request once every worker that withheld it released it.
        """
        for rid, n in withheld.items():
            self._marks.setdefault(rid, [0, 0])[0] += n
        for rid, n in released.items():
            self._marks.setdefault(rid, [0, 0])[1] += n
        hold: list[int] = []
        for rid in finished_recving:
            blocks = self._blocks.pop(rid, None)
            if blocks is None:
                continue
            marks = self._marks.get(rid, [0, 0])
            if marks[0] > marks[1]:
                self._held[rid] = blocks
                hold += blocks
            else:
                self._marks.pop(rid, None)
        give: list[int] = []
        for rid in [r for r in self._held if self._marks[r][0] <= self._marks[r][1]]:
            give += self._held.pop(rid)
            del self._marks[rid]
        return hold, give

    def holding(self) -> bool:
        """Some request's blocks are held (the engine must keep stepping to hear them released)."""
        return bool(self._held)

    def held_blocks(self) -> int:
        return sum(len(b) for b in self._held.values())
