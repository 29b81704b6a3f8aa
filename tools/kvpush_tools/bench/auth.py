"""``kvpush bench auth``: what the side channel's authentication costs a message.

A D-side ``Client`` and a P-side ``Server`` (the production classes) in one
process over TCP loopback, with CURVE keys and with ``"auth": "none"``;
round trips of a message of each size (a heartbeat, a registration of a few
thousand blocks, a 1 MiB registration), the two modes interleaved round by
round so both see the same machine. Reports the median and p99 round trip
per size and mode, and the CURVE handshake (connect to first answer).
Writes ``auth.json`` and ``auth_rtt.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = (64, 16 << 10, 1 << 20)


def _pair(mode: str, keys_dir: str) -> tuple[Any, Any]:
    import zmq

    from kvpush.transport import key_set
    from kvpush.transport.side_channel import Client, Server

    ctx = zmq.Context.instance()
    server = Server(ctx, "127.0.0.1", 0, key_set.server_keys(mode, keys_dir))
    client = Client(ctx, "127.0.0.1", server.port, key_set.client_keys(mode, keys_dir))
    return server, client


def _round_trip(server: Any, client: Any, msg: Any, timeout_s: float = 10.0) -> float:
    from kvpush.core import protocol

    t0 = time.perf_counter()
    client.send(msg)
    deadline = t0 + timeout_s
    got: list[Any] = []
    while not got:
        if time.perf_counter() > deadline:
            raise TimeoutError("no round trip")
        if server.sock.poll(100):
            got = server.recv()
    server.send(got[0].ident, protocol.TimeReply(0, 0.0, 0.0))
    while not client.sock.poll(100):
        if time.perf_counter() > deadline:
            raise TimeoutError("no answer")
    client.recv()
    return time.perf_counter() - t0


def _message(size: int) -> Any:
    from kvpush.core import protocol

    n = max(1, size // 3)  # block ids of 2-3 bytes each in msgpack
    return protocol.Register("t", "r", "d", 0, (tuple(range(300, 300 + n)),), 16)


def measure(rounds: int, per_round: int) -> dict[str, Any]:
    """Round trips per (mode, size), modes interleaved per round; handshake times per mode."""
    keys = tempfile.mkdtemp(prefix="kvpush-bench-auth-")
    from kvpush.transport import key_set

    key_set.make_key_set(keys)
    rtt: dict[str, dict[int, list[float]]] = {m: {s: [] for s in SIZES} for m in ("curve", "none")}
    handshake: dict[str, list[float]] = {"curve": [], "none": []}
    msgs = {s: _message(s) for s in SIZES}
    for _ in range(rounds):
        for mode in ("curve", "none"):
            t0 = time.perf_counter()
            server, client = _pair(mode, keys)
            try:
                _round_trip(server, client, msgs[SIZES[0]])
                handshake[mode].append(time.perf_counter() - t0)
                for size in SIZES:
                    for _ in range(per_round):
                        rtt[mode][size].append(_round_trip(server, client, msgs[size]))
            finally:
                client.close()
                server.close()
    out: dict[str, Any] = {"rounds": rounds, "per_round": per_round, "sizes": list(SIZES), "modes": {}}
    for mode in rtt:
        out["modes"][mode] = {
            "handshake_ms_median": 1e3 * statistics.median(handshake[mode]),
            "rtt_us": {
                str(s): {
                    "median": 1e6 * statistics.median(v),
                    "p99": 1e6 * sorted(v)[int(0.99 * (len(v) - 1))],
                    "n": len(v),
                }
                for s, v in rtt[mode].items()
            },
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = result["sizes"]
    width = 0.38
    for i, mode in enumerate(("none", "curve")):
        med = [result["modes"][mode]["rtt_us"][str(s)]["median"] for s in sizes]
        ax.bar([x + (i - 0.5) * width for x in range(len(sizes))], med, width, label=f"auth {mode}")
    ax.set_xticks(range(len(sizes)), [f"{s} B" if s < 1024 else f"{s >> 10} KiB" for s in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("round trip, median (µs)")
    ax.set_title("side channel round trip by message size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush bench auth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("results/auth"))
    args = ap.parse_args(argv)
    result = measure(args.rounds, args.per_round)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auth.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "auth_rtt.png")
    for mode, r in result["modes"].items():
        sizes = ", ".join(f"{s} B: {v['median']:.0f} us (p99 {v['p99']:.0f})" for s, v in r["rtt_us"].items())
        print(f"auth {mode}: handshake {r['handshake_ms_median']:.1f} ms; round trip {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
