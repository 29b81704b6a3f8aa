"""The Triton gather/scatter kernel: one launch copies every piece of every region.

Kept in its own module because importing it imports Triton, which the rest
of the backend must not do at import time.
"""

from __future__ import annotations

import triton
import triton.language as tl


# No specialization on the tables' alignment or the integers' values: a part of a push passes a view into
# an uploaded bases array (8-byte aligned only) and other offsets, and each new specialization would be a
# compile on the critical path; alignment that matters for speed is ALIGN16, a constexpr.
@triton.jit(
    do_not_specialize=["s_first", "s_step", "d_first", "d_step", "M"],
    do_not_specialize_on_alignment=["sbase_ptr", "dbase_ptr", "table_ptr"],
)
def copy_pieces_kernel(
    sbase_ptr,
    s_first,
    s_step,
    dbase_ptr,
    d_first,
    d_step,
    table_ptr,
    M,
    S_ARRAY: tl.constexpr,
    D_ARRAY: tl.constexpr,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN16: tl.constexpr,
):
    """Program (p, r) copies tile p of region r: ``len[p]`` bytes, ``sbase[r] + soff[p]`` -> ``dbase[r] + doff[p]``.

    ``table`` is ``[soff; doff; len]`` (int64, ``3 * M``, bytes), every tile at
    most ``BLOCK * W`` bytes and every address and length a multiple of ``W``,
    the width of one load. A side's region bases are either an array
    (``*_ARRAY``: KV regions, separate allocations) or ``first + r * step`` (a
    staging buffer), so a staging side needs no upload. Addresses are raw
    integers turned into pointers because no single tensor covers the regions.
    """
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    if S_ARRAY:  # noqa: SIM108 (constexpr branch: only one side is compiled)
        sb = tl.load(sbase_ptr + r)
    else:
        sb = s_first + r * s_step
    if D_ARRAY:  # noqa: SIM108
        db = tl.load(dbase_ptr + r)
    else:
        db = d_first + r * d_step
    s = sb + tl.load(table_ptr + p)
    d = db + tl.load(table_ptr + M + p)
    n = tl.load(table_ptr + 2 * M + p) // W
    if ALIGN16:
        s = tl.multiple_of(s, 16)
        d = tl.multiple_of(d, 16)
    if W == 8:
        sp = s.to(tl.pointer_type(tl.int64))
        dp = d.to(tl.pointer_type(tl.int64))
    elif W == 4:
        sp = s.to(tl.pointer_type(tl.int32))
        dp = d.to(tl.pointer_type(tl.int32))
    elif W == 2:
        sp = s.to(tl.pointer_type(tl.int16))
        dp = d.to(tl.pointer_type(tl.int16))
    else:
        sp = s.to(tl.pointer_type(tl.int8))
        dp = d.to(tl.pointer_type(tl.int8))
    idx = tl.arange(0, BLOCK)
    mask = idx < n
    tl.store(dp + idx, tl.load(sp + idx, mask=mask), mask=mask)
