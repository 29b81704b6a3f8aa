"""What a registration frame asks for, read from its headers before it is decoded (pure).

Decoding a frame of block ids is the expensive part of receiving one (a
Python-visible array per group), so a receiver first reads how many ids each
group lists from the msgpack headers alone and checks them against what the
peer may make it hold (``engine/peers.py``, ``core/limits.py``): a flood of
large registrations then costs the peer, not the receiver.
"""

from __future__ import annotations

import msgspec

from kvpush.core.protocol import MAX_GROUPS, WIRE_BLOCK_ID


class _RegisterHead(msgspec.Struct, frozen=True, tag_field="type", tag="register"):
    """A registration's block ids left undecoded; every other field is skipped without being built."""

    block_ids: msgspec.Raw


class _HeadFrame(msgspec.Struct, array_like=True, frozen=True):
    version: int
    msg: _RegisterHead


_head_decoder = msgspec.msgpack.Decoder(_HeadFrame)
_groups_decoder = msgspec.msgpack.Decoder(tuple[msgspec.Raw, ...])


def block_id_counts(data: bytes | memoryview) -> tuple[int, ...] | None:
    """How many block ids each group of a registration frame lists, read from the headers without
    decoding the ids (None: not a registration, or not readable that way; ``decode`` then says why).
    More groups than ``MAX_GROUPS``: only the first ``MAX_GROUPS + 1`` counts (the frame is refused anyway).

    A receiver checks the counts against what the peer can hold before it decodes the frame: what a
    registration may make P hold is bounded by the peer's blocks, not only by the frame's size.
    """
    try:
        raw = _head_decoder.decode(data).msg.block_ids
        outer = _array_length(memoryview(raw)[:5].tobytes())
        if outer > MAX_GROUPS:
            return (0,) * (MAX_GROUPS + 1)
        groups = _groups_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    return tuple(_bin_length(memoryview(g)[:5].tobytes()) // WIRE_BLOCK_ID.itemsize for g in groups)


def _bin_length(head: bytes) -> int:
    """The length in a msgpack bin header (-1 if it is not a bin)."""
    if len(head) >= 2 and head[0] == 0xC4:
        return head[1]
    if len(head) >= 3 and head[0] == 0xC5:
        return int.from_bytes(head[1:3], "big")
    if len(head) >= 5 and head[0] == 0xC6:
        return int.from_bytes(head[1:5], "big")
    return -WIRE_BLOCK_ID.itemsize


def _array_length(head: bytes) -> int:
    """The length in a msgpack array header (-1 if it is not an array)."""
    if not head:
        return -1
    b = head[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(head) >= 3:
        return int.from_bytes(head[1:3], "big")
    if b == 0xDD and len(head) >= 5:
        return int.from_bytes(head[1:5], "big")
    return -1
