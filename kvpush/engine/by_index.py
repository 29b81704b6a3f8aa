"""P's by-index posts: the prepared lists they name, made once, and the direct parts posted through them.

The rules are ``kvpush.core.indexed``'s (which pairs, which pieces, which way).
Here is when the lists are made and what a direct part's WRITE becomes: by index,
built for the request from the strips, or today's. P's own
list is prepared as its KV is registered (``prepare_local``, at the sender's
start) and a D rank's as its hello is admitted and its NIXL metadata loaded
(``prepare_peer``): never per request. The agent keeps each D rank's list until
that rank is given up (``Agent.keep_list``, ``Agent.remove_peer``), so a D rank
that said hello again, restarted or was declared dead gets a list over its new
memory at its next hello, never one over the old. A part whose lists are not
kept (a layout pair ``pair_of`` refuses, a list NIXL would not prepare) or for
which today's WRITE is as cheap (``today_suffices``, ``choose``) is built as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpush.config import Config
from kvpush.core.counts import Count
from kvpush.core.indexed import (
    IndexedPair,
    PostCosts,
    Way,
    choose,
    indices,
    list_rows,
    pair_of,
    split,
    strip_descriptors,
    strips_of,
    today_suffices,
)
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import PlanKind
from kvpush.core.plan import Plan
from kvpush.transport.nixl_agent import Agent, index_cost_us


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


def costs_of(cfg: Config, nixl_version: str) -> PostCosts:
    """The costs ``choose`` weighs: the transport's per descriptor (the plan's cost model's) and an index's on
    the running NIXL."""
    return PostCosts(cfg.descriptor_cost_s(), index_cost_us(nixl_version) * 1e-6)


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
) -> tuple[Any, int, Count] | None:
    """The unposted WRITE of direct part ``[r0, r1)`` to D rank ``peer`` by index or built from the strips, its
    descriptor count and the counter it bumps; None where today's WRITE is as cheap (or the pair has no
    lists). ``notif_of``: the part's completion notification for a descriptor count."""
    pair = agent.kept(peer)
    if not isinstance(pair, IndexedPair) or pair.src is not src or pair.dst is not dst:
        return None
    if plan.kind is not PlanKind.DIRECT or plan.group_merged or today_suffices(pair, plan):
        return None
    part = split(pair, plan, r0, r1)
    if part is None:
        return None
    way = choose(part, plan.merged.shape[0] * (r1 - r0), costs)
    if way is Way.BY_INDEX:
        local, remote = indices(pair, part)
        return agent.prepare_by_index(peer, local, remote, notif_of(part.posted)), part.posted, Count.PARTS_BY_INDEX
    if way is Way.STRIPS:
        local, remote = strip_descriptors(pair, part)
        handle = agent.prepare_write(local, str(src.mem), remote, str(dst.mem), peer, notif_of(local.shape[0]))
        return handle, local.shape[0], Count.PARTS_BY_STRIP
    return None
