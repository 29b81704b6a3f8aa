"""Turning many small device reads into a few large ones (pure).

Every ``nrt_tensor_read`` is a DMA with a fixed cost, and a request's pieces
can number one per token and head (NxDI's head-major slots mapped onto a
token-major paged layout). Reading is side-effect free, so pieces closer than
``gap`` bytes are read as one run, gaps included, into a host scratch buffer
and gathered from there on the host. Writes never do this: writing a gap
back would overwrite device bytes that other requests own.
"""

from __future__ import annotations

import numpy as np

DEFAULT_GAP = 256 << 10


def read_runs(pieces: np.ndarray, gap: int = DEFAULT_GAP) -> tuple[np.ndarray, np.ndarray]:
    """Runs to read and the pieces re-addressed into the scratch buffer the runs fill.

    ``pieces`` is ``(n, 2)`` (offset, length). Returns ``runs`` ``(m, 3)``
    (offset, length, scratch position), sorted, disjoint, covering every
    piece; and ``remapped`` ``(n, 2)``, each piece's offset in the scratch
    buffer (same order and lengths as ``pieces``).
    """
    offs = pieces[:, 0].astype(np.int64)
    ends = offs + pieces[:, 1].astype(np.int64)
    order = np.argsort(offs, kind="stable")
    s, e = offs[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.concatenate(([True], s[1:] > reach[:-1] + gap))
    run_id_sorted = np.cumsum(new) - 1
    run_start = s[new]
    run_end = np.maximum.reduceat(e, np.flatnonzero(new))
    run_len = run_end - run_start
    run_pos = np.concatenate(([0], np.cumsum(run_len)[:-1]))
    run_id = np.empty_like(run_id_sorted)
    run_id[order] = run_id_sorted
    remapped = np.stack([run_pos[run_id] + offs - run_start[run_id], pieces[:, 1]], axis=1).astype(np.int64)
    return np.stack([run_start, run_len, run_pos], axis=1), remapped
