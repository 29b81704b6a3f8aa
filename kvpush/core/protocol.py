"""Wire messages between P and D, as plain typed data.

Every frame is msgpack ``[version, message]`` where the message is a tagged
struct. ``decode`` never raises anything but ``ProtocolError`` and bounds what
it accepts (frame size, id lengths, block counts), so a forged or truncated
frame costs the receiver one log line, not a crash or an allocation bomb.

Control messages (hello, register, abort, heartbeat, posting, ack, features,
credit, link key, seals checked) travel over the side channel; ``Completion`` and
``Failure`` travel as NIXL notifications so that a completion is ordered after
the data it announces, each ``Sealed`` where D checks seals (v13, below).

**Versions.** A frame carries the lowest version whose messages hold it
(``frame_version``): a message of an older version's shape, with none of the
newer fields set (they are left out when at their defaults), goes as that
version, so a peer on the previous version reads everything it can act on.
A newer side learns what its peer speaks from the peer itself: P sends
``Features`` just before it answers a hello (a peer on the previous version
drops that one frame, saying why), and D uses what it offers only then (a
staging *ring*, ``StagingGrant.slots``); P uses a newer feature only where D
asked for it in a registration. Decoding accepts every version from
``OLDEST_PROTOCOL_VERSION``.

**Seals** (v13, the messages at the end of this module): P gives D a key per
session with its ``Features`` (``LinkKey``), D says it checks them
(``SealsChecked``), and only then does P seal its notifications to that D
rank; D requires seals from every link whose P said it speaks v13. Either
side on v11 or v12 pairs as before, without them.
"""

from __future__ import annotations

import array
from typing import Annotated, Any, Union

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError, ProtocolError
from kvpush.core.layout import KVLayout, MemKind, Region
from kvpush.core.outcome import Cause, PlanKind, PrefillState, Stage

PROTOCOL_VERSION = 13
"""The newest wire version this kvpush speaks; raised on any change to a message's fields or meaning."""
OLDEST_PROTOCOL_VERSION = 11
"""The oldest version it still reads and writes: a peer of that version pairs, with that version's plans."""
ROUNDS_VERSION = 12
"""The version that brought staging in rounds (``Features``, ``Credit``, a ring ``StagingGrant``)."""
MAX_FRAME_BYTES = 8 << 20
MAX_BLOCKS = 1 << 20
MAX_GROUPS = 16

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=4096)]
Capability = Annotated[str, msgspec.Meta(max_length=64)]
"""A transfer's capability (``kvpush.core.capability``); empty: none given."""
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
WIRE_BLOCK_ID = np.dtype("<u4")
"""A block id on the wire: each group's ids travel as one msgpack bin of little-endian uint32s. Neither
side builds a Python int per id (the encode is a copy of D's array, the decode one into P's), and a
frame's size bounds what its ids cost once decoded."""
MAX_BLOCK_ID = (1 << 32) - 1
BlockIds = Annotated[tuple[np.ndarray, ...], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
"""Per KV-cache group, its block ids: as given to ``encode``, uint32 arrays (``block_id_array``) or any
sequences of ints; decoded, int64 arrays (offset arithmetic on them cannot overflow)."""
_U32 = "I" if array.array("I").itemsize == 4 else "L"


def block_id_array(ids: Any, where: str = "block_ids") -> np.ndarray:
    """``ids`` as a flat uint32 array, a copy (the caller's list may change), the wire's own type (its
    encode is a copy of its bytes); ``ValueError`` naming the offending id when one is not an integer in
    ``[0, MAX_BLOCK_ID]``. From a list, ``array.array`` checks the range while it converts (one pass)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"{where}: expected a flat sequence of integer block ids, got {ids.dtype} {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > MAX_BLOCK_ID):
            bad = int(ids[(ids < 0) | (ids > MAX_BLOCK_ID)][0])
            raise ValueError(f"{where}: block id {bad} outside [0, {MAX_BLOCK_ID}]")
        arr = ids.astype(np.uint32)
    else:
        try:
            arr = np.frombuffer(array.array(_U32, ids), dtype=np.uint32)
        except OverflowError:
            bad = next(int(b) for b in ids if not 0 <= int(b) <= MAX_BLOCK_ID)
            raise ValueError(f"{where}: block id {bad} outside [0, {MAX_BLOCK_ID}]") from None
        except TypeError as exc:
            raise ValueError(f"{where}: block ids must be integers ({exc})") from None
    if arr.size > MAX_BLOCKS:
        raise ValueError(f"{where}: {arr.size} block ids, at most {MAX_BLOCKS} per group")
    return arr


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # block ids, uint32 by ``encode``
        return obj.astype(WIRE_BLOCK_ID, copy=False).tobytes()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        if not isinstance(obj, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected block ids as bytes (little-endian uint32), got {type(obj).__name__}")
        n, odd = divmod(len(obj), WIRE_BLOCK_ID.itemsize)
        if odd:
            raise ValueError(f"{len(obj)} bytes of block ids, not a multiple of {WIRE_BLOCK_ID.itemsize}")
        if n > MAX_BLOCKS:
            raise ValueError(f"{n} block ids in a group, at most {MAX_BLOCKS}")
        return np.frombuffer(obj, dtype=WIRE_BLOCK_ID).astype(np.int64)
    raise NotImplementedError(f"cannot decode {kind}")


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", omit_defaults=True):
    pass


class StagingGrant(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A slot of D's staging region reserved for one transfer from one P rank.

    ``slots`` 0: the slot holds the whole payload (one or more parts, each at its region-major offset).
    Otherwise a *ring* (``kvpush.core.rounds``): ``slots`` slots of ``part_bytes`` each, ``size`` their sum,
    through which the payload goes in *rounds*, part ``j`` into slot ``j % slots``, P posting it only once D
    has credited part ``j - slots`` (``Credit``). Sent only to a P that offered rounds (``Features``).
    """

    offset: NonNeg
    size: NonNeg
    part_bytes: NonNeg = 0
    slots: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0

    @property
    def ring(self) -> bool:
        """A ring of slots (staging in rounds), not a slot for the whole payload."""
        return self.slots > 0


class Hello(_Msg, tag="hello"):
    """D rank introduces itself to a P rank; P answers with ``HelloReply``."""

    engine_id: Id
    rank: Rank
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    agent_name: Id
    agent_metadata: bytes
    layout: KVLayout
    model: Name
    staging: Region | None = None
    epoch: NonNeg = 0
    """D's count of hellos to this P rank: P echoes it, so a reply is matched to the hello it answers. A hello
    D sends after declaring P dead is a *fencing* hello: P answers it ok only once nothing of D's earlier
    session is in flight and every registration of it is dropped."""
    staging_mem: MemKind | None = None
    """Memory kind of ``staging`` when it differs from the layout's (a device's KV staged through host memory)."""
    nixl_version: Name = ""
    """D's NIXL version, and below its NIXL backends: P refuses a D its NIXL cannot write to
    (``kvpush.core.interop``)."""
    nixl_backends: Annotated[tuple[Name, ...], msgspec.Meta(max_length=16)] = ()
    peer: Annotated[bytes, msgspec.Meta(max_length=1 << 20)] = b""
    """What lets a process on D's host write D's KV (its backend's ``export_peer``); empty: D offers no
    peer copies (``Config.peer_copy``)."""


class HelloReply(_Msg, tag="hello_reply"):
    """``ok=False`` carries the reason (incompatible layout, model, version)."""

    ok: bool
    reason: Reason = ""
    engine_id: Name = ""
    rank: NonNeg = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    agent_name: Name = ""
    agent_metadata: bytes = b""
    layout: KVLayout | None = None
    epoch: NonNeg = 0
    busy: bool = False
    """``ok=False`` for now only: an earlier session of this D rank still has WRITEs in flight; D says hello
    again shortly (a refusal that fails nothing)."""
    peer_copies: bool = False
    """P mapped this D rank's KV (``Hello.peer``) and writes its pushes with peer copies: D grants them no
    staging slot and builds no unpack list (``kvpush.backends.peer``)."""


class Register(_Msg, tag="register"):
    """D's destination blocks for one request, sent as soon as D allocates them.

    ``block_ids[g]`` lists D's blocks of KV-cache group ``g`` from token 0;
    tokens ``[start_token, num_tokens)`` are to be written (D already holds the
    prefix before ``start_token``). ``skip_blocks[g]``: D holds no block for
    the first ``skip_blocks[g]`` blocks of group ``g`` (a sliding window moved
    past them; their ids are placeholders), so that group's tokens are written
    from ``max(start_token, skip_blocks[g] * block_size)``; empty: none skipped.
    ``lease_ms`` bounds how long P keeps it.
    """

    transfer_id: Id
    request_id: Id
    engine_id: Id
    rank: Rank
    block_ids: BlockIds
    num_tokens: NonNeg
    start_token: NonNeg = 0
    lease_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 120_000
    staging: StagingGrant | None = None
    attempt: NonNeg = 0
    skip_blocks: Annotated[tuple[NonNeg, ...], msgspec.Meta(max_length=64)] = ()
    capability: Capability = ""
    """The transfer's capability (``kvpush.core.capability``): P accepts the registration only with it."""

    def __repr__(self) -> str:  # a registration logged must not show its capability
        return f"Register({self.transfer_id!r}, {self.engine_id!r}, rank={self.rank}, attempt={self.attempt})"


class Completion(_Msg, tag="done"):
    """P rank ``rank`` finished writing regions ``[region_start, region_end)`` (NIXL notification, after the data).

    A push may come in several parts (one per layer in layer-wise mode, or a
    large staged push pipelined in chunks), each its own WRITE carrying its own
    completion. D does not rely on WRITEs being delivered in order (EFA's SRD
    does not order them): it counts regions, and the writer is done when its
    parts cover every region exactly once. ``region_end == 0`` means all regions.
    """

    transfer_id: Id
    request_id: Id
    rank: Rank
    plan: PlanKind = PlanKind.DIRECT
    nbytes: NonNeg = 0
    descriptors: NonNeg = 0
    staging: StagingGrant | None = None
    attempt: NonNeg = 0
    region_start: NonNeg = 0
    region_end: NonNeg = 0
    part: NonNeg = 0
    """A push in rounds (``plan`` ``ROUNDS``): which part of the ring's cut this is (``kvpush.core.rounds``)."""


class Posting(_Msg, tag="posting"):
    """P rank ``rank`` starts writing this transfer now (side channel, just before its first part).

    Why: D polls NIXL for notifications, and polling every few microseconds
    takes its engine thread's share of the GIL from D's decode loop (the
    same cost P's polling had on its forward). With this heads-up D polls
    fast only for transfers being written, and slowly (``WARM_POLL_S``) for
    the registrations still waiting on a prefill; a lost heads-up costs
    latency, never a transfer.
    """

    transfer_id: Id
    rank: Rank
    attempt: NonNeg = 0


class Ack(_Msg, tag="ack"):
    """P rank ``rank`` acknowledges a registration with where its prefill stands (side channel).

    Sent when the registration arrives and when the state changes (queued,
    running, pushing), so D bounds its wait by what P reports instead of a
    clock started at registration. ``tokens_ahead``: prompt tokens P computes
    before this one (queued), for logs and load reports.
    """

    transfer_id: Id
    rank: Rank
    state: PrefillState
    attempt: NonNeg = 0
    tokens_ahead: Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)] = 0


class Failure(_Msg, tag="fail"):
    """P cannot (or will no longer) write this transfer; D must not wait.

    ``stage`` and ``cause`` are typed so that D's Result and metrics carry
    them as P stated them; ``reason`` is for people.
    """

    transfer_id: Id
    request_id: Name
    rank: Rank
    stage: Stage
    cause: Cause
    reason: Reason
    attempt: NonNeg = 0


class Abort(_Msg, tag="abort"):
    """D gave up on a transfer; P must not start (or must finish and drop) it."""

    transfer_id: Id
    request_id: Name
    reason: Reason
    attempt: NonNeg = 0
    capability: Capability = ""
    """The transfer's capability: P accepts the abort only with it."""

    def __repr__(self) -> str:  # an abort logged must not show its capability
        return f"Abort({self.transfer_id!r}, {self.reason!r}, attempt={self.attempt})"


class Heartbeat(_Msg, tag="hb"):
    engine_id: Id
    rank: Rank
    seq: NonNeg
    sent_at: float


class Features(_Msg, tag="features"):
    """P rank ``rank`` speaks protocol ``version`` (side channel, just before its ``HelloReply`` to the hello
    of ``epoch``): D offers it what that version brings (a staging ring: ``StagingGrant``). A D on an older
    version drops it unread, logging the version, and pairs as before."""

    version: NonNeg
    rank: Rank
    epoch: NonNeg = 0


class Credit(_Msg, tag="credit"):
    """D has unpacked parts ``[0, parts)`` of this push in rounds (side channel, D to the writing P rank): the
    ring slots they took may be written again. Cumulative, so a repeat or a lost one costs nothing but its
    wait; D repeats its latest while it still expects parts (``kvpush.decode.incoming``)."""

    transfer_id: Id
    attempt: NonNeg
    parts: NonNeg


class TimeQuery(_Msg, tag="time_query"):
    """Anyone asks a P rank for its wall clock (``kvpush doctor --peer``, clock skew).

    Unlike ``Heartbeat``, P answers it without a hello: it reveals only the
    time, and a heartbeat answer to an unknown peer would mean "I know you".
    """

    seq: NonNeg
    sent_at: float


class TimeReply(_Msg, tag="time_reply"):
    """P's answer: the query's ``seq`` and ``sent_at`` echoed, and P's ``time.time()`` when it answered."""

    seq: NonNeg
    sent_at: float
    now: float


# -- Seals (protocol v13): NIXL notifications bound to the side-channel link they belong to -------------------
# Kept apart from the messages above: the rule is ``kvpush.core.seal`` (the seal itself), ``kvpush.prefill.seals``
# (when P seals) and ``kvpush.decode.seals`` (what D takes); docs/security.md, "Notifications bound to the link".

SEALS_VERSION = 13
"""The version that brought seals (``LinkKey``, ``SealsChecked``, ``Sealed``)."""
LINK_KEY_BYTES = 32
SEAL_MAC_BYTES = 16
MAX_SEALED_BODY = 64 << 10
"""The largest notification a seal carries: a Completion or Failure frame is a few hundred bytes."""
_U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class LinkKey(_Msg, tag="link_key"):
    """P rank's key for the seals of the session that the hello of ``epoch`` opens (side channel, after
    ``Features`` and before the ``HelloReply``; confidential under CURVE). A fresh random key per hello P answers
    ok, so nothing sealed in an earlier session verifies in a later one. A D on an older version drops it unread,
    saying why, and pairs without seals."""

    key: Annotated[bytes, msgspec.Meta(min_length=LINK_KEY_BYTES, max_length=LINK_KEY_BYTES)]
    epoch: _U63

    def __repr__(self) -> str:  # a key logged is a key given away
        return f"LinkKey(epoch={self.epoch})"


class SealsChecked(_Msg, tag="seals_checked"):
    """D rank checks the seals of the session of hello ``epoch`` (side channel, D to P, right after P's ok reply
    and before any registration on that connection): from then on P seals every NIXL notification it sends this
    D rank. Sent only to a P that gave a ``LinkKey``, so a P of an older version never reads it."""

    epoch: _U63


class Sealed(_Msg, tag="sealed"):
    """A NIXL notification (``body``: the frame of a ``Completion``, ``Failure`` or ``Heartbeat``) sealed with
    the key of the session of hello ``epoch``: ``mac`` is ``kvpush.core.seal.mac`` of the key over (epoch,
    ``seq``, body). ``seq`` counts the session's seals from 1 (a replay is dropped)."""

    epoch: _U63
    seq: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
    mac: Annotated[bytes, msgspec.Meta(min_length=SEAL_MAC_BYTES, max_length=SEAL_MAC_BYTES)]
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_SEALED_BODY)]


Message = Union[
    Hello,
    HelloReply,
    Register,
    Completion,
    Posting,
    Ack,
    Failure,
    Abort,
    Heartbeat,
    Features,
    Credit,
    TimeQuery,
    TimeReply,
    LinkKey,
    SealsChecked,
    Sealed,
]


class _Frame(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    version: int
    msg: Message


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(_Frame, dec_hook=_dec_hook)


def encode(msg: Message) -> bytes:
    """The frame of ``msg``; a Register's groups not given as ``block_id_array``'s arrays are made such
    first (``ValueError`` naming a bad id)."""
    if isinstance(msg, Register) and not all(_is_wire(g) for g in msg.block_ids):
        ids = tuple(g if _is_wire(g) else block_id_array(g, f"block_ids[{i}]") for i, g in enumerate(msg.block_ids))
        msg = msgspec.structs.replace(msg, block_ids=ids)
    return _encoder.encode(_Frame(frame_version(msg), msg))


def frame_version(msg: Message) -> int:
    """The lowest version whose messages hold ``msg``: ``SEALS_VERSION`` for the seals' messages,
    ``ROUNDS_VERSION`` for what rounds brought (its messages, a ring grant, a part of a push in rounds), else the
    oldest version (whose peers read it)."""
    if isinstance(msg, LinkKey | SealsChecked | Sealed):
        return SEALS_VERSION
    if isinstance(msg, Features | Credit):
        return ROUNDS_VERSION
    if isinstance(msg, Register) and msg.staging is not None and msg.staging.ring:
        return ROUNDS_VERSION
    if isinstance(msg, Completion) and (msg.plan is PlanKind.ROUNDS or msg.part or (msg.staging and msg.staging.ring)):
        return ROUNDS_VERSION
    return OLDEST_PROTOCOL_VERSION


def _is_wire(ids: Any) -> bool:
    """A flat uint32 array within the size limit: its bytes are the wire's, no check needed."""
    return type(ids) is np.ndarray and ids.dtype == np.uint32 and ids.ndim == 1 and ids.size <= MAX_BLOCKS


def decode(data: bytes | memoryview, expected: type | tuple[type, ...] | None = None) -> Any:
    """Decode and validate one frame; raise ``ProtocolError`` saying what is wrong."""
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        frame = _decoder.decode(data)
    except RecursionError:
        # msgspec recurses when it skips a value (e.g. fields before the type tag).
        raise ProtocolError("malformed message: nested too deeply") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        version = _peek_version(data)
        if version is not None and not OLDEST_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
            raise ProtocolError(_mismatch(version)) from None
        raise ProtocolError(f"malformed message: {exc}") from None
    if not OLDEST_PROTOCOL_VERSION <= frame.version <= PROTOCOL_VERSION:
        raise ProtocolError(_mismatch(frame.version))
    msg = frame.msg
    if isinstance(msg, Register):
        _check_register(msg)
    if isinstance(msg, Completion) and msg.region_end and msg.region_start >= msg.region_end:
        raise ProtocolError(f"completion {msg.transfer_id}: empty region range [{msg.region_start}, {msg.region_end})")
    if isinstance(msg, (Hello, HelloReply)) and msg.layout is not None:
        _check_layout(msg)
    if expected is not None and not isinstance(msg, expected):
        raise ProtocolError(f"unexpected message {type(msg).__name__} here")
    return msg


def _mismatch(version: int) -> str:
    return (
        f"protocol version mismatch: peer speaks v{version}, this kvpush speaks "
        f"v{OLDEST_PROTOCOL_VERSION} to v{PROTOCOL_VERSION}"
    )


_version_decoder = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


def _peek_version(data: bytes | memoryview) -> int | None:
    """The version of a frame that failed to decode, read without building its message (a generic decode
    of a malformed frame of the largest size would be hundreds of MB of objects)."""
    try:
        version, _ = _version_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    return version


def _check_layout(msg: Hello | HelloReply) -> None:
    """A peer's layout is used for offset arithmetic later: reject one that cannot be right now."""
    try:
        msg.layout.validate()
    except LayoutError as exc:
        raise ProtocolError(
            f"{msg.__struct_config__.tag} from {msg.engine_id!r} rank {msg.rank}: invalid layout: {exc}"
        ) from None


def _check_register(msg: Register) -> None:
    if msg.start_token > msg.num_tokens:
        raise ProtocolError(f"register {msg.transfer_id}: start_token {msg.start_token} > num_tokens {msg.num_tokens}")
