"""Measure, on the NIXL installed here, the LIBFABRIC behaviours kvpush's backend traits describe.

Run it under the LIBFABRIC test environment (``tools/libfabric/setup.sh --ld-path``)::

    LD_LIBRARY_PATH=$(bash tools/libfabric/setup.sh --ld-path) python tools/libfabric/probe_traits.py

Every agent is driven with UCX's traits (one call per poll, errors taken as isolated, peers unloaded
when given up), so what is printed is the plugin's own behaviour, not kvpush's handling of it:

* ``drain``: polls (1 ms apart) each side needs for one WRITE of many small descriptors, with one NIXL
  call per poll and with LIBFABRIC's ``drain_calls`` (``BackendTraits.drain_calls``);
* ``reload``: whether a WRITE to a live peer that was unloaded and loaded again lands within
  ``RELOAD_WAIT_S`` (``BackendTraits.reloads_live_peer``);
* ``isolation``: of the WRITEs to a live peer in flight while another peer is killed, how many fail
  (``BackendTraits.peer_errors_isolated``);
* ``dead``: the states of WRITEs to a peer killed mid-write, ``DEAD_WAIT_S`` later and then once the peer
  is unloaded, its failed completions read by notification calls before each poll, as kvpush does where
  errors are not isolated (``BackendTraits.dead_peer_writes_end``; ``settle`` False: by the polls alone);
* ``first``: whether the first WRITE to a peer killed after it was loaded ends or blocks its post, the peer
  loaded as such or greeted as it was loaded (``BackendTraits.connects_on_load``), the writer's agent
  polled for ``FIRST_IDLE_S`` between the kill and the post or not.

Results go to docs/libfabric.md; kvpush's traits per NIXL version are in kvpush/core/nixl_backends.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvpush.backends.base import MemKind, MemRegistration
from kvpush.core.nixl_backends import LIBFABRIC, UCX
from kvpush.core.outcome import XferState
from kvpush.transport.nixl_agent import Agent, nixl_version

POLL_S = 0.001
RELOAD_WAIT_S = 15.0
"""Longer than any WRITE here takes, far shorter than the plugin's 60 s handshake timeout."""
DEAD_WAIT_S = 8.0
"""How long WRITEs to a killed peer are polled before the peer is unloaded (they fail within 0.1 s where
they end by themselves)."""


FIRST_WAIT_S = 15.0
"""How long a first WRITE to a killed peer is given before its writer is killed (it ends at once where it ends)."""
FIRST_IDLE_S = 1.0
"""How long the writer's agent is polled between the peer's death and the post, in the cases that poll it."""


def _agent(name: str, drain_calls: int = 1) -> Agent:
    """A LIBFABRIC agent driven as UCX is (``drain_calls`` NIXL calls per poll)."""
    agent = Agent(name, ("LIBFABRIC",))
    agent.traits = replace(UCX, drain_calls=drain_calls)
    return agent


def _buffer(agent: Agent, size: int) -> np.ndarray:
    buf = np.zeros(size, dtype=np.uint8)
    agent.register([MemRegistration(buf.ctypes.data, size, 0, MemKind.DRAM)])
    return buf


def _receiver(name: str, size: int, drain_calls: int, out: Any, stop: Any) -> None:
    """A peer that polls its agent every ``POLL_S`` and reports each notification with the polls it took."""
    agent = _agent(name, drain_calls)
    buf = _buffer(agent, size)
    buf[:] = 0
    out.put(("ready", agent.metadata(), buf.ctypes.data))
    polls = 0
    while not stop.is_set():
        polls += 1
        for _peer, msg in agent.notifs(drain=True):
            out.put(("notif", msg.decode(), polls, int(buf[: 1 << 16].sum())))
            polls = 0
        time.sleep(POLL_S)


def _rows(addr: int, count: int, size: int) -> np.ndarray:
    return np.array([(addr + i * size, size, 0) for i in range(count)], dtype=np.int64)


def _write(agent: Agent, *args: Any) -> Any:
    """Create and post one WRITE, as the engine does (``prepare_write``, then ``post``); returns its handle."""
    handle = agent.prepare_write(*args)
    agent.post(handle)
    return handle


def _wait(agent: Agent, handle: Any, limit_s: float = 60.0) -> tuple[XferState, int]:
    polls, deadline = 0, time.monotonic() + limit_s
    while time.monotonic() < deadline:
        polls += 1
        state = agent.state(handle)
        if state is not XferState.PROC:
            return state, polls
        time.sleep(POLL_S)
    return XferState.PROC, polls


def _start(ctx: Any, name: str, size: int, drain_calls: int = 1) -> tuple[Any, Any, Any, bytes, int]:
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_receiver, args=(name, size, drain_calls, q, stop), daemon=True)
    proc.start()
    _, meta, addr = q.get(timeout=60)
    return proc, q, stop, meta, addr


def drain(descs: int = 1024, desc_size: int = 32 << 10) -> dict[str, Any]:
    """Polls each side needs for one WRITE of ``descs`` descriptors, per NIXL calls per poll."""
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"descriptors": descs, "descriptor_bytes": desc_size}
    for calls in (1, LIBFABRIC.drain_calls):
        proc, q, stop, meta, raddr = _start(ctx, f"D{calls}", descs * desc_size, calls)
        p = _agent(f"P{calls}", calls)
        src = _buffer(p, descs * desc_size)
        src[:] = 7
        peer = p.add_peer(meta)
        t0 = time.monotonic()
        handle = _write(
            p, _rows(src.ctypes.data, descs, desc_size), "DRAM", _rows(raddr, descs, desc_size), "DRAM", peer, b"w"
        )
        state, p_polls = _wait(p, handle)
        p_s = time.monotonic() - t0
        _, _, d_polls, _ = q.get(timeout=60)
        out[f"calls_{calls}"] = {"state": state.value, "p_polls": p_polls, "d_polls": d_polls, "p_s": round(p_s, 3)}
        stop.set()
        proc.join(10)
        p.close()
    return out


def _reload_child(meta: bytes, raddr: int, out: Any) -> None:
    p = _agent("P")
    src = _buffer(p, 1 << 16)
    src[:] = 1
    res = {}
    for step in ("first", "reloaded"):
        peer = p.add_peer(meta)
        t0 = time.monotonic()
        handle = _write(p, _rows(src.ctypes.data, 1, 1 << 16), "DRAM", _rows(raddr, 1, 1 << 16), "DRAM", peer, b"r")
        state, _ = _wait(p, handle, RELOAD_WAIT_S)
        res[step] = {"state": state.value, "s": round(time.monotonic() - t0, 3)}
        out.put(dict(res))
        p.release(handle)
        p.remove_peer(peer)  # UCX's traits: really unloaded


def reload() -> dict[str, Any]:
    """Whether a live peer unloaded and loaded again is written to at once (else: the post blocks, and the
    writer is killed after ``RELOAD_WAIT_S``)."""
    ctx = mp.get_context("spawn")
    proc, _, stop, meta, raddr = _start(ctx, "D", 1 << 16)
    q = ctx.Queue()
    child = ctx.Process(target=_reload_child, args=(meta, raddr, q))
    child.start()
    child.join(RELOAD_WAIT_S + 20)
    res: dict[str, Any] = {}
    while not q.empty():
        res = q.get()
    if child.is_alive():
        child.kill()
        child.join()
        res.setdefault("reloaded", {"state": "BLOCKED", "s": f">{RELOAD_WAIT_S}"})
    stop.set()
    proc.join(10)
    return res


def isolation(runs: int = 3) -> dict[str, Any]:
    """Of three 8 MiB WRITEs to a live D2 in flight while D1 is killed, how many fail (per run)."""
    ctx = mp.get_context("spawn")
    size, descs = 8 << 20, 128
    failed = []
    for run in range(runs):
        d1 = _start(ctx, f"D1r{run}", 3 * size)
        d2 = _start(ctx, f"D2r{run}", 3 * size)
        p = _agent(f"Pr{run}")
        src = _buffer(p, 3 * size)
        src[:] = 3
        handles: dict[str, list[Any]] = {"D1": [], "D2": []}
        for key, (_, _, _, meta, raddr) in (("D1", d1), ("D2", d2)):
            peer = p.add_peer(meta)
            for i in range(3):
                rows = _rows(src.ctypes.data + i * size, descs, size // descs)
                rrows = _rows(raddr + i * size, descs, size // descs)
                handles[key].append(_write(p, rows, "DRAM", rrows, "DRAM", peer, f"{key}{i}".encode()))
        time.sleep(0.02)
        d1[0].kill()
        states = [_wait(p, h, 30.0)[0].value for h in handles["D2"]]
        failed.append(sum(s != "DONE" for s in states))
        for d in (d1, d2):
            d[2].set()
            d[0].join(10)
        p.close()
    return {"runs": runs, "d2_writes_failed_per_run": failed}


def dead(settle: bool = True) -> dict[str, Any]:
    """States of three 8 MiB WRITEs to a peer killed mid-write: after ``DEAD_WAIT_S`` of polls, then once it
    is unloaded."""
    ctx = mp.get_context("spawn")
    size, descs = 8 << 20, 128
    proc, _, stop, meta, raddr = _start(ctx, "D", 3 * size)
    p = _agent("P")
    p.traits = replace(p.traits, peer_errors_isolated=not settle)
    src = _buffer(p, 3 * size)
    peer = p.add_peer(meta)
    handles = [
        _write(
            p,
            _rows(src.ctypes.data + i * size, descs, size // descs),
            "DRAM",
            _rows(raddr + i * size, descs, size // descs),
            "DRAM",
            peer,
            b"d",
        )
        for i in range(3)
    ]
    time.sleep(0.02)
    proc.kill()
    out: dict[str, Any] = {}
    for step in ("polled", "unloaded"):
        if step == "unloaded":
            p.remove_peer(peer)  # UCX's traits: really unloaded
        t0, states = time.monotonic(), [XferState.PROC]
        while XferState.PROC in states and time.monotonic() - t0 < DEAD_WAIT_S:
            states = [p.state(h) for h in handles]
            time.sleep(POLL_S)
        out[step] = {"states": [st.value for st in states], "s": round(time.monotonic() - t0, 2)}
    stop.set()
    p.close()
    return out


def _first_child(meta: bytes, raddr: int, greet: bool, poll_s: float, peer_pid: int, out: Any) -> None:
    p = _agent("P")
    p.traits = replace(p.traits, connects_on_load=not greet)
    src = _buffer(p, 1 << 16)
    t0 = time.monotonic()
    peer = p.add_peer(meta, greeting=b"greeting" if greet else b"")
    out.put({"load_s": round(time.monotonic() - t0, 3)})
    os.kill(peer_pid, signal.SIGKILL)
    time.sleep(0.2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < poll_s:
        p.notifs()
        time.sleep(POLL_S)
    t0 = time.monotonic()
    try:
        handle = _write(p, _rows(src.ctypes.data, 1, 1 << 16), "DRAM", _rows(raddr, 1, 1 << 16), "DRAM", peer, b"f")
        state = _wait(p, handle, FIRST_WAIT_S)[0].value
    except Exception as exc:  # the post itself failed: it ended
        state = f"post raised {exc}"
    out.put({"write": state, "s": round(time.monotonic() - t0, 3)})


def first() -> dict[str, Any]:
    """The first WRITE to a peer killed after it was loaded: ended (failed or raised) or blocked in its post
    (the writer is killed after ``FIRST_WAIT_S``), per greeting at load and polling between kill and post."""
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {}
    for greet in (False, True):
        for poll_s in (0.0, FIRST_IDLE_S):
            proc, _, stop, meta, raddr = _start(ctx, "D", 1 << 16)
            q = ctx.Queue()
            child = ctx.Process(target=_first_child, args=(meta, raddr, greet, poll_s, proc.pid, q))
            child.start()
            child.join(FIRST_WAIT_S + 20)
            res: dict[str, Any] = {}
            while not q.empty():
                res.update(q.get())
            if child.is_alive():
                child.kill()
                child.join()
                res.setdefault("write", f"BLOCKED in the post (> {FIRST_WAIT_S} s)")
            out[f"{'greeted' if greet else 'loaded'}, polled {poll_s} s"] = res
            stop.set()
            proc.join(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("drain", "reload", "isolation", "dead", "first"), action="append")
    ap.add_argument("--runs", type=int, default=3, help="isolation runs")
    args = ap.parse_args()
    which = args.only or ["drain", "reload", "isolation", "dead", "first"]
    result: dict[str, Any] = {"nixl": nixl_version()}
    for name in which:
        if name == "isolation":
            result[name] = isolation(args.runs)
        elif name == "dead":
            result[name] = {"settled": dead(True), "polls_alone": dead(False)}
        else:
            result[name] = globals()[name]()
        print(json.dumps({name: result[name]}), flush=True)
    print("KVPUSH_PROBE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
