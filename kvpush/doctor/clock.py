"""The clock offset to a P: timelines that join P's and D's events are only as true as the two clocks agree.

Measured with the side channel's time query, so it needs nothing on P but a
running kvpush; the answer is good to half the round trip of the best sample.
"""

from __future__ import annotations

import time

from kvpush.doctor.report import Check


def measure_clock(host: str, port: int, samples: int = 8, timeout: float = 2.0) -> dict[str, float]:
    """Offset of the peer's wall clock from ours (peer - local), from the lowest-RTT time query.

    Each sample: send ``TimeQuery`` at t0, the peer answers with its clock
    ``now``, it arrives at t1; offset = now - (t0 + t1) / 2, good to ±RTT/2.
    """
    import zmq

    from kvpush import protocol

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    best: tuple[float, float] | None = None
    try:
        for seq in range(samples):
            t0 = time.time()
            sock.send(protocol.encode(protocol.TimeQuery(seq, t0)))
            while True:
                if not sock.poll(int(timeout * 1000)):
                    raise TimeoutError(f"no answer from {host}:{port} within {timeout:g}s")
                msg = protocol.decode(sock.recv())
                if isinstance(msg, protocol.TimeReply) and msg.seq == seq:
                    break
            t1 = time.time()
            rtt = t1 - t0
            if best is None or rtt < best[0]:
                best = (rtt, msg.now - (t0 + t1) / 2)
    finally:
        sock.close(linger=0)
    assert best is not None
    return {"offset_s": best[1], "rtt_s": best[0]}


def check_clock(peer: str, warn_ms: float) -> Check:
    """The clock offset to the P side channel at ``peer`` (HOST:PORT); beyond ``warn_ms`` it is a failure."""
    host, _, port = peer.rpartition(":")
    try:
        m = measure_clock(host, int(port))
    except Exception as exc:
        return Check(
            "clock",
            f"clock offset to {peer}",
            "fail",
            "the peer did not answer a time query",
            why=f"{type(exc).__name__}: {exc}",
            fix="give the side channel of a running kvpush P (kv_connector_extra_config side_channel_port; "
            "rank r at port + r); a P from before time queries existed ignores them",
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
