"""The clock offset to a P: timelines that join P's and D's events are only as true as the two clocks agree.

Measured with the side channel's time query, so it needs nothing on P but a
running kvpush; the answer is good to half the round trip of the best sample.
"""

from __future__ import annotations

import time
from typing import Any

from kvpush.doctor.report import Check


def measure_clock(host: str, port: int, keys: Any = None, samples: int = 8, timeout: float = 2.0) -> dict[str, float]:
    """Offset of the peer's wall clock from ours (peer - local), from the lowest-RTT time query.

    Each sample: send ``TimeQuery`` at t0, the peer answers with its clock
    ``now``, it arrives at t1; offset = now - (t0 + t1) / 2, good to ±RTT/2.
    ``keys`` (a D's ``ClientKeys``) authenticate to a P that requires it.
    """
    import zmq

    from kvpush.core import protocol
    from kvpush.transport.side_channel import Client

    client = Client(zmq.Context.instance(), host, port, keys)
    best: tuple[float, float] | None = None
    try:
        for seq in range(samples):
            t0 = time.time()
            client.send(protocol.TimeQuery(seq, t0))
            msg = None
            while not (isinstance(msg, protocol.TimeReply) and msg.seq == seq):
                if not client.sock.poll(int(timeout * 1000)):
                    client.recv()  # notes a failed handshake
                    why = f": {client.failure}" if client.failure else ""
                    raise TimeoutError(f"no answer from {host}:{port} within {timeout:g}s{why}")
                msg = protocol.decode(client.sock.recv())
            t1 = time.time()
            rtt = t1 - t0
            if best is None or rtt < best[0]:
                best = (rtt, msg.now - (t0 + t1) / 2)
    finally:
        client.close()
    assert best is not None
    return {"offset_s": best[1], "rtt_s": best[0]}


def check_clock(peer: str, warn_ms: float, auth_keys_dir: str = "", auth: str = "curve") -> Check:
    """The clock offset to the P side channel at ``peer`` (HOST:PORT), authenticating as a D of the key set
    in ``auth_keys_dir``; beyond ``warn_ms`` it is a failure."""
    from kvpush.transport.key_set import client_keys

    host, _, port = peer.rpartition(":")
    try:
        m = measure_clock(host, int(port), client_keys(auth, auth_keys_dir))
    except Exception as exc:
        return Check(
            "clock",
            f"clock offset to {peer}",
            "fail",
            "the peer did not answer a time query",
            why=f"{type(exc).__name__}: {exc}",
            fix="give the side channel of a running kvpush P (kv_connector_extra_config side_channel_port; "
            "rank r at port + r) and a D key set it allows (--auth-keys-dir); a P from before time queries "
            "existed ignores them",
        )
    off_ms, rtt_ms = m["offset_s"] * 1e3, m["rtt_s"] * 1e3
    text = f"peer clock is {off_ms:+.2f} ms from ours (±{rtt_ms / 2:.2f} ms, RTT {rtt_ms:.2f} ms)"
    if abs(off_ms) - rtt_ms / 2 > warn_ms:
        return Check(
            "clock",
            f"clock offset to {peer}",
            "fail",
            text,
            why=f"more than {warn_ms:g} ms apart: timelines joined across P and D mislead by that much",
            fix="run chrony or another NTP/PTP client on both hosts (on AWS: the Amazon Time Sync Service)",
            details=m,
        )
    return Check("clock", f"clock offset to {peer}", "ok", text, details=m)
