"""One typed configuration object for every entry point.

The same fields come from vLLM's ``kv_connector_extra_config`` and from CLI
flags; unknown keys and out-of-range values are errors that name the key,
because a typo in a JSON blob otherwise silently runs with defaults.

Settings are grouped by concern (``leases``, ``polling``, ``staging``,
``per_layer``, ``limits``, ``security``); who and where the instance is stays
at the top. Input may name a setting in its group or by its flat key, as
before the grouping: ``{"leases": {"prefill_lease_s": 30}}`` and
``{"prefill_lease_s": 30}`` are the same configuration.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec

from kvpush.core.errors import ConfigError
from kvpush.core.nixl_backends import traits

Pos = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]

HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
DEFAULT_PORT = 5600
"""vLLM's NIXL side-channel port: a deployment set up for vLLM's NIXL connectors finds P where it looks."""


def _env_host() -> str:
    return os.environ.get(HOST_ENV) or "127.0.0.1"


def _env_port() -> int:
    raw = os.environ.get(PORT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"environment variable {PORT_ENV}={raw!r} is not a port (0-65535)")
    return port


class Leases(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How long each side holds what the other has not come for yet, and how long D waits. ``Config.leases``."""

    registration_lease_s: Pos = 120.0
    """How long P keeps a registration whose prefill has not finished."""
    prefill_lease_s: Pos = 60.0
    """How long P holds finished blocks waiting for D's registration."""
    transfer_timeout_s: Pos = 60.0
    """D fails a registered transfer by then unless P acknowledged it as queued, running or pushing
    (``protocol.Ack``): a prefill P vouches for is waited for up to ``transfer_hard_cap_s``, while P lives."""
    transfer_hard_cap_s: Pos = 1800.0
    """The longest D waits for a transfer P keeps acknowledging (queued behind a long backlog): far above
    any sane queue, a bound for a P that vouches for a prefill it lost."""
    quarantine_s: Pos = 120.0
    """Blocks of a transfer whose writer was declared dead (or did not answer an abort) are withheld from
    vLLM until no writer can reach them: that P rank is fenced (it answers a new hello, which it does only
    once nothing of the old session is in flight), it answers the registration, or all its parts landed.
    Never on a timer: a quarantine still unfenced this long after is *overdue* (a warning and
    ``quarantines_overdue_total``) and its blocks stay withheld, since a P frozen longer and resumed would
    write into reused blocks."""


class Polling(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Liveness (heartbeats, when a silent peer is dead) and how often the engine threads look. ``Config.polling``."""

    heartbeat_s: Pos = 1.0
    """Interval of liveness messages between peers."""
    peer_dead_s: Pos = 10.0
    """A peer silent for this long is declared dead and its transfers fail."""
    idle_poll_max_s: Pos = 0.05
    """Longest sleep of the progress thread when it has nothing in flight (its timers run every 50 ms;
    messages and calls wake it at once)."""
    busy_poll_max_s: Annotated[float, msgspec.Meta(gt=0, le=0.1)] | None = None
    """Longest sleep between two NIXL polls while transfers are in flight (the back-off grows from 20 us
    to this). None: the backend's (``Backend.busy_poll_s``: 1 ms for host memory, where a core is dear;
    5 us for CUDA, where a push's tail is a few polls and a core is cheap next to the GPU's time). Below
    Linux's default timer slack (50 us) it also switches on low-latency mode, a tight timer slack for the
    engine threads, without which a short sleep overshoots by the slack. Only WRITEs in
    flight are polled: device markers are waited for by a helper thread that drops the GIL (a poll takes
    it from the forward's launches), and D polls this fast only for transfers P said it is writing
    (``Posting``), others every millisecond. Measurements: docs/cuda.md, "Engine defaults"."""
    switch_interval_ms: Annotated[float, msgspec.Meta(gt=0, le=100)] | None = None
    """Python's switch interval (``sys.setswitchinterval``) in the engine process that runs kvpush's worker
    threads. A thread woken to post a push's next part waits for the GIL until the engine's loop gives it up,
    at most this long each time: with Python's 5 ms a push in many parts pays that per part (docs/results.md,
    staging in rounds). None: leave the process's as it is."""


class Staging(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a push is planned and packed: the cost model, staging regions, parts. ``Config.staging``."""

    plan: Literal["auto", "direct", "staged"] = "auto"
    """Transfer plan: the cost model's choice, or forced."""
    peer_copy: bool | Literal["auto"] = "auto"
    """Where P and D share a host and the backend can (``kvpush.backends.peer``), P's device copies the
    pieces straight into D's blocks in one pass, NIXL carrying only the notification. D offers it (sends
    what maps its KV) and P uses it only when both allow it; for a D on another host (found, not
    configured: the backend cannot map its blob) the plan is direct, staged or rounds. "auto": where the
    backend offers it by default (``Capabilities.peer_by_default``: CUDA, whose IPC mapping reaches only the
    memory D registered for NIXL WRITEs anyway); true or false force it either way."""
    staging_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Size of each rank's staging region for packed transfers (0 disables); None: the backend's
    (``Backend.staging_bytes``: 512 MiB of device memory for CUDA, 128 MiB of host memory). A push larger
    than a ring goes through one in rounds (``kvpush.core.rounds``), so no prompt length needs a larger
    region; its size sets a ring's slots (at least ``min_part_bytes``, an eighth of the region with four
    slots: two full rings at once) and so how few parts a long push is cut into."""
    ring_slots: Annotated[int, msgspec.Meta(ge=2, le=64)] = 4
    """Slots of the ring a push in rounds goes through (each ``min_part_bytes`` or a ``2 * ring_slots``-th of
    the region, the larger; D grants smaller ones when its region is busy): parts in flight or being
    unpacked at once, D's credit for a part letting P write its slot again. Two let pack, wire and unpack
    overlap; more hide a credit's round trip."""
    staged_min_descriptors: Annotated[int, msgspec.Meta(ge=1)] = 512
    """D reserves staging only for transfers with at least this many descriptors."""
    pack_at_hand_over: bool = True
    """P packs a finished prefill into a staging slot as it is handed over, before D registers, when staging
    wins whatever D's blocks are and a slot is free (``kvpush.prefill.prepack``); False: P packs at pairing."""
    descriptor_cost_us: Pos | None = None
    """What one more descriptor costs a direct push, in microseconds; drives the cost model. None: the
    measured default of the first NIXL backend (``kvpush.core.nixl_backends``; see
    ``descriptor_cost_s``; measurements: docs/benchmarks-log.md, "Descriptor cost")."""
    link_gbps: Pos = 25.0
    """Link bandwidth in GB/s for the cost model."""
    push_parts: Annotated[int, msgspec.Meta(ge=1, le=64)] = 16
    """Most WRITEs a staged push whose KV is ready at once is cut into, so packing, the wire and D's
    unpacking overlap (the first and last part half as large); how many, up to this, is the cost model's
    choice (``part_cost_us``, ``kvpush.core.parts.part_count``). 1 disables the pipelining."""
    min_part_bytes: Annotated[int, msgspec.Meta(ge=0)] = 16 << 20
    """A staged push is cut only into parts at least this large."""
    part_cost_us: Annotated[float, msgspec.Meta(ge=0)] = 200.0
    """What one more part of a staged push costs in fixed host work (its post, its notification, D's
    unpack launch), in microseconds: the cost model cuts a push into more parts only where their overlap
    saves more than this adds per part. 0: always the most parts allowed. Measurements behind the
    default: docs/benchmarks-log.md, section 14, "Parts"."""


class PerLayer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Layer-wise pushes on P (the vLLM connector): each layer as the forward writes it. ``Config.per_layer``."""

    layerwise: bool | Literal["auto"] = "auto"
    """vLLM connector: push each layer as soon as P's forward has written it (requests whose final
    prefill chunk runs in a step, when D registered), instead of the whole request after the prefill.
    "auto": on where the KV lives on a GPU (backend ``cuda``, found as ``backend`` "auto" finds it), whose
    packs and copies run on their own stream beside the forward; off on CPU hosts, where they would take the
    forward's cores. Prompts shorter than ``layerwise_min_tokens`` are pushed whole either way."""
    layerwise_min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 4096
    """With ``layerwise``, shorter prompts are still pushed whole: there the forward is bound by its
    kernel launches, and the parts' host work takes the GIL from them for longer than the push saves.
    Measurements behind the default: docs/cuda.md, "Engine defaults"."""
    layerwise_lead_layers: Annotated[int, msgspec.Meta(ge=1)] = 2
    """With ``layerwise``, ready layers are held back until at most this many layers of the forward are
    left to compute; then they go at once, and the rest as they come (grouped by
    ``layerwise_min_part_bytes``; the last layer alone). Why hold: KV leaving P while the forward
    computes slows the forward when streamed layer by layer, and not measurably when sent in one burst
    during the last layers, which still ends before the forward does. Raise it where the link is slow
    next to a layer's compute (this many layers' compute must cover the push); a value >= the model's
    layer count streams every group as soon as it is ready. Measurements: docs/cuda.md, "Engine
    defaults"."""
    layerwise_min_part_bytes: Annotated[int, msgspec.Meta(ge=0)] = 16 << 20
    """With ``layerwise``, once pushing has begun (``layerwise_lead_layers``), a part is posted when at
    least this many bytes of layers are ready, when one layer is left (so the last part is the last
    layer alone), or with the last layer: layers are grouped so that a part's fixed host costs (pack
    launch, post, D's unpack launch) stay small next to its bytes and off the forward's GIL. 0 posts
    every layer on its own (streaming). Measurements: docs/cuda.md, "Engine defaults"."""


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one peer may make this side hold or read (docs/security.md). ``Config.limits``."""

    peer_bytes_per_s: Pos = float(64 << 20)
    """Side-channel bytes one peer (one D key on P) may make this side read per second; frames over it
    are dropped unread and logged. Far above any real peer (a registration is a few KB)."""
    peer_messages_per_s: Pos = 20_000.0
    """Side-channel messages one peer may make this side read per second (as ``peer_bytes_per_s``)."""
    peer_max_registrations: Annotated[int, msgspec.Meta(ge=1)] = 16_384
    """Open registrations one D rank may have on a P rank at once; more are refused (cause ``over_limit``)."""
    peer_max_block_ids: Annotated[int, msgspec.Meta(ge=1)] = 1 << 21
    """Block ids one D rank's open registrations may hold on a P rank (also at most twice that D rank's
    whole cache, as it declared at hello); more are refused."""
    peer_registrations_per_s: Pos = 2_000.0
    """Registrations per second one D rank may make (a burst of as many); more are refused."""
    max_tombstones: Annotated[int, msgspec.Meta(ge=0)] = 65_536
    """Transfers aborted before their prefill that P remembers (so the prefill is released at once); the
    oldest is forgotten first (then that prefill waits for its lease)."""
    peer_max_tombstones: Annotated[int, msgspec.Meta(ge=0)] = 4_096
    """Of those, how many one D rank's aborts of transfers no D registered may leave; its further such
    aborts are ignored (logged, counted)."""
    peer_max_ranks: Annotated[int, msgspec.Meta(ge=1)] = 16
    """D rank names (engine id, rank) one D key may be known as on a P rank at once, for a key whose key set
    declares no ranks (``kvpush keys DIR --decode NAME --ranks N`` declares N, TP size times DP, and the
    key may then be known as 2 N: a restarted D's new names while its old ones wait out ``peer_dead_s``);
    a hello under a further name is refused. A key may hold as many authenticated connections to a P rank
    (its oldest is shut beyond them; docs/security.md, "Connections per key"). With one D key shared by the
    whole D fleet, at least the number of D ranks that use one P rank. Not applied with ``"auth": "none"``
    (every peer is then the same nobody)."""
    peer_key_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 256 << 20
    """Bytes one D key may make a P rank hold, as a whole: its D rank names with their NIXL metadata, its
    open registrations and their block ids (``kvpush.prefill.admission`` counts them); a hello or a registration
    that would go over it is refused (cause ``over_limit``), the reason naming the key. docs/security.md
    states what this means for P's memory. Not applied with ``"auth": "none"`` (there are no keys)."""
    preauth_per_address: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Connections from one source address P keeps open before they prove a D key; when one more comes,
    the oldest of that address still before its handshake is shut (``kvpush.prefill.admission.PreAuth``): a
    client without a key cannot fill P's descriptor table, and a real D behind the same address still
    gets through. Only with authentication (``"auth": "none"`` has no handshake to wait for)."""
    max_waiting_registrations: Annotated[int, msgspec.Meta(ge=0)] = 16
    """D: at most this many registrations wait on one P instance; a request beyond them gets its blocks
    only when one of them ends (it waits in vLLM's queue, holding nothing), so D does not pin blocks for
    prefills queued behind P's backlog. 0: no bound."""


class Security(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Side-channel authentication and what a D and a P accept of each other (docs/security.md). ``Config.security``."""

    auth: Literal["curve", "none"] = "curve"
    """Side channel authentication: "curve" (ZeroMQ CURVE keys: P accepts only D keys it allows, D talks only
    to a P holding the key it trusts) or "none" (anyone who reaches the port gets NIXL access to the KV cache;
    logged as a warning at start). See docs/security.md."""
    auth_keys_dir: str = ""
    """Key set directory (``kvpush keys DIR`` makes one); empty: ``$KVPUSH_AUTH_KEYS_DIR``, else the
    ``KVPUSH_AUTH_*`` key variables. Missing keys with ``auth`` on are a start-up error naming what is missing."""
    capability: Literal["required", "optional"] = "required"
    """P: a registration or abort must carry the transfer's capability (``kvpush.core.capability``: P's answer
    or the router gives it; docs/security.md). "optional" also accepts them without one, for routers that
    cannot pass it (vLLM's push proxies, which send P and D at once in vLLM's own conventions); a
    registration with the capability then still takes the transfer from one without. Not applied with
    ``"auth": "none"``."""
    allowed_prefills: tuple[str, ...] = ()
    """D: the P side channels it may dial, as ``ADDR``, ``ADDR:PORT`` or ``ADDR:PORT-PORT`` where ADDR is a
    host name, an IP address or a network (``10.0.0.0/8``; IPv6 in brackets); empty: any (the router names
    P). A request naming another P fails before any connection, saying why (``kvpush.decode.allow``)."""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """kvpush settings; durations in seconds, sizes in bytes. Who and where this instance is, at the top;
    the rest in groups (``cfg.leases.prefill_lease_s``), each setting also accepted by its flat key
    (``GROUP_OF``)."""

    backend: str = "auto"
    """The device backend: where the KV lives and how it is described, registered and packed (an entry point of
    ``kvpush.backends``); "auto" follows vLLM's platform. Not the NIXL backends: ``nixl_backends``."""
    nixl_backends: tuple[str, ...] = ("UCX",)
    """NIXL transport plugins, in order of preference: UCX here, LIBFABRIC on EFA hosts. ``backends`` (vLLM's
    connectors' key for this list) is accepted as an alias; ``nixl_backends`` is the name."""
    side_channel_host: str = msgspec.field(default_factory=_env_host)
    """Address P's side channel binds to and tells D in its answer; default ``$VLLM_NIXL_SIDE_CHANNEL_HOST``,
    else 127.0.0.1."""
    side_channel_port: Port = msgspec.field(default_factory=_env_port)
    """P rank r listens on port + r; default ``$VLLM_NIXL_SIDE_CHANNEL_PORT``, else 5600 (vLLM's). 0 picks a
    free port per rank (tests), which P cannot tell D."""
    fence_port: Port = 0
    """D: where its fence listener takes an operator's ``kvpush fence`` (a P instance gone for good: D gives back
    the blocks it withholds for it), bound on ``side_channel_host``; DP engine k listens on ``fence_port + k``.
    Authenticated with the key set's ``fence/`` keys (docs/security.md, "Fencing a P for good"). 0: no
    listener (withheld blocks then go back only when a P answers again at the dead one's address)."""
    model: str = ""
    """Model identity; peers with different values are refused at handshake."""
    prefill_peers: tuple[str, ...] = ()
    """D: the P instances it says hello to at start, as ``HOST:PORT`` (P's side channel, rank 0's port) or
    ``HOST:PORT/TP`` (P's tensor-parallel size, 1 if not given): the link to each P rank it takes KV from is up,
    NIXL metadata exchanged and P's lists for it prepared before the first request, whose TTFT then matches
    the steady state (``kvpush.decode.warm``). Empty: a link opens at the first registration that needs it."""
    proxy_ip: str = ""
    """Router service discovery (vLLM's name): announce this instance to ``proxy_ip:proxy_ping_port``
    (vllm-router ``--vllm-discovery-address``) so the router sends P and D their requests at once;
    empty: no announcement."""
    proxy_ping_port: Port = 0
    """Port of the router's service discovery (with ``proxy_ip``)."""
    http_port: Port = 0
    """This server's HTTP port, announced with ``side_channel_host`` (with ``proxy_ip``)."""
    leases: Leases = msgspec.field(default_factory=Leases)
    polling: Polling = msgspec.field(default_factory=Polling)
    staging: Staging = msgspec.field(default_factory=Staging)
    per_layer: PerLayer = msgspec.field(default_factory=PerLayer)
    limits: Limits = msgspec.field(default_factory=Limits)
    security: Security = msgspec.field(default_factory=Security)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Config:
        """Build from a mapping (``kv_connector_extra_config``); names the bad key on error.

        Grouped (``{"leases": {"prefill_lease_s": 30}}``) or flat (``{"prefill_lease_s": 30}``), mixed at will;
        a setting given both ways is an error naming it. ``backends`` (what vLLM's NIXL connectors call the
        NIXL backend list) is read as ``nixl_backends``.
        """
        data = data or {}
        flat: list[str] = []
        if isinstance(data, dict):
            flat = [key for key in data if key in GROUP_OF]
            data = _grouped(_alias_backends(data))
        try:
            return msgspec.convert(data, cls, strict=False)
        except msgspec.ValidationError as exc:
            why = str(exc)
            for key in flat:  # named as it was given
                why = why.replace(f"`$.{GROUP_OF[key]}.{key}`", f"`$.{key}`")
            raise ConfigError(f"invalid kvpush configuration: {why}") from None

    @classmethod
    def of(cls, **settings: Any) -> Config:
        """Build from keyword settings, flat or grouped (``Config.of(plan="staged")``), as ``from_dict``."""
        return cls.from_dict(settings)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (what ``from_dict`` takes back)."""
        out = msgspec.structs.asdict(self)
        for group in GROUPS:
            out.update(msgspec.structs.asdict(out.pop(group)))
        return out

    def descriptor_cost_s(self) -> float:
        """Seconds per descriptor: ``descriptor_cost_us`` when set, else the first NIXL backend's default."""
        us = self.staging.descriptor_cost_us
        return (traits(self.nixl_backends).descriptor_cost_us if us is None else us) * 1e-6

    def replace(self, **changes: Any) -> Config:
        """This configuration with ``changes`` (flat keys, or whole groups as mappings)."""
        flat = self.flat()
        for key, value in changes.items():
            if key in GROUPS and isinstance(value, dict | msgspec.Struct):
                flat.update(msgspec.structs.asdict(value) if isinstance(value, msgspec.Struct) else value)
            else:
                flat[key] = value
        return Config.from_dict(flat)


GROUPS: dict[str, type[msgspec.Struct]] = {
    "leases": Leases,
    "polling": Polling,
    "staging": Staging,
    "per_layer": PerLayer,
    "limits": Limits,
    "security": Security,
}
"""The groups of settings, by their key in ``Config``."""
GROUP_OF: dict[str, str] = {key: group for group, cls in GROUPS.items() for key in cls.__struct_fields__}
"""Each grouped setting's flat key -> its group (``"prefill_lease_s"`` -> ``"leases"``)."""


def _alias_backends(data: dict[str, Any]) -> dict[str, Any]:
    if "backends" not in data:
        return data
    data = dict(data)
    alias = data.pop("backends")
    if "nixl_backends" in data and data["nixl_backends"] != alias:
        raise ConfigError(
            f"invalid kvpush configuration: backends {alias!r} and nixl_backends {data['nixl_backends']!r} "
            "disagree (both name the NIXL backend list; give one)"
        )
    data["nixl_backends"] = alias
    return data


def _grouped(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each flat key moved into its group; a setting given both flat and in its group is an
    error naming it. Anything else (an unknown key, a group that is not a mapping) is left for msgspec to
    name."""
    out = {k: v for k, v in data.items() if k not in GROUP_OF}
    for group in GROUPS:
        if isinstance(out.get(group), msgspec.Struct):
            out[group] = msgspec.structs.asdict(out[group])
    for key, value in data.items():
        group = GROUP_OF.get(key)
        if group is None:
            continue
        sub = out.setdefault(group, {})
        if not isinstance(sub, dict):
            continue  # msgspec names the group that is not a mapping
        if key in sub:
            raise ConfigError(
                f"invalid kvpush configuration: {key} is given both flat and in {group!r} (give it once: "
                f"{key} or {group}.{key})"
            )
        out[group] = {**sub, key: value}
    return out
