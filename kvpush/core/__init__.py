"""The shared rules and data both sides use (pure: no sockets, threads or clocks).

Errors, typed outcomes, the KV layout, cache spec and geometry, recurrent
state, payloads and plans, the TP topology, staging slots, per-peer limits,
capabilities, the wire protocol, the engines' counters, the NIXL backends'
traits and which NIXL versions interoperate. It imports nothing but itself and
``kvpush.config`` (``python -m kvpush_tools.imports`` checks it).

The reading path is in this package's README.md.
"""
