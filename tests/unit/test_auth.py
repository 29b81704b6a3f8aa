"""Side channel keys: making a key set, loading it (files or environment), clear errors, the ZAP gate.

In one process over real ZMQ sockets; the attacks against real engines in two
processes are ``test_auth_nixl.py``.
"""

from __future__ import annotations

import logging
import stat
import time
from pathlib import Path

import pytest
import zmq

from kvpush.backends.base import CacheSpec
from kvpush.backends.host import HostBackend
from kvpush.cli import main as cli
from kvpush.config import Config
from kvpush.core import protocol
from kvpush.core.errors import ConfigError
from kvpush.engine import Receiver, Sender
from kvpush.transport import key_set
from kvpush.transport.side_channel import Client, Server, server_keys

ENV_VARS = [
    key_set.ENV_DIR,
    key_set.ENV_PREFILL_PUBLIC,
    key_set.ENV_PREFILL_SECRET,
    key_set.ENV_DECODE_PUBLIC,
    key_set.ENV_DECODE_SECRET,
    key_set.ENV_DECODERS,
]


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """None of the KVPUSH_AUTH_* variables (the session's key set is exported as one)."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _exchange(server: Server, client: Client, timeout_s: float = 5.0) -> list[protocol.Message]:
    client.send(protocol.TimeQuery(1, 0.0))
    deadline = time.monotonic() + timeout_s
    got: list = []
    while not got and time.monotonic() < deadline:
        if server.sock.poll(50):
            got = server.recv()
        client.recv()
    return got


def test_a_key_set_serves_both_roles_and_secrets_stay_private(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    made = key_set.make_key_set(tmp_path)
    assert {str(p.relative_to(tmp_path)) for p in made} == {
        "prefill.key_secret",
        "prefill.key",
        "decode.key_secret",
        "decoders/decode.key",
        "fence/decode.key_secret",
        "fence/decode.key",
        "fence/operator.key_secret",
        "fence/operators/operator.key",
    }
    for p in made:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o600 if p.name.endswith("_secret") else 0o644), (p, oct(mode))
    assert key_set.make_key_set(tmp_path) == []  # never overwritten
    sk = key_set.server_keys("curve", str(tmp_path))
    ck = key_set.client_keys("curve", str(tmp_path))
    assert sk is not None and ck is not None
    assert ck.server == sk.public and ck.public in sk.allowed
    assert zmq.curve_public(sk.secret) == sk.public


def test_keys_command_adds_a_d_key_of_its_own(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    assert cli(["keys", str(tmp_path), "--decode", "d-one"]) == 0
    mount = tmp_path / "d-one"
    assert sorted(p.name for p in mount.iterdir()) == ["decode.key_secret", "fence", "prefill.key"]
    assert sorted(str(p.relative_to(mount)) for p in (mount / "fence").rglob("*")) == [
        "fence/decode.key_secret",
        "fence/operators",
        "fence/operators/operator.key",
    ]
    own = key_set.client_keys("curve", str(mount))
    sk = key_set.server_keys("curve", str(tmp_path))
    assert own is not None and sk is not None
    assert own.public in sk.allowed and own.server == sk.public
    assert cli(["keys", str(tmp_path), "--decode", "d-one"]) == 1  # exists already


def test_a_d_key_declares_its_ranks_in_the_key_set(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    """``--ranks N`` writes N into P's copy of the D key (what P caps that key's D rank names by); a key
    without it declares none; the declaration is read again when ``decoders/`` changes; the key file stays
    a certificate ZeroMQ and P read as before."""
    assert cli(["keys", str(tmp_path), "--decode", "d-eight", "--ranks", "8"]) == 0
    assert cli(["keys", str(tmp_path), "--decode", "d-plain"]) == 0
    assert cli(["keys", str(tmp_path), "--decode", "d-zero", "--ranks", "0"]) == 1
    eight = key_set.client_keys("curve", str(tmp_path / "d-eight"))
    plain = key_set.client_keys("curve", str(tmp_path / "d-plain"))
    sk = key_set.server_keys("curve", str(tmp_path))
    assert eight is not None and plain is not None and sk is not None
    assert eight.public in sk.allowed and plain.public in sk.allowed
    declared = key_set.DeclaredRanks(tmp_path / key_set.DECODERS)
    assert declared(eight.public.decode()) == 8 and declared(plain.public.decode()) is None
    time.sleep(0.01)
    assert cli(["keys", str(tmp_path), "--decode", "d-two", "--ranks", "2"]) == 0
    two = key_set.client_keys("curve", str(tmp_path / "d-two"))
    assert two is not None and declared(two.public.decode()) == 2
    assert key_set.DeclaredRanks(None)(eight.public.decode()) is None  # keys from the environment declare none

    def full_table(path: Path) -> dict[str, int]:
        raise OSError(24, "Too many open files")

    no_env.setattr(key_set, "read_declared_ranks", full_table)  # a hello while the descriptor table is full
    time.sleep(0.01)
    assert cli(["keys", str(tmp_path), "--decode", "d-three", "--ranks", "3"]) == 0
    assert declared(eight.public.decode()) == 8  # what was read before holds; the hello goes on


@pytest.mark.parametrize(
    ("role", "remove", "needle"),
    [
        ("P", "prefill.key_secret", "prefill.key_secret does not exist"),
        ("P", "decoders/decode.key", "no D public key in"),
        ("D", "prefill.key", "prefill.key does not exist"),
        ("D", "decode.key_secret", "decode.key_secret does not exist"),
    ],
)
def test_missing_keys_are_a_clear_error(
    tmp_path: Path, no_env: pytest.MonkeyPatch, role: str, remove: str, needle: str
) -> None:
    key_set.make_key_set(tmp_path)
    (tmp_path / remove).unlink()
    load = key_set.server_keys if role == "P" else key_set.client_keys
    with pytest.raises(ConfigError, match="kvpush keys") as err:
        load("curve", str(tmp_path))
    assert needle in str(err.value) and '"auth": "none"' in str(err.value)


def test_no_keys_at_all_names_every_way_to_give_them(no_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as err:
        key_set.server_keys("curve", "")
    text = str(err.value)
    for name in ("auth_keys_dir", key_set.ENV_DIR, key_set.ENV_PREFILL_SECRET, "kvpush keys", '"auth": "none"'):
        assert name in text, text


def test_bad_key_files_are_named(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    key_set.make_key_set(tmp_path)
    other = tmp_path / "other"
    key_set.make_key_set(other)
    secret = (tmp_path / "prefill.key_secret").read_text()
    foreign = (other / "prefill.key_secret").read_text().split("secret-key")[1]
    (tmp_path / "prefill.key_secret").write_text(secret.split("secret-key")[0] + "secret-key" + foreign)
    with pytest.raises(ConfigError, match="does not belong to the public key"):
        key_set.server_keys("curve", str(tmp_path))
    (tmp_path / "decoders" / "junk.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ConfigError, match=r"junk\.key: a CURVE key is 40 Z85 characters"):
        key_set.read_decoders(tmp_path / "decoders")


def test_keys_from_the_environment(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    p_pub, p_sec = zmq.curve_keypair()
    d_pub, d_sec = zmq.curve_keypair()
    other, _ = zmq.curve_keypair()
    no_env.setenv(key_set.ENV_PREFILL_PUBLIC, p_pub.decode())
    no_env.setenv(key_set.ENV_PREFILL_SECRET, p_sec.decode())
    no_env.setenv(key_set.ENV_DECODE_PUBLIC, d_pub.decode())
    no_env.setenv(key_set.ENV_DECODE_SECRET, d_sec.decode())
    no_env.setenv(key_set.ENV_DECODERS, f"{d_pub.decode()}, {other.decode()}")
    sk, ck = key_set.server_keys("curve", ""), key_set.client_keys("curve", "")
    assert sk is not None and ck is not None
    assert sk.allowed == {d_pub, other} and ck.server == p_pub and sk.decoders_dir is None
    no_env.setenv(key_set.ENV_DECODE_SECRET, p_sec.decode())  # someone else's secret
    with pytest.raises(ConfigError, match="does not belong"):
        key_set.client_keys("curve", "")


def test_auth_none_is_explicit_and_warned(caplog: pytest.LogCaptureFixture, no_env: pytest.MonkeyPatch) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpush"):
        assert server_keys(Config.from_dict({"auth": "none"})) is None
    assert 'WITHOUT authentication ("auth": "none")' in caplog.text
    with pytest.raises(ConfigError, match="auth"):
        Config.from_dict({"auth": "off"})  # only the two named modes


def test_engines_refuse_to_start_without_keys(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    """The error reaches whoever starts the engine (vLLM's worker), before any NIXL agent exists."""
    be = HostBackend()
    spec = CacheSpec(block_size=16, num_heads=2, head_dim=8, dtype="float16")
    layout = be.describe(be.make_test_cache(spec, 1, 4), spec)
    cfg = Config.from_dict({"auth_keys_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"prefill\.key_secret does not exist"):
        Sender(cfg, be, layout, "no-keys-p")
    with pytest.raises(ConfigError, match=r"prefill\.key does not exist"):
        Receiver(cfg, be, layout, "no-keys-d")


def test_gate_names_the_key_and_reads_new_d_keys(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    """Every message carries the key its connection proved; a D key added to decoders/ while P runs is
    accepted at its next handshake, a key never added (or removed) is refused and the D is told why."""
    key_set.make_key_set(tmp_path)
    ctx = zmq.Context()
    server = Server(ctx, "127.0.0.1", 0, key_set.server_keys("curve", str(tmp_path)))
    clients: list[Client] = []
    try:
        known = key_set.client_keys("curve", str(tmp_path))
        assert known is not None
        clients.append(Client(ctx, "127.0.0.1", server.port, known))
        [got] = _exchange(server, clients[-1])
        assert got.key == known.public.decode() and isinstance(got.msg, protocol.TimeQuery)
        late = key_set.add_decode_key(tmp_path, "late")  # P re-reads decoders/ for a key it does not know
        late_keys = key_set.client_keys("curve", str(late))
        assert late_keys is not None
        clients.append(Client(ctx, "127.0.0.1", server.port, late_keys))
        [got] = _exchange(server, clients[-1])
        assert got.key == late_keys.public.decode()
        pub, sec = zmq.curve_keypair()
        clients.append(Client(ctx, "127.0.0.1", server.port, key_set.ClientKeys(pub, sec, known.server)))
        assert _exchange(server, clients[-1], timeout_s=1.5) == []
        assert "refused this D's key" in clients[-1].failure, clients[-1].failure
        assert server.gate is not None and server.gate.refused >= 1
        # revoked: the late key's file is removed, its next connection is refused
        (tmp_path / "decoders" / "late.key").unlink()
        clients.append(Client(ctx, "127.0.0.1", server.port, late_keys))
        assert _exchange(server, clients[-1], timeout_s=1.5) == []
        assert "refused this D's key" in clients[-1].failure, clients[-1].failure
    finally:
        for c in clients:
            c.close()
        server.close()
        ctx.term()
