"""D's rules (pure): what one D rank registers with each writing P rank, the incoming transfer's writers and parts,
fencing of P's that went silent, D's link to each P rank (hello, heartbeats, death, fencing hellos), and which P
side channels D may dial.

The reading path is in this package's README.md.
"""
