"""The engine plans of ``kvpush bench transfer``: each plan's settings and staging region, and the sizes it takes.

- ``coalesced``: the engine with ``plan="direct"`` (no staging region);
- ``staged``: one slot holding the whole payload, each side's region sized to the push: what an operator
  had to configure before staging in rounds. D grants it as it grants a P rank that takes no rounds
  (``one_slot``), so a push larger than a ring (``ring_slots`` x ``min_part_bytes``) stays in one slot
  instead of going through a ring of that large region;
- ``rounds``: staged through a ring of a small region (``--ring-bytes``, 64 MiB by default: the default
  ring, 4 slots of 16 MiB), its parts as D grants them (``kvpush.core.rounds``); a push no larger than
  the ring takes one slot of it, as in kvpush;
- ``rounds:<size>`` (``--ring-parts``, which replaces ``rounds`` by one plan per size): rounds with parts
  of that size (``min_part_bytes``), the region ``ring_slots`` of them, so part sizes take turns in one
  pair of processes;
- ``auto``: the cost model choosing, the region sized to the push (above a ring, kvpush then goes in
  rounds through it).

Every staged plan is forced (``staged_min_descriptors`` 1), whatever D's blocks are, as ``staged`` always
was here: ``auto`` says what the cost model would do.

Nothing of ``kvpush`` is imported at module level (the side processes of ``--tree`` import another tree's).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Collection
from typing import Any

ENGINE_PLANS = {"coalesced": "direct", "staged": "staged", "rounds": "staged", "auto": "auto"}
"""The engine's ``plan`` setting of each of the bench's engine plans."""
RING_BYTES = 64 << 20
"""The ``rounds`` plan's staging region unless ``--ring-bytes``: kvpush's default ring (4 x 16 MiB)."""
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``64M``, ``2G``, ``512KiB`` or ``4096`` (binary units)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 2G, 4096)")
    n = int(float(m[1]) * _UNITS[m[2].lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return n


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of ``parse_size``."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("no size given")
    return [parse_size(x) for x in items]


def size_label(n: int) -> str:
    """``64M``, ``2G``, ``512K``: the shortest binary unit that shows ``n`` whole, else bytes."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def base_plan(plan: str) -> str:
    """``rounds`` for ``rounds:4M``; any other plan is its own."""
    return plan.split(":", 1)[0]


def part_bytes_of(plan: str) -> int | None:
    """The part size a ``rounds:<size>`` plan names (None for every other plan)."""
    head, _, size = plan.partition(":")
    return parse_size(size) if head == "rounds" and size else None


def expand(plans: list[str], ring_parts: list[int] | None) -> list[str]:
    """``plans`` with ``rounds`` replaced by ``rounds:<size>`` per part size when ``ring_parts`` is given."""
    if not ring_parts:
        return list(plans)
    out: list[str] = []
    for plan in plans:
        out += [f"rounds:{size_label(b)}" for b in ring_parts] if plan == "rounds" else [plan]
    return out


def flat_config(
    plan: str, request_bytes: int, nixl_backends: tuple[str, ...], knobs: dict[str, Any], known: Collection[str]
) -> dict[str, Any]:
    """The engine's settings for ``plan`` as flat keys (what every tree's ``Config.from_dict`` takes, for
    ``--tree`` A/B across config changes); bench knobs set only where the tree has the key (``known``)."""
    mode = ENGINE_PLANS[base_plan(plan)]
    slots = knobs.get("ring_slots") or 4
    part = part_bytes_of(plan)
    if mode == "direct":
        staging = 0
    elif part is not None:
        staging = slots * part
    elif base_plan(plan) == "rounds":
        staging = knobs.get("ring_bytes") or RING_BYTES
    else:  # a slot for the whole payload, with a MiB to spare
        staging = math.ceil(request_bytes / (1 << 20) + 1) << 20
    extra: dict[str, Any] = {"staged_min_descriptors": 1} if mode == "staged" else {}
    if knobs.get("push_parts") is not None:
        extra["push_parts"] = knobs["push_parts"]
    for knob in ("min_part_bytes", "part_cost_us", "ring_slots", "peer_dead_s"):  # config keys of later trees
        if knobs.get(knob) is not None and knob in known:
            extra[knob] = knobs[knob]
    if part is not None and "min_part_bytes" in known:
        extra["min_part_bytes"] = part
    flat = {"plan": mode, "staging_bytes": staging, "nixl_backends": list(nixl_backends), "side_channel_port": 0}
    return {**flat, **extra}


def config_keys(config_cls: Any) -> frozenset[str]:
    """The flat keys a tree's ``Config`` takes (none before it had them)."""
    return frozenset(config_cls().flat()) if hasattr(config_cls, "flat") else frozenset()


def one_slot(receiver: Any) -> bool:
    """Make D grant one slot for the whole payload, as it does to a P rank that takes no rounds (an older
    kvpush), whatever the push's size: the ``staged`` plan as it was before staging in rounds. A bench knob
    on this receiver only; False where the tree has no rounds (its grants are one slot anyway)."""
    import inspect

    unpacks = getattr(receiver, "unpacks", None)
    grant = getattr(unpacks, "grant", None)
    if grant is None or "rounds" not in inspect.signature(grant).parameters:
        return False

    def no_rounds(p_layout: Any, ask: Any, want: bool, rounds: bool = False) -> Any:
        return grant(p_layout, ask, want, False)

    unpacks.grant = no_rounds
    return True


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The plans' options of ``kvpush bench transfer``."""
    ap.add_argument(
        "--ring-bytes",
        type=parse_size,
        default=None,
        help=f"the rounds plan's staging region on P and D (default {size_label(RING_BYTES)}: kvpush's default ring)",
    )
    ap.add_argument(
        "--ring-parts",
        type=parse_sizes,
        default=None,
        metavar="SIZES",
        help="replace the rounds plan by one per part size (e.g. 4M,16M,64M; each region ring-slots parts)",
    )
    ap.add_argument(
        "--peer-dead-s",
        type=float,
        default=None,
        help="the engines' peer_dead_s (default kvpush's; with --sizes 60: the host backend packs a staged push's "
        "parts in one engine step, and the first into a cold GiB-sized region outlasts 10 s on a slow host)",
    )
    ap.add_argument("--ring-slots", type=int, default=None, help="a ring's slots (config ring_slots; default kvpush's)")
