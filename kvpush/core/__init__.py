"""The shared rules and data both sides use (pure: no sockets, threads or clocks).

Errors, typed outcomes, the KV layout and geometry, recurrent state, payloads
and plans, the TP topology, staging slots, per-peer limits, capabilities and
the wire protocol.

The reading path is in this package's README.md.
"""
