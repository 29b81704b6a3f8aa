"""Wire protocol: every message survives a round trip, and every bad frame is a ``ProtocolError`` that says why.

``decode`` runs on bytes from the network (side channel) and from NIXL
notifications; anything it lets through or crashes on turns a bad peer into a
dead engine thread, so the error type and message are part of the contract.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush import PROTOCOL_VERSION
from kvpush.core import peek, protocol
from kvpush.core.errors import ProtocolError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.core.outcome import Cause, PlanKind, PrefillState, Stage
from kvpush.core.protocol import (
    MAX_BLOCKS,
    MAX_FRAME_BYTES,
    MAX_GROUPS,
    OLDEST_PROTOCOL_VERSION,
    Abort,
    Ack,
    Completion,
    Credit,
    Failure,
    Features,
    Heartbeat,
    Hello,
    HelloReply,
    Posting,
    Register,
    StagingGrant,
    TimeQuery,
    TimeReply,
    decode,
    encode,
)

LAYOUT = KVLayout(
    block_size=16,
    num_blocks=128,
    block_stride=4096,
    head_bytes=256,
    num_heads=8,
    head_start=0,
    local_heads=1,
    order=TokenOrder.HND,
    mem=MemKind.DRAM,
    dtype="bfloat16",
    regions=(Region(base=1 << 30, size=128 * 4096, device_id=0), Region(base=(1 << 30) + (1 << 20), size=128 * 4096)),
)

REGISTER = Register(
    transfer_id="xfer-1",
    request_id="req-1",
    engine_id="decode-a",
    rank=1,
    block_ids=((3, 1, 4, (1 << 32) - 1), (5,)),
    num_tokens=37,
    start_token=16,
    lease_ms=5000,
    staging=StagingGrant(offset=4096, size=1 << 20),
    attempt=2,
)

MESSAGES = [
    Hello(
        engine_id="decode-a",
        rank=3,
        tp_size=4,
        agent_name="agent-d3",
        agent_metadata=bytes(range(256)),
        layout=LAYOUT,
        model="llama-3-8b",
        staging=Region(base=1 << 32, size=64 << 20, device_id=1, group=0),
    ),
    Hello(engine_id="d", rank=0, tp_size=1, agent_name="a", agent_metadata=b"", layout=LAYOUT, model=""),
    HelloReply(
        ok=True, engine_id="prefill-a", rank=0, tp_size=2, agent_name="p0", agent_metadata=b"\x00", layout=LAYOUT
    ),
    HelloReply(ok=False, reason="model differs: P serves x, D serves y"),
    REGISTER,
    Register(transfer_id="t", request_id="r", engine_id="e", rank=0, block_ids=((),), num_tokens=0),
    Completion(
        transfer_id="t",
        request_id="r",
        rank=7,
        plan=PlanKind.STAGED,
        nbytes=1 << 33,
        descriptors=12,
        staging=StagingGrant(0, 8),
        attempt=1,
        region_start=4,
        region_end=8,
    ),
    Completion(transfer_id="t", request_id="r", rank=0),
    Failure(
        transfer_id="t",
        request_id="",
        rank=2,
        stage=Stage.WRITE,
        cause=Cause.WRITE_ERROR,
        reason="peer gone",
        attempt=3,
    ),
    Abort(transfer_id="t", request_id="r", reason="client disconnected"),
    Heartbeat(engine_id="e", rank=0, seq=2**40, sent_at=1712345678.25),
]
# Kept apart so that the fixed indices into MESSAGES used below stay valid.
MORE_MESSAGES = [
    TimeQuery(seq=3, sent_at=1712345678.5),
    TimeReply(seq=3, sent_at=1712345678.5, now=1712345679.125),
    # Kept out of MESSAGES, whose indices the tests below use.
    Posting(transfer_id="xfer-1", rank=2, attempt=1),
    Ack(transfer_id="xfer-1", rank=1, state=PrefillState.QUEUED, attempt=2, tokens_ahead=4096),
    Features(version=12, rank=1, epoch=3),
    Credit(transfer_id="xfer-1", attempt=2, parts=17),
]

SEALS_MESSAGES = [
    # The seals' messages (v13), kept apart like their definitions in ``kvpush.core.protocol``.
    protocol.LinkKey(key=bytes(range(32)), epoch=3),
    protocol.SealsChecked(epoch=3),
    protocol.Sealed(epoch=3, seq=(1 << 63) - 1, mac=bytes(16), body=b"\x92\x0b\x81\xa4type\xa2hb"),
]
ALL_MESSAGES = MESSAGES + MORE_MESSAGES + SEALS_MESSAGES


def _raw(msg) -> dict:
    """A message as a plain dict as it is on the wire (with its ``type`` tag), to build hostile frames from."""
    return msgspec.msgpack.decode(encode(msg))[1]


def _ids(*ids: int) -> bytes:
    """Block ids as the wire carries them."""
    return np.array(ids, "<u4").tobytes()


def _frame(body, version=PROTOCOL_VERSION) -> bytes:
    return msgspec.msgpack.encode([version, body])


def _err(data, expected=None) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data, expected=expected)
    return str(info.value)


# -- round trips -----------------------------------------------------------------


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    data = encode(msg)
    got = decode(data)
    assert type(got) is type(msg)
    assert _plain(got) == _plain(msg)
    assert _plain(decode(memoryview(data), expected=type(msg))) == _plain(msg)
    assert _plain(decode(bytearray(data), expected=(Abort, type(msg)))) == _plain(msg)


def _plain(msg):
    """``msg`` comparable with ``==``: a Register's block ids (arrays once decoded) as tuples of ints."""
    if isinstance(msg, Register):
        return msgspec.structs.replace(msg, block_ids=tuple(tuple(int(b) for b in g) for g in msg.block_ids))
    return msg


def test_block_ids_travel_as_uint32_bytes_and_decode_as_int64_arrays() -> None:
    """Four bytes per id on the wire, whatever the id; decoded, one int64 array per group (no Python ints)."""
    got = decode(encode(REGISTER))
    assert all(isinstance(g, np.ndarray) and g.dtype == np.int64 for g in got.block_ids)
    assert [g.tolist() for g in got.block_ids] == [[3, 1, 4, (1 << 32) - 1], [5]]
    assert msgspec.msgpack.decode(encode(REGISTER))[1]["block_ids"] == [
        np.array([3, 1, 4, (1 << 32) - 1], "<u4").tobytes(),
        np.array([5], "<u4").tobytes(),
    ]
    arrays = msgspec.structs.replace(REGISTER, block_ids=tuple(np.asarray(g) for g in REGISTER.block_ids))
    assert encode(arrays) == encode(REGISTER)


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        ((1, -1), ["block_ids[0]", "block id -1 outside [0, 4294967295]"]),
        ((1 << 32,), ["block_ids[0]", f"block id {1 << 32} outside"]),
        (("a",), ["block_ids[0]", "must be integers"]),
        (np.zeros((2, 2), np.int64), ["block_ids[0]", "flat sequence"]),
        (np.array([-5]), ["block_ids[0]", "block id -5 outside"]),
    ],
)
def test_encode_refuses_block_ids_the_wire_cannot_carry(ids, words: list[str]) -> None:
    """A bad id fails on the sender, naming it, instead of wrapping around into another block's id."""
    with pytest.raises(ValueError) as info:
        encode(msgspec.structs.replace(REGISTER, block_ids=(ids,)))
    for w in words:
        assert w in str(info.value), info.value


def test_round_trip_keeps_enum_types() -> None:
    """A decoded layout's order is the enum again, so layout code can compare it."""
    got = decode(encode(MESSAGES[0]))
    assert got.layout.order is TokenOrder.HND
    assert got.layout.mem is MemKind.DRAM
    assert isinstance(got.layout.regions, tuple)
    assert isinstance(got.layout.regions[0], Region)


def test_every_message_type_is_covered() -> None:
    """A new message type must get a round-trip case here."""
    from kvpush.core.protocol import Message

    assert {type(m) for m in ALL_MESSAGES} == set(Message.__args__)


def test_frame_is_version_then_message() -> None:
    raw = msgspec.msgpack.decode(encode(MESSAGES[-1]))
    assert raw[0] == OLDEST_PROTOCOL_VERSION  # a heartbeat is the same in every version: the oldest says it
    assert raw[1]["type"] == "hb"


def test_a_frame_carries_the_lowest_version_that_holds_it() -> None:
    """A message of the previous version's shape goes as that version, without the fields it lacks, so a peer
    on it reads it; what rounds brought (its messages, a ring grant, a part in rounds) goes as the newer one."""
    plain = Register(
        transfer_id="t",
        request_id="r",
        engine_id="e",
        rank=0,
        block_ids=([1, 2],),
        num_tokens=3,
        staging=StagingGrant(offset=4096, size=8192),
    )
    ring = msgspec.structs.replace(plain, staging=StagingGrant(offset=4096, size=8192, part_bytes=4096, slots=2))
    done = Completion(transfer_id="t", request_id="r", rank=0, plan=PlanKind.STAGED, staging=plain.staging)
    part = Completion(transfer_id="t", request_id="r", rank=0, plan=PlanKind.ROUNDS, staging=ring.staging, part=3)
    old = [plain, done, *MESSAGES, MORE_MESSAGES[0], MORE_MESSAGES[1], MORE_MESSAGES[2], MORE_MESSAGES[3]]
    for msg in old:
        raw = msgspec.msgpack.decode(encode(msg))
        assert raw[0] == OLDEST_PROTOCOL_VERSION, msg
        assert not {"part_bytes", "slots", "part"} & set(raw[1]) & set((raw[1].get("staging") or {}) | raw[1]), msg
    for msg in (ring, part, *MORE_MESSAGES[4:]):
        assert msgspec.msgpack.decode(encode(msg))[0] == protocol.ROUNDS_VERSION, msg
        assert encode(decode(encode(msg))) == encode(msg)
    for msg in SEALS_MESSAGES:
        assert msgspec.msgpack.decode(encode(msg))[0] == protocol.SEALS_VERSION == PROTOCOL_VERSION, msg
    assert encode(decode(_frame(_raw(plain), version=OLDEST_PROTOCOL_VERSION))) == encode(plain)


# -- malformed frames --------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", ["malformed", "truncated"]),
        (b"\xc1", ["malformed"]),
        (b"\x93\x01", ["malformed", "truncated"]),
        (msgspec.msgpack.encode({"version": 1}), ["malformed", "array"]),
        (msgspec.msgpack.encode([PROTOCOL_VERSION]), ["malformed", "length"]),
        (msgspec.msgpack.encode(["1", _raw(MESSAGES[-1])]), ["malformed", "int"]),
        (msgspec.msgpack.encode([PROTOCOL_VERSION, "hello"]), ["malformed", "object"]),
        (_frame({"type": "nope", "x": 1}), ["malformed", "nope", "type"]),
        (_frame({"transfer_id": "t", "request_id": "r", "reason": "x"}), ["malformed", "type"]),
        (_frame({**_raw(MESSAGES[-2]), "colour": "red"}), ["malformed", "unknown field", "colour"]),
        (_frame({**_raw(MESSAGES[-2]), "reason": 5}), ["malformed", "str", "reason"]),
        (_frame({k: v for k, v in _raw(MESSAGES[-2]).items() if k != "reason"}), ["malformed", "reason"]),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_malformed(data: bytes, words: list[str]) -> None:
    msg = _err(data)
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_a_protocol_error(msg) -> None:
    """A frame cut anywhere (a lost tail of a notification) is reported, never half-decoded."""
    data = encode(msg)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


def test_trailing_bytes_rejected() -> None:
    data = encode(MESSAGES[-1])
    assert "malformed" in _err(data + b"\x00")


def test_extra_frame_element_rejected() -> None:
    """``[version, message, junk]`` is not a frame; accepting it would hide a framing bug in the sender."""
    msg = _err(msgspec.msgpack.encode([PROTOCOL_VERSION, _raw(MESSAGES[-1]), "junk"]))
    assert "malformed" in msg


@pytest.mark.parametrize("body", [_raw(MESSAGES[-1]), {"type": "from-the-future", "x": [1, 2]}, "garbage"])
def test_wrong_version_named(body) -> None:
    """A v2 peer gets told so even when the v2 body means nothing to v1."""
    msg = _err(_frame(body, version=PROTOCOL_VERSION + 1))
    assert "version mismatch" in msg
    assert f"v{PROTOCOL_VERSION + 1}" in msg and f"v{PROTOCOL_VERSION}" in msg


def test_version_zero_named() -> None:
    assert "peer speaks v0" in _err(_frame(_raw(MESSAGES[-1]), version=0))


def test_oversized_frame() -> None:
    """Rejected before parsing: the size check must not cost a decode of 8 MiB of junk."""
    msg = _err(b"\x00" * (MAX_FRAME_BYTES + 1))
    assert "exceeds" in msg and str(MAX_FRAME_BYTES) in msg


_DEEP = b"\x91" * 5000 + b"\x00"  # [[[[...0...]]]], 5000 levels


@pytest.mark.parametrize(
    "data",
    [
        _DEEP,
        b"\x92\x01" + _DEEP,
        b"\x92\x02" + _DEEP,
        # msgspec skips the value before it finds the union's tag: that skip recurses.
        b"\x92\x01\x82" + msgspec.msgpack.encode("x") + _DEEP + msgspec.msgpack.encode("type") + b"\xa2hb",
        b"\x92\x01" + b"\x81\xa1x" * 5000 + b"\x00",
    ],
    ids=["deep", "v1-deep-body", "v2-deep-body", "deep-before-tag", "deep-map"],
)
def test_deep_nesting(data: bytes) -> None:
    """A small frame nested thousands deep must not escape as ``RecursionError``."""
    assert "malformed" in _err(data)


def test_frame_at_the_limit_is_parsed() -> None:
    """The limit is inclusive: a (malformed) frame of exactly the limit is decoded, not size-rejected."""
    msg = _err(b"\x00" * MAX_FRAME_BYTES)
    assert "exceeds" not in msg


# -- register validation ---------------------------------------------------------------


def _reg(**changes) -> bytes:
    return _frame({**_raw(REGISTER), **changes})


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"block_ids": [[1, 2]]}, ["block_ids[0]", "expected block ids as bytes (little-endian uint32), got list"]),
        ({"block_ids": [b"\x01\x00\x00"]}, ["block_ids[0]", "3 bytes of block ids, not a multiple of 4"]),
        ({"block_ids": [b"\x00" * 4 * (MAX_BLOCKS + 1)]}, ["block_ids[0]", f"at most {MAX_BLOCKS}"]),
        ({"block_ids": [_ids(0)] * (MAX_GROUPS + 1)}, ["block_ids", f"length <= {MAX_GROUPS}"]),
        ({"block_ids": []}, ["block_ids", "length >= 1"]),
        ({"block_ids": [1.5]}, ["block_ids[0]", "got float"]),
        ({"transfer_id": "x" * 257}, ["transfer_id", "length <= 256"]),
        ({"request_id": ""}, ["request_id", "length >= 1"]),
        ({"engine_id": "e" * 1000}, ["engine_id", "length <= 256"]),
        ({"rank": -1}, ["rank", ">= 0"]),
        ({"rank": 4096}, ["rank", "<= 4095"]),
        ({"num_tokens": -3}, ["num_tokens", ">= 0"]),
        ({"lease_ms": 0}, ["lease_ms", ">= 1"]),
        ({"lease_ms": 10**9}, ["lease_ms", "<= 3600000"]),
        ({"staging": {"offset": -1, "size": 4}}, ["staging", "offset"]),
        ({"staging": {"offset": 0, "size": 4, "extra": 1}}, ["staging", "extra"]),
        ({"start_token": 38, "num_tokens": 37}, ["start_token 38 > num_tokens 37", "xfer-1"]),
    ],
)
def test_register_validation(changes: dict, words: list[str]) -> None:
    msg = _err(_reg(**changes))
    for w in words:
        assert w in msg, msg


def test_register_limits_inclusive() -> None:
    """Exactly MAX_GROUPS groups, 256-character ids and start == num_tokens are all fine."""
    got = decode(_reg(block_ids=[_ids(0)] * MAX_GROUPS, transfer_id="t" * 256, start_token=37))
    assert len(got.block_ids) == MAX_GROUPS and got.start_token == got.num_tokens


@pytest.mark.parametrize(
    ("msg", "changes", "words"),
    [
        (MESSAGES[0], {"tp_size": 0}, ["tp_size", ">= 1"]),
        (MESSAGES[0], {"agent_name": ""}, ["agent_name"]),
        (MESSAGES[0], {"layout": {**_raw(LAYOUT), "order": "XYZ"}}, ["layout", "order"]),
        (MESSAGES[0], {"layout": {**_raw(LAYOUT), "surprise": 1}}, ["layout", "surprise"]),
        (MESSAGES[0], {"staging": {"base": 1, "size": 2, "secret": 3}}, ["staging", "secret"]),
        (MESSAGES[2], {"tp_size": 0}, ["tp_size", ">= 1"]),
        (MESSAGES[6], {"nbytes": -1}, ["nbytes"]),
        (MESSAGES[8], {"reason": "r" * 4097}, ["reason", "4096"]),
        (MESSAGES[10], {"sent_at": "now"}, ["sent_at", "float"]),
    ],
)
def test_field_validation(msg, changes: dict, words: list[str]) -> None:
    text = _err(_frame({**_raw(msg), **changes}))
    for w in words:
        assert w in text, text


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"block_size": 0}, ["block_size", "> 0", "decode-a"]),
        ({"head_start": 7, "local_heads": 2}, ["heads [7, 9)"]),
        ({"regions": []}, ["no regions"]),
        ({"regions": [{"base": 4096, "size": 1}]}, ["region 0", "bytes"]),
    ],
)
def test_hello_layout_is_validated(changes: dict, words: list[str]) -> None:
    """A peer's layout that cannot be right (it would divide by zero or read outside its region later) stops here."""
    text = _err(_frame({**_raw(MESSAGES[0]), "layout": {**_raw(LAYOUT), **changes}}))
    assert "layout" in text
    for w in words:
        assert w in text, text
    reply = _err(_frame({**_raw(MESSAGES[2]), "layout": {**_raw(LAYOUT), **changes}}))
    assert "layout" in reply


# -- expected type -----------------------------------------------------------------------


def test_expected_type_mismatch() -> None:
    data = encode(MESSAGES[9])
    msg = _err(data, expected=Register)
    assert "unexpected message Abort" in msg
    assert "unexpected message Abort" in _err(data, expected=(Completion, Failure))
    assert decode(data, expected=(Completion, Abort)) == MESSAGES[9]


def test_invalid_register_fails_even_when_not_expected() -> None:
    """Validation runs before the type check, so the error names the real problem."""
    assert "start_token" in _err(_reg(start_token=99), expected=Abort)


# -- fuzzing -----------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(["type", "hello", "register", "done", "fail", "abort", "hb", "block_ids", "layout"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def _decode_or_protocol_error(data) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    """Random bytes only ever raise ``ProtocolError`` (any other exception fails the test)."""
    _decode_or_protocol_error(data)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(MESSAGES), st.data())
def test_fuzz_mutated_frames(msg, data) -> None:
    """Valid frames with bytes flipped, inserted or cut: decoded or ``ProtocolError``, nothing else."""
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            frame[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            frame[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        elif len(frame) > 1:
            del frame[i]
    _decode_or_protocol_error(bytes(frame))


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(MESSAGES), st.text(max_size=12), _values, st.integers(0, 3))
def test_fuzz_structured(msg, key: str, value, version: int) -> None:
    """Well-formed msgpack with a field replaced or added by arbitrary values: decoded or ``ProtocolError``."""
    body = _raw(msg)
    field = key if key and key != "type" else next(iter(body))
    _decode_or_protocol_error(_frame({**body, field: value}, version=version))
    _decode_or_protocol_error(msgspec.msgpack.encode([version, value]))
    _decode_or_protocol_error(msgspec.msgpack.encode(value))


def test_completion_with_an_empty_region_range_is_rejected() -> None:
    data = encode(Completion(transfer_id="t", request_id="r", rank=0, region_start=3, region_end=3))
    assert "empty region range [3, 3)" in _err(data)


def test_block_id_counts_reads_a_registration_without_decoding_its_ids() -> None:
    """What P checks before it decodes a registration: the count of each group, from the bin headers."""
    for sizes in [(0,), (3,), (15, 16), (65_535, 65_536, 70_000)]:
        reg = protocol.Register("t", "r", "d", 0, tuple(tuple(range(n)) for n in sizes), 0)
        data = protocol.encode(reg)
        assert peek.block_id_counts(data) == sizes
        assert peek.block_id_counts(memoryview(data)) == sizes
    assert peek.block_id_counts(protocol.encode(protocol.TimeQuery(1, 0.0))) is None
    # more groups than any layout has: counted no further than one past the limit, from the header
    many = msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "register", "block_ids": [b""] * 100_000}])
    assert peek.block_id_counts(many) == (0,) * (protocol.MAX_GROUPS + 1)
    # fields before the tag and unknown fields are skipped, not built
    late = {"x": [1] * 1000, "type": "register", "block_ids": [_ids(1, 2)]}
    assert peek.block_id_counts(msgspec.msgpack.encode([PROTOCOL_VERSION, late])) == (2,)
    # ids not as bytes (a v7 frame): no count (-1), so the frame is decoded and refused with the reason
    ints = msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "register", "block_ids": [[1, 2]]}])
    assert peek.block_id_counts(ints) == (-1,)
    assert peek.block_id_counts(b"\xc1 not msgpack") is None
    assert peek.block_id_counts(protocol.encode(protocol.TimeQuery(1, 0.0))[:-3]) is None
