"""P's rules (pure): pairing registrations with prefills, one transfer's life, the push job, pack-ahead, key admission.

The reading path is in this package's README.md.
"""
