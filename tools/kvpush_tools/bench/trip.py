"""``kvpush bench trip``: one message's trip from D's send to P's engine thread having it, part by part.

D's Register reaches P through two ZMQ I/O threads (D's, P's) and P's engine
thread waking up from ``zmq.poll``. This benchmark times that trip between
two processes on one host (``time.monotonic()`` is one clock for both), the
receiver shaped like P's engine thread: it sleeps in a ``zmq.Poller`` that
also watches a wake-up pipe, and only answers after the sender's next gap,
so every message finds it asleep, as a registration finds an idle P. Cases:

- ``zmq``: raw DEALER -> ROUTER, no encryption;
- ``zmq-curve``: the same sockets with CURVE keys (no ZAP handler);
- ``side-channel``: kvpush's own ``Client`` and ``Server`` with a key set
  (CURVE, the ZAP gate), the frame checked and decoded as P's engine does
  (``block_id_counts``, then ``protocol.decode``).

each with a Heartbeat and with a Register of ``--blocks`` shuffled
block ids (its encoded frame), and each with the receiver's main thread idle
(blocked) or ``polling`` (a Python loop that sleeps ``--main-poll-us`` between
calls, as a caller polling the engine for results does: the engine thread
must then win the GIL back when it wakes). Per case the medians of: D's
send call, P's poll returning, the frame read, the frame decoded (stage
times after the sender's stamp taken just before its send).

``--tree PATH`` (repeatable) measures instead the Python work the
registration costs on its way, in each kvpush tree's own process, the trees
taking turns round by round: D's caller converting the block ids, D's checks
and staging wish (``unpack_choice``), the encode, and on P the frame's
precheck (``block_id_counts``), the decode, the registration's checks
(``registration_problem``) and the groups ``build_plan`` is given
(``group_tokens``). Each round first sleeps ``--gap-ms``, so every step runs
as it does on an engine thread that just woke up (cold caches), not in a
warm loop.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CASES = ("zmq", "zmq-curve", "side-channel")
STAGES = ("sent", "woke", "read", "decoded")


def register_frame(blocks: int, seed: int = 0) -> bytes:
    """The encoded Register of ``blocks`` shuffled block ids (out of twice as many), as D sends it."""
    import numpy as np

    from kvpush.core import protocol

    ids = tuple(int(b) for b in np.random.default_rng(seed).permutation(2 * blocks)[:blocks])
    grant = protocol.StagingGrant(0, 1 << 20)
    return protocol.encode(
        protocol.Register("t" * 36, "r" * 36, "decode-engine", 0, (ids,), 16 * blocks, 0, staging=grant)
    )


def _raw_sockets(ctx: Any, curve: bool, port: int | None) -> Any:
    """P's ROUTER (``port`` None) or D's DEALER to ``port``, CURVE or not (fixed test keys from ``zmq``)."""
    import zmq

    if port is None:
        sock = ctx.socket(zmq.ROUTER)
        if curve:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, _KEYS["server"][1])
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port("tcp://127.0.0.1")
        return sock
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        sock.setsockopt(zmq.CURVE_SERVERKEY, _KEYS["server"][0])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, _KEYS["client"][0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, _KEYS["client"][1])
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


_KEYS: dict[str, tuple[bytes, bytes]] = {}


def _main_poller(stop: threading.Event, every_s: float) -> None:
    """A caller's thread polling for results: a short Python call, then a sleep (the GIL is free while it sleeps)."""
    box: list[int] = []
    while not stop.is_set():
        box.append(len(box))
        del box[:]
        time.sleep(every_s)


def _receiver(conn: Any, case: str, keys_dir: str, main_poll_s: float) -> None:
    """P's side: sleep in a poller (socket + wake-up pipe), stamp each stage, answer the stamps."""
    import zmq

    from kvpush.core import peek, protocol

    _KEYS.update(conn.recv())
    ctx = zmq.Context()
    server = None
    if case == "side-channel":
        from kvpush.transport import key_set
        from kvpush.transport.side_channel import Server

        server = Server(ctx, "127.0.0.1", 0, key_set.server_keys("curve", keys_dir))
        sock, port = server.sock, server.port
    else:
        sock = _raw_sockets(ctx, case == "zmq-curve", None)
        port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    rfd, _wfd = os.pipe()
    poller = zmq.Poller()
    poller.register(rfd, zmq.POLLIN)
    poller.register(sock, zmq.POLLIN)
    stop = threading.Event()
    if main_poll_s > 0:
        threading.Thread(target=_main_poller, args=(stop, main_poll_s), daemon=True).start()
    conn.send(port)
    while True:
        events = dict(poller.poll(1000))
        woke = time.monotonic()
        if sock not in events:
            if conn.poll():
                break
            continue
        if server is not None:
            got: list[Any] = []

            def handle(ident: bytes, key: str, msg: Any, got: list[Any] = got) -> None:
                got.append((ident, time.monotonic()))

            read: list[float] = []

            def precheck(ident: bytes, key: str, frame: memoryview, read: list[float] = read) -> bool:
                read.append(time.monotonic())
                peek.block_id_counts(frame)
                return True

            server.deliver(handle, precheck)
            ident, decoded = got[0]
            t_read = read[0]
        else:
            ident, data = sock.recv_multipart()
            t_read = time.monotonic()
            peek.block_id_counts(data)
            protocol.decode(data)
            decoded = time.monotonic()
        sock.send_multipart([ident, json.dumps([woke, t_read, decoded]).encode()])
    stop.set()
    sock.close(0)
    if server is not None:
        server.close()


def _sender(port: int, case: str, keys_dir: str, frame: bytes, pings: int, gap_s: float) -> list[dict[str, float]]:
    """D's side: after a gap, stamp, send, and collect the receiver's stamps; stage times after the stamp."""
    import zmq

    ctx = zmq.Context()
    if case == "side-channel":
        from kvpush.transport import key_set
        from kvpush.transport.side_channel import Client

        client = Client(ctx, "127.0.0.1", port, key_set.client_keys("curve", keys_dir))
        sock = client.sock
    else:
        client, sock = None, _raw_sockets(ctx, case == "zmq-curve", port)
    rows: list[dict[str, float]] = []
    try:
        for i in range(pings + 1):
            time.sleep(gap_s)
            t0 = time.monotonic()
            sock.send(frame)
            sent = time.monotonic()
            if not sock.poll(10_000):
                raise TimeoutError(f"{case}: no answer")
            woke, read, decoded = json.loads(sock.recv())
            if i:  # the first one makes the connection (and its handshake)
                rows.append({"sent": sent - t0, "woke": woke - t0, "read": read - t0, "decoded": decoded - t0})
    finally:
        if client is not None:
            client.close()
        sock.close(0)
    return rows


def measure(blocks: int, pings: int, gap_s: float, main_poll_s: float) -> dict[str, Any]:
    """Every (case, size, receiver main thread) in its own receiver process; medians per stage."""
    import zmq

    from kvpush.transport import key_set

    keys_dir = tempfile.mkdtemp(prefix="kvpush-bench-trip-")
    key_set.make_key_set(keys_dir)
    keys = {"server": zmq.curve_keypair(), "client": zmq.curve_keypair()}
    _KEYS.update(keys)
    from kvpush.core import protocol

    frames = {
        "Heartbeat": protocol.encode(protocol.Heartbeat("decode-engine", 0, 1, 0.0)),
        f"Register, {blocks} blocks": register_frame(blocks),
    }
    spawn = mp.get_context("spawn")
    rows = []
    for case in CASES:
        for size, frame in frames.items():
            for main in ("idle", "polling"):
                here, there = spawn.Pipe()
                poll_s = main_poll_s if main == "polling" else 0.0
                proc = spawn.Process(target=_receiver, args=(there, case, keys_dir, poll_s), daemon=True)
                proc.start()
                here.send(keys)
                port = here.recv()
                try:
                    samples = _sender(port, case, keys_dir, frame, pings, gap_s)
                finally:
                    here.send("stop")
                    proc.join(10)
                med = {s: 1e3 * statistics.median(r[s] for r in samples) for s in STAGES}
                rows.append(
                    {
                        "case": case,
                        "message": size,
                        "frame_bytes": len(frame),
                        "receiver_main": main,
                        "pings": len(samples),
                        **{f"{s}_ms_median": v for s, v in med.items()},
                    }
                )
                print(f"{case:13s} {size:24s} main {main:8s} " + "  ".join(f"{s} {v:.3f}" for s, v in med.items()))
    return {
        "benchmark": "trip",
        "blocks": blocks,
        "gap_s": gap_s,
        "main_poll_s": main_poll_s,
        "host_cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": rows,
    }


_PATH_WORKER = r"""
import importlib, json, sys, time
import msgspec
import numpy as np
import kvpush


def first(*names):  # the first of these modules the tree has (a tree before the package layout: flat)
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            pass
    raise ModuleNotFoundError(names[0])


protocol = first("kvpush.core.protocol", "kvpush.protocol")
peek = first("kvpush.core.peek", "kvpush.core.protocol", "kvpush.protocol")
from kvpush.backends.base import CacheSpec
from kvpush.backends.host import HostBackend
from kvpush.config import Config
registration_problem = first("kvpush.prefill.hello", "kvpush.engine.peers").registration_problem
Asked = first("kvpush.decode.incoming", "kvpush.incoming").Asked
KVLayout = first("kvpush.core.layout", "kvpush.layout").KVLayout
group_tokens = first("kvpush.core.plan", "kvpush.plan").group_tokens
unpack_choice = first("kvpush.decode.registration", "kvpush.registration").unpack_choice
blocks, layers, gap = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
spec = CacheSpec(16, 1, 2, "bfloat16")
arrs = [np.zeros((layers, 2, 2 * blocks, 16, 1, 2), dtype=np.uint8) for _ in range(2)]
be = HostBackend()
lp, ld = (be.describe({f"layer{i}": a[i] for i in range(layers)}, spec) for a in arrs)
lp = msgspec.msgpack.decode(msgspec.msgpack.encode(lp), type=KVLayout)  # P's layout as D has it: decoded
rng = np.random.default_rng(0)
src = tuple(int(b) for b in rng.permutation(2 * blocks)[:blocks])
given = [int(b) for b in rng.permutation(2 * blocks)[:blocks]]  # what vLLM hands D: a list of ints
arrays = hasattr(protocol, "block_id_array")
cfg = Config.from_dict({"plan": "auto", "staging_bytes": 64 << 20})  # flat keys: what every tree takes
grant = protocol.StagingGrant(0, 1 << 20)
staging = type("Staging", (), {"size": 1 << 30})()  # D's staging region as P knows it: only its size is read
print(json.dumps({"kvpush": kvpush.__file__, "protocol": protocol.PROTOCOL_VERSION}))
sys.stdout.flush()
for line in sys.stdin:
    time.sleep(gap)
    t = [time.perf_counter()]
    if arrays:  # the tree's Receiver.register: one copy into arrays
        ids = tuple(protocol.block_id_array(g, "block_ids") for g in [given])
    else:
        ids = tuple(tuple(map(int, g)) for g in [given])
    t.append(time.perf_counter())
    ask = Asked("t" * 36, "r" * 36, ids, 16 * blocks, 0, ())
    unpack_choice(cfg, lp, ld, ask)
    t.append(time.perf_counter())
    frame = protocol.encode(protocol.Register("t" * 36, "r" * 36, "d", 0, ids, 16 * blocks, 0, staging=grant))
    t.append(time.perf_counter())
    peek.block_id_counts(frame)
    t.append(time.perf_counter())
    reg = protocol.decode(frame)
    t.append(time.perf_counter())
    assert not registration_problem(lp, ld, staging, reg)
    t.append(time.perf_counter())
    group_tokens((src,), ld, reg.block_ids, 0, ())
    t.append(time.perf_counter())
    names = ("d_convert", "d_unpack_choice", "d_encode", "p_counts", "p_decode", "p_checks", "p_group_tokens")
    print(json.dumps({**{f"{n}_s": b - a for n, a, b in zip(names, t, t[1:])}, "frame_bytes": len(frame)}))
    sys.stdout.flush()
"""
PATH_STEPS = ("d_convert", "d_unpack_choice", "d_encode", "p_counts", "p_decode", "p_checks", "p_group_tokens")


def path_work(trees: list[Path], blocks: int, layers: int, rounds: int, gap_s: float) -> dict[str, Any]:
    """The registration's Python work per tree (one worker process each), the trees taking turns."""
    import subprocess

    workers = []
    for tree in trees:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PATH_WORKER, str(blocks), str(layers), str(gap_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(tree)},
            cwd=tree,  # ``python -c`` puts the working directory first on sys.path
        )
        assert proc.stdout is not None
        workers.append((tree, proc, json.loads(proc.stdout.readline())))
    got: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    try:
        for i in range(rounds + 2):
            for tree, proc, _ in workers if i % 2 else workers[::-1]:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                sample = json.loads(proc.stdout.readline())
                if i >= 2:
                    got[str(tree)].append(sample)
    finally:
        for _, proc, _ in workers:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)
    rows = []
    for tree, _, info in workers:
        samples = got[str(tree)]
        med = {f"{k}_ms_median": 1e3 * statistics.median(x[f"{k}_s"] for x in samples) for k in PATH_STEPS}
        total = 1e3 * statistics.median(sum(x[f"{k}_s"] for k in PATH_STEPS) for x in samples)
        rows.append(
            {"tree": str(tree), **info, "frame_bytes": samples[0]["frame_bytes"], **med, "total_ms_median": total}
        )
        print(
            f"{tree!s:24s} v{info['protocol']} frame {samples[0]['frame_bytes']} B  "
            + "  ".join(f"{k} {v:.3f}" for k, v in med.items())
            + f"  total {total:.3f} ms"
        )
    return {
        "benchmark": "trip path work",
        "blocks": blocks,
        "layers": layers,
        "rounds": rounds,
        "gap_s": gap_s,
        "host_cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush bench trip", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1024, help="block ids in the Register (default 1024)")
    ap.add_argument("--pings", type=int, default=200, help="messages per case (default 200)")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="sender's pause before each message (default 2)")
    ap.add_argument("--main-poll-us", type=float, default=500.0, help="polling main thread's sleep (default 500)")
    ap.add_argument("--tree", type=Path, action="append", help="measure the registration's Python work per tree")
    ap.add_argument("--layers", type=int, default=64, help="layers of the --tree layouts (x K/V regions)")
    ap.add_argument("--out", type=Path, default=Path("results/trip"))
    args = ap.parse_args(argv)
    if args.tree:
        result = path_work([t.resolve() for t in args.tree], args.blocks, args.layers, args.pings, args.gap_ms / 1e3)
    else:
        result = measure(args.blocks, args.pings, args.gap_ms / 1e3, args.main_poll_us / 1e6)
    result["command"] = "kvpush bench trip " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    name = "path_work.json" if args.tree else "trip.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
