"""What kvpush measures and shows: mergeable transfer metrics, their Prometheus export, and per-request timelines.

The reading path is in this package's README.md.
"""
