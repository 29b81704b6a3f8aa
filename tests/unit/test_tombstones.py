"""P's tombstones (``kvpush.prefill.tombstones``) against a model: what is remembered, and what each D rank
is counted for, over every order of burials, unburials and expiries (hypothesis)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpush.core.outcome import Cause
from kvpush.prefill.tombstones import Tombstones

TIDS = [f"t{i}" for i in range(6)]
RANKS = [("d", 0), ("d", 1), ("e", 0), None]
LIMIT = 4


class TombstoneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = Tombstones(LIMIT)
        self.model: dict[str, tuple[float, tuple[str, int] | None]] = {}  # insertion order: the oldest first

    @rule(tid=st.sampled_from(TIDS), until=st.sampled_from([1.0, 2.0, 5.0]), by=st.sampled_from(RANKS))
    def bury(self, tid: str, until: float, by: tuple[str, int] | None) -> None:
        self.t.bury(tid, until, by, Cause.ABORTED)
        kept = self.model.pop(tid, None)
        self.model[tid] = (until, kept[1] if kept is not None else by)  # a second burial keeps its rank
        while len(self.model) > LIMIT:
            del self.model[next(iter(self.model))]

    @rule(tid=st.sampled_from(TIDS))
    def unbury(self, tid: str) -> None:
        self.t.unbury(tid)
        self.model.pop(tid, None)

    @rule(now=st.sampled_from([0.5, 1.0, 3.0, 6.0]))
    def expire(self, now: float) -> None:
        self.t.expire(now)
        self.model = {k: v for k, v in self.model.items() if v[0] > now}

    @invariant()
    def remembers_what_the_model_does(self) -> None:
        assert len(self.t) == len(self.model) <= LIMIT
        assert all((tid in self.t) == (tid in self.model) for tid in TIDS)

    @invariant()
    def counts_each_rank_exactly(self) -> None:
        for by in RANKS[:-1]:
            assert self.t.left_by(by) == sum(1 for _, b in self.model.values() if b == by), by


TestTombstones = TombstoneMachine.TestCase
TestTombstones.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
