"""Whether the NIXL of a P and the NIXL of a D can move KV between them (plain data, no NIXL import).

P and D may run different NIXL versions (vLLM-Neuron pins an older NIXL than a GPU fleet's vLLM). P decides at
D's hello, from the NIXL versions and backends both declare, and refuses naming both sides, because a pair
that cannot interoperate fails later and worse: a notification lost is a request that never decodes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvpush.core.nixl_backends import TESTED_NIXL

LIBFABRIC_WIRE_BREAKS: tuple[tuple[int, int], ...] = ((1, 4),)
"""NIXL versions from which the LIBFABRIC plugin cannot talk to the versions before. 1.4's plugin sends
control messages 1.3.2's does not know (type 0x8: "Unknown message type" in its log): a 1.3.2 D never sees
the notification of a 1.4+ P's WRITE, and a 1.3.2 P fails to process its completions from a 1.4+ D.
UCX has no such break. The pairs measured: docs/libfabric.md, "P and D on different NIXL versions"."""


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def libfabric_wire(version: str) -> int | None:
    """The LIBFABRIC wire generation of NIXL ``version``: versions of one generation interoperate (None:
    the version is unknown)."""
    minor = _minor(version)
    return None if minor is None else sum(minor >= b for b in LIBFABRIC_WIRE_BREAKS)


def peer_problem(p_version: str, p_backends: Sequence[str], d_version: str, d_backends: Sequence[str]) -> str:
    """Why P's NIXL cannot write to D's ("" when it can, or when either version is unknown): LIBFABRIC is a
    backend both offer and their LIBFABRIC plugins are of different wire generations, or of different versions
    one of which is newer than the NIXL kvpush was tested with (``TESTED_NIXL``): whether such plugins talk to
    each other is a trait kvpush cannot tell, and a notification lost is a request that never decodes."""
    if "LIBFABRIC" not in p_backends or "LIBFABRIC" not in d_backends:
        return ""
    newer = [v for v in (p_version, d_version) if TESTED_NIXL.standing(v) == "newer"]
    if newer and p_version != d_version:
        return (
            f"NIXL differs: P runs NIXL {p_version}, D runs NIXL {d_version}, and whether their LIBFABRIC plugins "
            f"interoperate is unknown ({newer[0]} is newer than the {TESTED_NIXL.range_text} kvpush was tested "
            "with): run one NIXL version on P and D, or UCX"
        )
    p_wire, d_wire = libfabric_wire(p_version), libfabric_wire(d_version)
    if p_wire is None or d_wire is None or p_wire == d_wire:
        return ""
    return (
        f"NIXL differs: P runs NIXL {p_version}, D runs NIXL {d_version}, and their LIBFABRIC plugins do not "
        "interoperate (NIXL 1.3's cannot read 1.4's control messages, so notifications are lost): run NIXL "
        "versions on the same side of 1.4 on P and D, or UCX"
    )
