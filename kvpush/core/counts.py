"""The engines' event counters, by member: what P's and D's machines and shells count (pure).

A name the machines bump (``decode/fencing.py`` counts registrations, postings, quarantines) lives here, below
the engines and their metrics, so that a pure rule needs nothing of ``kvpush.observability``: which counters
are exported, and under which stats and Prometheus names, is ``kvpush.observability.metrics``'s
(``COUNT_STAT``) and ``kvpush.observability.prometheus``'s.
"""

from __future__ import annotations

import enum

from kvpush.core.outcome import PlanKind


class Count(enum.StrEnum):
    """An engine's event counters (``Sender.counters``/``Receiver.counters``, ``stats()``), bumped by member.

    ``kvpush.observability.metrics.COUNT_STAT`` says which of them are exported and under which stats name.
    """

    REGISTRATIONS = "registrations_total"
    ABORTS = "aborts_total"
    DEAD_PEERS = "dead_peers_total"
    STALLS = "stalls_total"  # P: looks at its D ranks after a gap past the stall bar (its own stall)
    EXPIRED_PREFILLS = "expired_prefills_total"  # P: a parked prefill's lease ran out
    EXPIRED_REGISTRATIONS = "expired_registrations_total"  # P: a registration's lease ran out
    EXPIRED = "expired_total"  # D: no KV within transfer_timeout_s
    PARTS = "parts_total"
    LAYERWISE_PREFILLS = "layerwise_prefills_total"
    LAYER_REPORTS = "layer_reports_total"
    STALE_NOTIFICATIONS = "stale_notifications_total"
    REJECTED_MESSAGES = "rejected_messages_total"
    FAILURES_SENT = "failures_total"  # P: Failure messages sent to D
    RELEASED = "released_total"
    DEFERRED_REGISTRATIONS = "deferred_registrations_total"
    PARTS_PREBUILT = "parts_prebuilt_total"
    PARTS_BY_INDEX = "parts_by_index_total"  # P: direct WRITEs made by index into prepared lists (core/indexed.py)
    PARTS_BY_STRIP = "parts_by_strip_total"  # P: direct WRITEs built for the request from the strips (core/indexed.py)
    PACKS_AHEAD = "packs_ahead_total"  # P: pack lists built when a prefill was handed over
    PACKS_AHEAD_USED = "packs_ahead_used_total"  # P: staged plans that took such a list instead of building one
    PACKS_AT_HAND_OVER = "packs_at_hand_over_total"  # P: parked prefills packed into a slot before D registered
    PACKS_AT_HAND_OVER_USED = "packs_at_hand_over_used_total"  # P: pushes that posted such a slot without packing
    PACKS_AT_HAND_OVER_EVICTED = "packs_at_hand_over_evicted_total"  # P: such slots taken back for a registered push
    BYTES = "bytes_total"
    DESCRIPTORS = "descriptors_total"
    PLAN_DIRECT = "plan_direct_total"
    PLAN_STAGED = "plan_staged_total"
    PLAN_EMPTY = "plan_empty_total"
    PLAN_PEER = "plan_peer_total"  # P: pushes its device copied into a same-host D's blocks itself
    PLAN_ROUNDS = "plan_rounds_total"  # P: pushes staged through a ring of D's region, part by part
    STAGING_FULL = "staging_full_total"
    STAGING_TOO_SMALL = "staging_too_small_total"  # D: pushes it wanted staged, larger than its staging region
    STAGING_GRANTS = "staging_grants_total"  # D: registrations sent with a slot of D's staging region
    POSTINGS = "postings_total"
    COMPLETED = "completed_total"
    FAILED = "failed_total"
    CANCELS = "cancels_total"  # D: transfers given up before they were registered
    ABORTS_IGNORED = "aborts_ignored_total"  # P: aborts from a D that did not register the transfer (or of none)
    SEALED_NOTIFICATIONS = "sealed_notifications_total"  # D: NIXL notifications acted on, their seal verified
    UNVERIFIED_NOTIFICATIONS = "unverified_notifications_total"  # D: NIXL notifications not acted on: no valid seal
    FOREIGN_MESSAGES = "foreign_messages_total"  # D: completions/failures from a P rank it did not register with
    ACKS = "acks_total"  # D: P's acknowledgements of a registration (queued, running)
    QUARANTINES = "quarantines_total"  # D: transfers failed with a writer that may still write (blocks withheld)
    QUARANTINES_FENCED = "quarantines_fenced_total"  # D: quarantined writers released by fencing or P's answer
    QUARANTINES_OVERDUE = "quarantines_overdue_total"  # D: quarantined writers still unfenced after quarantine_s

    @classmethod
    def plan(cls, kind: PlanKind) -> Count:
        return cls(f"plan_{kind.value}_total")
