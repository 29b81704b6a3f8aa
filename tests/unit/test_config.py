"""Configuration: a typo or a wrong type in ``kv_connector_extra_config`` is an error naming the key.

Silently running with defaults after a misspelt key is the failure this guards
against: the operator believes they set a lease or a plan and they did not.
"""

from __future__ import annotations

import msgspec
import pytest

from kvpush.config import GROUP_OF, GROUPS, Config
from kvpush.core.errors import ConfigError


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    c = Config.from_dict(None)
    assert c == Config() == Config.from_dict({})
    assert isinstance(c.backend, str) and c.backend
    assert c.nixl_backends == ("UCX",)
    assert c.side_channel_host == "127.0.0.1" and c.side_channel_port == 5600  # vLLM's NIXL default port
    assert c.staging.plan == "auto"
    assert c.staging.staging_bytes is None and c.staging.ring_slots == 4  # None: the backend's
    assert c.staging.staged_min_descriptors == 512
    assert c.leases.registration_lease_s == 120.0 and c.leases.prefill_lease_s == 60.0
    assert c.leases.transfer_timeout_s == 60.0
    assert c.polling.heartbeat_s < c.polling.peer_dead_s


def test_every_field_is_settable_and_round_trips() -> None:
    values = {
        "backend": "cuda",
        "nixl_backends": ["LIBFABRIC", "UCX"],
        "side_channel_host": "10.0.0.2",
        "side_channel_port": 5600,
        "plan": "staged",
        "staging_bytes": 0,
        "staged_min_descriptors": 1,
        "pack_at_hand_over": False,
        "descriptor_cost_us": 0.5,
        "link_gbps": 100,
        "registration_lease_s": 1.5,
        "prefill_lease_s": 2,
        "transfer_timeout_s": 3,
        "transfer_hard_cap_s": 600,
        "quarantine_s": 30,
        "max_waiting_registrations": 2,
        "heartbeat_s": 0.25,
        "peer_dead_s": 4,
        "idle_poll_max_s": 0.001,
        "push_parts": 2,
        "min_part_bytes": 1 << 20,
        "part_cost_us": 50.0,
        "peer_copy": True,
        "busy_poll_max_s": 1e-4,
        "switch_interval_ms": 0.5,
        "layerwise": True,
        "layerwise_min_tokens": 0,
        "layerwise_min_part_bytes": 0,
        "layerwise_lead_layers": 3,
        "ring_slots": 3,
        "prefill_peers": ["10.0.0.1:5600/2"],
        "model": "meta-llama/Llama-3.1-8B",
        "proxy_ip": "10.0.0.3",
        "proxy_ping_port": 30001,
        "http_port": 8100,
        "fence_port": 5700,
        "auth": "none",
        "auth_keys_dir": "/etc/kvpush/keys",
        "peer_bytes_per_s": 1e6,
        "peer_messages_per_s": 500,
        "peer_max_registrations": 100,
        "peer_max_block_ids": 1000,
        "peer_max_ranks": 8,
        "peer_key_bytes": 64 << 20,
        "preauth_per_address": 8,
        "peer_registrations_per_s": 50,
        "max_tombstones": 10,
        "peer_max_tombstones": 5,
        "capability": "optional",
        "allowed_prefills": ["10.0.0.0/8", "p1:5600-5607"],
    }
    assert set(values) == set(Config().flat()), "a new field needs a case here"
    c = Config.from_dict(values)
    assert c.nixl_backends == ("LIBFABRIC", "UCX")
    assert c.staging.link_gbps == 100.0 and isinstance(c.staging.link_gbps, float)
    assert Config.from_dict(msgspec.structs.asdict(c)) == c
    assert Config.from_dict(msgspec.json.decode(msgspec.json.encode(c))) == c


def test_grouped_and_flat_keys_are_the_same_configuration() -> None:
    """Each setting by its flat key (as before the grouping, and as vLLM's ``kv_connector_extra_config`` gives
    it) or in its group, mixed at will; both read back the same, grouped."""
    flat = {"prefill_lease_s": 5, "plan": "staged", "peer_dead_s": 4, "layerwise": True, "peer_max_ranks": 3}
    grouped = {
        "leases": {"prefill_lease_s": 5},
        "staging": {"plan": "staged"},
        "polling": {"peer_dead_s": 4},
        "per_layer": {"layerwise": True},
        "limits": {"peer_max_ranks": 3},
    }
    mixed = {
        "leases": {"prefill_lease_s": 5},
        "plan": "staged",
        "polling": {"peer_dead_s": 4},
        "layerwise": True,
        "peer_max_ranks": 3,
    }
    c = Config.from_dict(flat)
    assert c == Config.from_dict(grouped) == Config.from_dict(mixed) == Config.of(**flat) == Config.of(**grouped)
    assert (c.leases.prefill_lease_s, c.staging.plan, c.polling.peer_dead_s) == (5.0, "staged", 4.0)
    assert c.per_layer.layerwise and c.limits.peer_max_ranks == 3
    assert c.leases.registration_lease_s == Config().leases.registration_lease_s  # the rest of a group: defaults
    assert Config.from_dict(c.flat()) == c and Config.from_dict(msgspec.json.decode(msgspec.json.encode(c))) == c
    assert set(msgspec.json.decode(msgspec.json.encode(c))) == {
        *(f for f in Config.__struct_fields__ if f not in GROUPS),
        *GROUPS,
    }
    assert all(GROUP_OF[k] in GROUPS for k in c.flat() if k in GROUP_OF)


def test_a_setting_given_both_flat_and_in_its_group_is_an_error_naming_it() -> None:
    for data in (
        {"plan": "direct", "staging": {"plan": "staged"}},
        {"plan": "direct", "staging": {"plan": "direct"}},  # even when they agree: one place per setting
    ):
        with pytest.raises(ConfigError, match=r"plan is given both flat and in 'staging'"):
            Config.from_dict(data)
    with pytest.raises(ConfigError, match="peer_dead_s"):
        Config.of(peer_dead_s=3, polling={"peer_dead_s": 3})
    # other settings of the same group, flat and grouped, are fine
    c = Config.from_dict({"staging_bytes": 0, "staging": {"plan": "direct"}})
    assert (c.staging.plan, c.staging.staging_bytes) == ("direct", 0)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"leases": {"prefill_lease": 1}}, "prefill_lease"),  # unknown inside a group: named, with the group
        ({"polling": {"plan": "direct"}}, "plan"),  # a setting in the wrong group
        ({"leases": 3}, "leases"),
        ({"staging": {"staging_bytes": -1}}, "staging_bytes"),
    ],
)
def test_bad_grouped_input_is_named(data: dict, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data)
    assert named in str(info.value)


def test_replace_takes_flat_keys_and_groups() -> None:
    c = Config.of(plan="staged", prefill_lease_s=7)
    d = c.replace(peer_dead_s=3, leases={"registration_lease_s": 9})
    assert (d.polling.peer_dead_s, d.leases.registration_lease_s, d.leases.prefill_lease_s) == (3.0, 9.0, 7.0)
    assert d.staging.plan == "staged" and c.polling.peer_dead_s == Config().polling.peer_dead_s


def test_vllm_side_channel_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment set up for vLLM's NIXL connectors finds kvpush's P where it looks; extra config overrides."""
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.9")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "6100")
    c = Config.from_dict({})
    assert (c.side_channel_host, c.side_channel_port) == ("10.0.0.9", 6100)
    c = Config.from_dict({"side_channel_host": "10.0.0.2", "side_channel_port": 7000})
    assert (c.side_channel_host, c.side_channel_port) == ("10.0.0.2", 7000)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "70000")
    with pytest.raises(ConfigError, match="VLLM_NIXL_SIDE_CHANNEL_PORT='70000'"):
        Config.from_dict({})
    assert Config.from_dict({"side_channel_port": 5}).side_channel_port == 5  # the bad default is not used


def test_backends_is_vllms_name_for_the_nixl_backend_list() -> None:
    assert Config.from_dict({"backends": ["LIBFABRIC"]}).nixl_backends == ("LIBFABRIC",)
    assert Config.from_dict({"backends": ["UCX"], "nixl_backends": ["UCX"]}).nixl_backends == ("UCX",)
    with pytest.raises(ConfigError, match="disagree"):
        Config.from_dict({"backends": ["UCX"], "nixl_backends": ["LIBFABRIC"]})
    with pytest.raises(ConfigError, match="nixl_backends"):
        Config.from_dict({"backends": 3})


def test_cli_strings_are_converted() -> None:
    """CLI flags arrive as strings; numeric fields accept them (lax conversion is deliberate)."""
    c = Config.from_dict({"side_channel_port": "5600", "heartbeat_s": "0.5", "staging_bytes": "1024"})
    assert (c.side_channel_port, c.polling.heartbeat_s, c.staging.staging_bytes) == (5600, 0.5, 1024)


@pytest.mark.parametrize("key", ["backnd", "prefill_lease", "Plan", "extra"])
def test_unknown_key_is_named(key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"plan": "direct", key: 1})
    assert key in str(info.value)
    assert "unknown" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("backend", 3, ["str", "int"]),
        ("nixl_backends", "UCX", ["array", "str"]),
        ("nixl_backends", [1], ["str"]),
        ("side_channel_port", 65536, ["<= 65535"]),
        ("side_channel_port", -1, [">= 0"]),
        ("side_channel_port", True, ["int", "bool"]),
        ("side_channel_port", "http", ["int"]),
        ("plan", "fast", ["fast"]),
        ("staging_bytes", -1, [">= 0"]),
        ("staged_min_descriptors", 0, [">= 1"]),
        ("layerwise_lead_layers", 0, [">= 1"]),
        ("descriptor_cost_us", 0, ["> 0"]),
        ("link_gbps", -25, ["> 0"]),
        ("registration_lease_s", 0, ["> 0"]),
        ("prefill_lease_s", -1.0, ["> 0"]),
        ("transfer_timeout_s", float("nan"), ["> 0"]),
        ("heartbeat_s", "soon", ["float"]),
        ("peer_dead_s", None, ["float", "null"]),
        ("idle_poll_max_s", [0.1], ["float", "array"]),
        ("model", 7, ["str"]),
        ("plan", "retry", ["retry"]),
    ],
)
def test_bad_values_name_the_key(key: str, value, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict({key: value})
    msg = str(info.value)
    assert f"$.{key}" in msg, msg
    for w in words:
        assert w in msg, msg


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(["plan", "direct"])  # type: ignore[arg-type]
    assert "object" in str(info.value)


def test_config_error_is_a_value_error() -> None:
    """Callers that catch ``ValueError`` for bad user input (vLLM's arg parsing) catch ours too."""
    with pytest.raises(ValueError):
        Config.from_dict({"plan": 1})


def test_replace() -> None:
    c = Config.from_dict({"model": "m"})
    d = c.replace(plan="direct", prefill_lease_s=5)
    assert (d.staging.plan, d.leases.prefill_lease_s, d.model) == ("direct", 5.0, "m")
    assert c.staging.plan == "auto", "replace must not mutate"
    with pytest.raises(ConfigError, match="nope"):
        c.replace(nope=1)
    with pytest.raises(ConfigError, match="staging_bytes"):
        c.replace(staging_bytes=-5)


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        Config().staging.plan = "direct"  # type: ignore[misc]


def test_descriptor_cost_defaults_to_the_first_nixl_backends_measured_cost() -> None:
    """The cost model's per-descriptor cost follows the NIXL backend unless set (docs/benchmarks-log.md, LIBFABRIC)."""
    from kvpush.core.nixl_backends import LIBFABRIC, UCX

    assert Config().staging.descriptor_cost_us is None
    assert Config().descriptor_cost_s() == pytest.approx(UCX.descriptor_cost_us * 1e-6)
    lf = Config.from_dict({"nixl_backends": ["LIBFABRIC", "UCX"]})
    assert lf.descriptor_cost_s() == pytest.approx(LIBFABRIC.descriptor_cost_us * 1e-6)
    assert LIBFABRIC.descriptor_cost_us > UCX.descriptor_cost_us
    assert Config.from_dict({"nixl_backends": ["LIBFABRIC"], "descriptor_cost_us": 2.5}).descriptor_cost_s() == (
        pytest.approx(2.5e-6)
    )
    assert Config.from_dict({"nixl_backends": ["SOMETHING"]}).descriptor_cost_s() == pytest.approx(7e-6)
