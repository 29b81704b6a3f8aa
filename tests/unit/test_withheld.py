"""The scheduler half's withheld blocks (``kvpush.integrations.vllm.withheld``), over every interleaving.

The machine plays vLLM's block pool and aggregator around a real ``Withheld``: D registers requests, each of
W workers ends each load its own way (pushed, failed fenced, or failed while a P it declared dead may still
write: then reported early and fenced later), vLLM learns a load ended once every worker reported it
(``finished_recving``) and then drops its own reference to the request's blocks (the request fails, or is
recomputed into fresh blocks), and the workers' metadata of a step reaches the scheduler half summed. The
invariant: **a block a writer may still reach is never in the free queue** (while some worker withholds a
request's blocks and vLLM dropped its reference, the half holds one), the half holds nothing once every
worker released it, and no reference is taken or given back twice.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpush.integrations.vllm.withheld import Withheld, reports_early

WORKERS = 2
NULL = 0


class WithheldMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = Withheld(null_block=NULL)
        self.refs: dict[int, int] = {}  # block -> references vLLM's pool counts
        self.blocks: dict[str, tuple[int, ...]] = {}  # request -> its blocks
        self.reported: dict[str, set[int]] = {}  # request -> workers that reported its load's end
        self.unfenced: dict[str, set[int]] = {}  # request -> workers whose writers may still write its blocks
        self.pending: dict[str, set[int]] = {}  # request -> workers whose fenced Result is still to come
        self.vllm_done: set[str] = set()  # vLLM learned the load ended and dropped its own reference
        self.meta: list[tuple[int, str, str]] = []  # (worker, "withheld"|"released", request), not yet delivered
        self.out: list[tuple[int, str]] = []  # (worker, request) finished_recving reports not yet aggregated
        self.next_block = 1
        self.n = 0

    # -- D and vLLM ---------------------------------------------------------------------
    @rule(size=st.integers(1, 3), groups=st.integers(1, 2))
    def register(self, size: int, groups: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        ids = [[NULL] + [self.next_block + g * size + i for i in range(size)] for g in range(groups)]
        self.next_block += size * groups
        flat = tuple(b for g in ids for b in g if b != NULL)
        for b in flat:
            self.refs[b] = 1  # vLLM's own reference
        self.blocks[rid] = flat
        self.reported[rid] = set()
        self.unfenced[rid] = set()
        self.pending[rid] = set()
        self.w.registered(rid, ids)

    def _open(self) -> list[tuple[str, int]]:
        return [(r, k) for r in self.blocks for k in range(WORKERS) if k not in self.reported[r]]

    @precondition(lambda self: self._open())
    @rule(data=st.data(), how=st.sampled_from(["pushed", "failed", "withheld"]))
    def worker_ends_a_load(self, data: st.DataObject, how: str) -> None:
        """One worker's load ends: pushed, failed fenced, or failed early while its writer may still write."""
        rid, k = data.draw(st.sampled_from(self._open()))
        self.reported[rid].add(k)
        self.out.append((k, rid))
        if how == "withheld":
            self.unfenced[rid].add(k)
            self.pending[rid].add(k)
            self.meta.append((k, "withheld", rid))

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def writer_fenced(self, data: st.DataObject) -> None:
        """A worker's writer is fenced (its P answered again, or the operator fenced it): it says so next step."""
        rid, k = data.draw(st.sampled_from([(r, k) for r, ks in self.pending.items() for k in sorted(ks)]))
        self.pending[rid].discard(k)
        self.unfenced[rid].discard(k)
        self.meta.append((k, "released", rid))

    @precondition(lambda self: self.out or self.meta)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One step's outputs reach the scheduler: some workers' reports (in order per worker), summed."""
        ks = data.draw(st.sets(st.integers(0, WORKERS - 1), min_size=1))
        withheld: dict[str, int] = {}
        released: dict[str, int] = {}
        for _, what, rid in [m for m in self.meta if m[0] in ks]:
            d = withheld if what == "withheld" else released
            d[rid] = d.get(rid, 0) + 1
        self.meta = [m for m in self.meta if m[0] not in ks]
        delivered = [(k, r) for k, r in self.out if k in ks]
        self.out = [(k, r) for k, r in self.out if k not in ks]
        counts: dict[str, int] = {}
        for _, r in delivered:
            counts[r] = counts.get(r, 0) + 1
        finished = {
            r for r in counts if len(self.reported[r]) == WORKERS and not any(rr == r for _, rr in self.out)
        } - self.vllm_done
        hold, give = self.w.output(sorted(finished), withheld, released)
        assert len(hold) == len(set(hold)) and len(give) == len(set(give))
        for b in hold:
            self.refs[b] += 1
        for r in finished:  # vLLM fails the request or frees it to recompute afresh: its own reference goes
            self.vllm_done.add(r)
            for b in self.blocks[r]:
                self.refs[b] -= 1
        for b in give:
            self.refs[b] -= 1
            assert self.refs[b] >= 0, f"block {b} given back twice"

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def reachable_blocks_stay_out(self) -> None:
        for r, ks in self.unfenced.items():
            if ks and r in self.vllm_done:
                assert all(self.refs[b] >= 1 for b in self.blocks[r]), f"{r}'s blocks freed while a writer may write"
        assert all(n >= 0 for n in self.refs.values())

    def teardown(self) -> None:
        """Every load ends, every writer is fenced, every report arrives: nothing stays held."""
        for rid, k in self._open():
            self.reported[rid].add(k)
            self.out.append((k, rid))
        for rid, ks in self.pending.items():
            for k in sorted(ks):
                self.meta.append((k, "released", rid))
            ks.clear()
            self.unfenced[rid].clear()
        while self.out or self.meta:
            self.step(_All())
        assert not self.w.holding() and self.w.held_blocks() == 0
        assert all(n == 0 for n in self.refs.values()), self.refs


class _All:
    def draw(self, strategy: object) -> object:
        return set(range(WORKERS))


WithheldMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_withheld_state_machine = WithheldMachine.TestCase


@given(by_request=st.booleans(), recompute=st.booleans(), start=st.integers(0, 64))
def test_early_only_where_vllm_cannot_recompute_into_the_withheld_blocks(
    by_request: bool, recompute: bool, start: int
) -> None:
    """vLLM that reads only block ids rewinds a request to its first failed block and keeps the ones after it:
    under recompute with a local prefix hit that would recompute into the withheld blocks, so only that waits."""
    waits = not by_request and recompute and start > 0
    assert reports_early(by_request, recompute, start) is not waits


def test_a_block_is_held_once_and_given_back_when_every_worker_released_it() -> None:
    w = Withheld(null_block=0)
    w.registered("r", [[0, 5, 6], [7]])
    assert w.output([], {"r": 1}, {}) == ([], [])
    assert w.output(["r"], {"r": 1}, {}) == ([5, 6, 7], [])  # the second worker withholds too
    assert w.holding() and w.held_blocks() == 3
    assert w.output([], {}, {"r": 1}) == ([], [])
    assert w.output([], {}, {"r": 1}) == ([], [5, 6, 7])
    assert not w.holding()
    w.registered("s", [[8]])
    assert w.output(["s"], {}, {}) == ([], [])  # pushed: nothing to hold
    w.registered("t", [[9]])
    assert w.output(["t"], {"t": 1}, {"t": 1}) == ([], [])  # fenced by the time vLLM hears of it
    assert not w.holding()
