"""D's rules (pure): what one D rank registers with each writing P rank, the incoming transfer's writers and parts,
fencing of P's that went silent, and which P side channels D may dial.

The reading path is in this package's README.md.
"""
