"""``engine.peer_writes.Writes.peer_write``: the prepare hint runs for a part built ahead, not for one built
as it is posted (the copy then does the same work in one step, measured cheaper: docs/benchmarks-log.md §14)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpush.backends.host import HostBackend
from kvpush.engine.peer_writes import Writes


class _Hinted(HostBackend):
    """The host backend, counting ``prepare_peer_copy`` hints."""

    def __init__(self) -> None:
        super().__init__()
        self.hints: list[np.ndarray] = []

    def prepare_peer_copy(self, peer: Any, src_bases: list[int], dst_bases: list[int], pieces: np.ndarray) -> None:
        self.hints.append(pieces)


def test_a_part_built_ahead_is_prepared_one_built_at_its_post_is_not() -> None:
    be = _Hinted()
    writes = Writes("p", agent=None, backend=be, enabled=True)  # type: ignore[arg-type]
    pieces = np.array([[0, 0, 64]], dtype=np.int64)
    copies = [([4096], [8192], pieces)]
    ahead = writes.peer_write(object(), copies, "d", b"n")
    assert [id(p) for p in be.hints] == [id(pieces)] and ahead.state is None
    writes.peer_write(object(), copies, "d", b"n", prepare=False)
    assert len(be.hints) == 1


def test_a_failing_hint_only_leaves_the_work_to_the_post() -> None:
    be = _Hinted()
    be.prepare_peer_copy = lambda *a: (_ for _ in ()).throw(RuntimeError("no"))  # type: ignore[method-assign]
    writes = Writes("p", agent=None, backend=be, enabled=True)  # type: ignore[arg-type]
    w = writes.peer_write(object(), [([0], [0], np.zeros((1, 3), np.int64))], "d", b"n")
    assert w.state is None and w.marker is None
