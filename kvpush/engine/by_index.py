"""P's by-index posts: the prepared lists they name, made once, and the direct parts posted through them.

The rules are ``kvpush.core.indexed``'s (which pairs, which pieces, which parts).
Here is when the lists are made and what a direct part's WRITE becomes. P's own
list is prepared as its KV is registered (``prepare_local``, at the sender's
start) and a D rank's as its hello is admitted and its NIXL metadata loaded
(``prepare_peer``): never per request. The agent keeps each D rank's list until
that rank is given up or its metadata unloaded (``Agent.keep_list``), so a D rank
that said hello again, restarted or was declared dead gets a list over its new
memory at its next hello, never one over the old. A part whose lists are not
kept (a layout pair ``pair_of`` refuses, a list NIXL would not prepare) or that
does not pay (``by_index_pays``) is built for the request as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpush.config import Config
from kvpush.core.indexed import (
    IndexedPair,
    PostCosts,
    by_index_pays,
    indices,
    list_rows,
    pair_of,
    rest_descriptors,
    split,
    strips_of,
)
from kvpush.core.layout import KVLayout
from kvpush.core.plan import Plan
from kvpush.transport.nixl_agent import Agent


def prepare_local(agent: Agent, layout: KVLayout) -> bool:
    """Prepare P's own list over its registered KV, one entry per block of each strip; whether it is kept."""
    if not layout.direct or layout.hybrid:
        return False
    strips = strips_of(layout)
    return agent.keep_list("", list_rows(layout, strips), str(layout.mem), strips)


def prepare_peer(agent: Agent, src: KVLayout, peer: str, dst: KVLayout) -> bool:
    """Prepare the list over D rank ``peer``'s KV (layout ``dst``, its metadata just loaded) where P's layout
    ``src`` pairs with it by index; whether a list is kept for it."""
    pair = pair_of(src, dst)
    if pair is None or agent.kept("") != pair.strips:
        return False
    return agent.keep_list(peer, pair.remote_rows, str(dst.mem), pair)


def costs_of(cfg: Config) -> PostCosts:
    """The costs ``by_index_pays`` weighs: the transport's per descriptor (the plan's cost model's), and one
    more WRITE's fixed host work (``part_cost_us``, what one more part costs)."""
    return PostCosts(cfg.descriptor_cost_s(), cfg.staging.part_cost_us * 1e-6)


def build_direct(
    agent: Agent,
    costs: PostCosts,
    plan: Plan,
    src: KVLayout,
    dst: KVLayout,
    peer: str,
    r0: int,
    r1: int,
    notif_of: Callable[[int], bytes],
) -> tuple[Any, int] | None:
    """The unposted WRITE of direct part ``[r0, r1)`` to D rank ``peer`` by index, and the descriptors it posts;
    None where the part is built for the request instead. ``notif_of``: the part's completion notification for
    a descriptor count."""
    pair = agent.kept(peer)
    if not isinstance(pair, IndexedPair) or pair.src is not src or pair.dst is not dst:
        return None
    part = split(pair, plan, r0, r1)
    if part is None or not by_index_pays(part, plan.merged.shape[0] * (r1 - r0), costs):
        return None
    local, remote = indices(pair, part)
    rest = None
    ndesc = part.posted
    if part.rest.shape[0]:
        rl, rr = rest_descriptors(pair, part)
        rest = (rl, str(src.mem), rr, str(dst.mem))
        ndesc += rl.shape[0]
    return agent.prepare_by_index(peer, local, remote, notif_of(ndesc), rest), ndesc
