"""Fencing a P for good: the request and its checks (``kvpush.decode.fence``), the key set's fence keys, D's
fence listener and ``kvpush fence`` over real ZeroMQ CURVE (``kvpush.transport.fence_channel``), the links
(``Links.fenced_for_good``) and the scheduler half's orders.

Who may fence: only a holder of an operator key D's ``fence/operators/`` lists; a client with another key
(a D's own, the P fleet's), a client without CURVE, or one that does not know the listener's key gets
nothing read. A bad request is answered with what is wrong and never acted on.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvpush.cli import fence as fence_cli
from kvpush.core import protocol
from kvpush.core.errors import ConfigError, ProtocolError
from kvpush.core.layout import KVLayout, MemKind, Region, TokenOrder
from kvpush.decode.fence import (
    MAX_REQUEST_BYTES,
    FenceRequest,
    Target,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    hint,
    parse_targets,
)
from kvpush.decode.link import HangUp, Heartbeat, Hello, Links, Ready
from kvpush.integrations.vllm.orders import FenceOrder
from kvpush.integrations.vllm.scheduler_side import SchedulerSide
from kvpush.transport import key_set
from kvpush.transport.fence_channel import FenceListener, send_fence


# -- the request --------------------------------------------------------------------------------------
def test_targets_name_p_instances_and_their_ranks() -> None:
    t = parse_targets(["10.0.0.5:5600/2", "10.0.0.5:5600/2", "[fe80::1]:7000"])
    assert t == (Target("10.0.0.5", 5600, 2), Target("fe80::1", 7000, 1))
    assert t[0].ranks() == {("10.0.0.5", 5600), ("10.0.0.5", 5601)}
    assert [str(x) for x in t] == ["10.0.0.5:5600/2", "[fe80::1]:7000"]
    for bad in (["nohost"], ["h:0"], ["h:65535/2"], ["h:1/0"], []):
        with pytest.raises(ConfigError, match="--prefill"):
            parse_targets(bad)
    with pytest.raises(ConfigError, match="at most"):
        parse_targets([f"h:{1000 + i}" for i in range(65)])


@given(
    targets=st.lists(
        st.builds(Target, st.sampled_from(["h", "10.1.2.3", "fe80::1"]), st.integers(1, 60000), st.integers(1, 8)),
        min_size=1,
        max_size=8,
        unique=True,
    ),
    reason=st.text(max_size=300),
)
def test_a_request_comes_back_as_it_was_sent(targets: list[Target], reason: str) -> None:
    got = decode_request(encode_request(FenceRequest(tuple(targets), reason)))
    assert got.targets == tuple(targets)
    assert len(got.reason) <= 200 and all(c.isprintable() for c in got.reason)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff", "JSON"),
        (b"[1]", '"fence"'),
        (b'{"fence": ["h:1"], "extra": 1}', '"fence"'),
        (b'{"fence": "h:1"}', "list"),
        (b'{"fence": ["h:1"], "reason": 5}', "reason"),
        (b'{"fence": ["h"]}', "HOST:PORT"),
        (b'{"fence": []}', "at least one"),
        (b"x" * (MAX_REQUEST_BYTES + 1), "at most"),
    ],
)
def test_a_bad_request_says_what_is_wrong(data: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        decode_request(data)


def test_replies_and_hints() -> None:
    assert decode_reply(encode_reply((Target("h", 1),))) == (True, "will fence h:1")
    assert decode_reply(encode_reply(error="no")) == (False, "no")
    assert decode_reply(b"junk")[0] is False
    assert "kvpush fence --prefill h:5601 --decode THIS_HOST:7000" in hint(("h", 5601), 7000)
    assert "set fence_port" in hint(("h", 5601), 0)


# -- keys ---------------------------------------------------------------------------------------------
def test_a_key_set_holds_the_fence_keys_and_a_d_mount_its_listener_keys(tmp_path: Path) -> None:
    key_set.make_key_set(tmp_path)
    for name in (key_set.FENCE_SECRET, key_set.FENCE_PUBLIC, key_set.OPERATOR_SECRET):
        assert (tmp_path / name).exists(), name
    assert (tmp_path / key_set.OPERATOR_SECRET).stat().st_mode & 0o077 == 0
    server = key_set.fence_server_keys("curve", str(tmp_path))
    client = key_set.fence_client_keys(tmp_path)
    assert server is not None and client.server == server.public
    own = key_set.add_decode_key(tmp_path, "d-0")
    mounted = key_set.fence_server_keys("curve", str(own))
    assert mounted is not None and mounted.public == server.public
    assert key_set.read_decoders(mounted.operators_dir) == frozenset({client.public})
    assert key_set.fence_server_keys("none", "") is None
    # An older key set gets them from `kvpush keys DIR` again; until then a D with fence_port says so.
    old = tmp_path / "old"
    key_set.make_key_set(old)
    (old / key_set.FENCE_SECRET).unlink()
    with pytest.raises(ConfigError, match=r"fence/decode\.key_secret does not exist.*kvpush keys DIR"):
        key_set.fence_server_keys("curve", str(old))
    assert old / key_set.FENCE_SECRET in key_set.make_key_set(old)


# -- the listener and the command, over real sockets --------------------------------------------------
class _Heard:
    def __init__(self) -> None:
        self.requests: list[FenceRequest] = []
        self.event = threading.Event()

    def __call__(self, req: FenceRequest) -> None:
        self.requests.append(req)
        self.event.set()


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def listener(tmp_path: Path):
    key_set.make_key_set(tmp_path)
    heard = _Heard()
    port = _port()
    lis = FenceListener("127.0.0.1", port, key_set.fence_server_keys("curve", str(tmp_path)), heard)
    yield tmp_path, f"127.0.0.1:{port}", heard
    lis.close()


def test_an_operator_key_fences(listener, capsys) -> None:
    keys, address, heard = listener
    code = fence_cli.main(
        ["--prefill", "10.0.0.5:5600/2", "--decode", address, "--keys", str(keys), "--reason", "pod gone"]
    )
    assert code == 0, capsys.readouterr()
    assert "ok: will fence 10.0.0.5:5600/2" in capsys.readouterr().out
    assert heard.requests == [FenceRequest((Target("10.0.0.5", 5600, 2),), "pod gone")]


def _with(keys: key_set.FenceClientKeys | None, address: str) -> tuple[bool, str]:
    return send_fence(address, encode_request(FenceRequest((Target("h", 1),), "x")), keys, 3.0)


def test_nobody_without_an_operator_key_gets_a_request_read(listener) -> None:
    keys, address, heard = listener
    op = key_set.fence_client_keys(keys)
    d_public, d_secret = key_set.read_key_file(keys / key_set.DECODE_SECRET, need_secret=True)
    assert d_secret is not None
    ok, said = _with(key_set.FenceClientKeys(d_public, d_secret, op.server), address)  # a D's own key
    assert not ok and "refused the operator key" in said
    public, secret = zmq.curve_keypair()
    ok, said = _with(key_set.FenceClientKeys(public, secret, op.server), address)  # any other key
    assert not ok and "refused" in said
    ok, said = _with(key_set.FenceClientKeys(op.public, op.secret, public), address)  # the wrong listener key
    assert not ok
    ok, said = _with(None, address)  # no CURVE at all
    assert not ok
    assert heard.requests == [], "a request without an operator key was read"
    assert _with(op, address)[0] and len(heard.requests) == 1


def test_an_operator_key_added_later_is_accepted_and_one_removed_refused(listener) -> None:
    keys, address, _ = listener
    public, secret = zmq.curve_keypair()
    op = key_set.fence_client_keys(keys)
    mine = key_set.FenceClientKeys(public, secret, op.server)
    assert not _with(mine, address)[0]
    key_set.write_key_file(keys / key_set.OPERATORS / "second.key", public)
    assert _with(mine, address)[0]
    (keys / key_set.OPERATORS / "second.key").unlink()
    (keys / key_set.OPERATORS).touch()
    assert not _with(mine, address)[0]


def test_a_port_taken_is_a_start_up_error_naming_it(listener) -> None:
    keys, address, heard = listener
    host, port = address.rsplit(":", 1)
    with pytest.raises(ConfigError, match=f"fence_port: cannot listen on {address}"):
        FenceListener(host, int(port), key_set.fence_server_keys("curve", str(keys)), heard)


def test_a_bad_request_is_answered_and_not_acted_on(listener) -> None:
    keys, address, heard = listener
    ok, said = send_fence(address, json.dumps({"fence": ["nohost"]}).encode(), key_set.fence_client_keys(keys), 3.0)
    assert not ok and "HOST:PORT" in said
    assert heard.requests == []


def test_the_command_says_what_is_missing(tmp_path: Path, capsys) -> None:
    assert fence_cli.main(["--decode", "h:1", "--keys", str(tmp_path)]) == 2
    assert "--prefill" in capsys.readouterr().err
    assert fence_cli.main(["--prefill", "h:1", "--decode", "127.0.0.1:1", "--keys", str(tmp_path)]) == 2
    assert "fence/operator.key_secret does not exist" in capsys.readouterr().err
    key_set.make_key_set(tmp_path)
    assert (
        fence_cli.main(
            ["--prefill", "h:1", "--decode", f"127.0.0.1:{_port()}", "--keys", str(tmp_path), "--timeout", "0.5"]
        )
        == 1
    )
    assert "FAILED: no answer within 0.5s" in capsys.readouterr().out


# -- D's links and the scheduler half ------------------------------------------------------------------
class _Fences:
    def __init__(self) -> None:
        self.waits = True

    def writes_on(self, conn: object) -> bool:
        return self.waits

    def quarantined_on(self, conn: object) -> bool:
        return False


def test_a_link_fenced_for_good_is_forgotten_and_dialled_afresh() -> None:
    links = Links(peer_dead_s=5.0, heartbeat_s=1.0, fences=_Fences())
    key = ("h", 1)
    assert links.open(key, 0.0) == [Hello(key, 1)]
    layout = KVLayout(
        block_size=16,
        num_blocks=8,
        block_stride=4096,
        head_bytes=256,
        num_heads=1,
        head_start=0,
        local_heads=1,
        order=TokenOrder.HND,
        mem=MemKind.DRAM,
        dtype="bfloat16",
        regions=(Region(base=1 << 30, size=8 * 4096, device_id=0),),
    )
    assert links.hello_reply(
        key, protocol.HelloReply(ok=True, rank=0, agent_name="a", layout=layout, epoch=1), 0.0
    ) == [Ready(key, 1)]
    assert links.key_of("a") == key
    assert links.fenced_for_good(key) == [HangUp(key, "a")]
    assert links.standing(key) is None and links.key_of("a") != key
    assert not any(isinstance(a, Heartbeat | Hello) for a in links.tick(10.0))
    assert links.fenced_for_good(key) == []
    assert links.open(key, 11.0) == [Hello(key, 2)]  # a new epoch: the old session's late answers are stale


def test_the_scheduler_half_orders_each_fence_and_steps_until_it_is_taken() -> None:
    s = SchedulerSide()
    assert not s.has_pending_work()
    s.fence((Target("h", 1, 2), Target("g", 7)), "pod gone")
    assert s.has_pending_work()
    assert s.take_orders().fences == [FenceOrder("h", 1, 2, "pod gone"), FenceOrder("g", 7, 1, "pod gone")]
    assert not s.has_pending_work()
