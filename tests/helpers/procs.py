"""Spawn-able worker processes for the multi-process NIXL tests.

The two-process harness is the conformance suite's (:mod:`kvpush.conformance.worker`):
the same command protocol (``(op, args)`` answered ``("ok", value)`` or
``("err", traceback)``, so a failure inside a worker is a test failure with
its traceback, not a hang), the same ``Node`` handle, the same ops that start
engines and drive them. What the engine tests need on top is here:

* host caches of plain bytes: :class:`Geom` keeps ``head_dim`` *bytes* per
  head whatever its ``dtype`` label says (peers compare the label; a transfer
  only sees bytes), and D's caches start as :data:`SENTINEL`, so a block D
  did not register must still hold it;
* ops to abort, fill blocks (vLLM reusing them), count engine loops, fetch a layout, make a bare NIXL agent,
  read the warnings an engine logged, and close an engine while keeping its
  memory mapped (a peer may still write into it);
* a fast exit: a worker skips the interpreter's slow teardown of NIXL/UCX
  globals (~3 s) once its engines and agents are closed. The conformance
  worker does not, since a backend that crashes in teardown must show there.

The tests keep one P worker and one D worker alive per module because the
first NIXL/UCX agent of a process costs ~4 s to start while later ones cost
~50 ms.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvpush.conformance import model
from kvpush.conformance import worker as conformance
from kvpush.conformance.target import Target
from kvpush.transport import key_set

SENTINEL = 0xA5
"""Byte that fills D's caches before a test: any block D did not register must still hold it."""

# By module path, not entry point: needs no installed distribution metadata.
HOST = Target("kvpush.backends.host:HostBackend")


@dataclass(frozen=True)
class Geom(model.Geom):
    """The conformance model's geometry with this suite's defaults, over byte arrays.

    ``dtype`` is only the *label* the layout carries (peers compare it); the
    buffers are uint8 with ``head_dim`` bytes per head, which is all a
    transfer sees, so byte counts in the tests read ``heads * head_dim``.
    """

    layers: int = 3
    num_blocks: int = 64
    head_dim: int = 16
    dtype: str = "bfloat16"
    blocks_first: bool = False
    """Lay each layer out blocks first in memory (block ``b``'s K, then its V: vLLM's ``[blocks, 2, ...]``), the
    logical view (``shape``) staying K/V first: the engine reads the physical order from the strides."""

    @property
    def head_bytes(self) -> int:
        return self.head_dim


def dealer(addr: tuple[str, int], keys: Any = None, ctx: Any = None) -> Any:
    """A raw DEALER to a P side channel, with ``keys`` (a D's ``ClientKeys``) or without any: what a test's
    own peer (buggy, hostile, or replaying) talks through. It never blocks a send."""
    import zmq

    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 0)
    s.setsockopt(zmq.SNDTIMEO, 0)
    if keys is not None:
        s.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
        s.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        s.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    s.connect(f"tcp://{addr[0]}:{addr[1]}")
    return s


def answer(sock: Any, timeout_s: float = 5.0) -> Any:
    """P's next answer on a raw D socket (``dealer``): a hello reply, a failure, ... past the frames P says just
    before an ok hello reply (``Features``, ``LinkKey``), which a raw peer has no use for."""
    from kvpush.core import protocol

    deadline = time.monotonic() + timeout_s
    while True:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "P did not answer"
        msg = protocol.decode(sock.recv())
        if not isinstance(msg, protocol.Features | protocol.LinkKey):
            return msg


def make_cache(geom: Geom, seed: int | None) -> np.ndarray:
    """Random bytes (P, the conformance payload of ``seed``) or the sentinel everywhere (D, ``seed=None``)."""
    if seed is None:
        return np.full(geom.shape(), SENTINEL, dtype=np.uint8)
    return model.payload(geom, seed)


def assert_same(actual: np.ndarray, expected: np.ndarray, geom: Geom, what: str = "D's cache") -> None:
    """The conformance model's byte check, naming bytes that still hold the sentinel."""
    model.assert_same(actual, expected, geom, what, sentinel=SENTINEL)


class _Lines(logging.Handler):
    """Keeps kvpush's warnings so a test can assert what an engine complained about.

    (Exceptions that escape an engine loop are the conformance worker's
    ``capture``; ``op_crashes`` reads them from there.)"""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


class Worker(conformance.Worker):
    """The conformance worker over :func:`make_cache` caches, with the engine tests' extra ops."""

    def __init__(self, name: str, target: Target) -> None:
        super().__init__(name, target)
        self.agents: list[Any] = []
        self.progressing: list[tuple[threading.Event, threading.Thread]] = []
        self.retired: list[Any] = []
        self.override: Target | None = None
        self.rogues: dict[str, tuple[Any, str, threading.Lock, threading.Event]] = {}
        self.taps: dict[str, list[tuple[str, bytes]]] = {}
        self.warnings = _Lines()
        logging.getLogger("kvpush").addHandler(self.warnings)
        logging.getLogger("kvpush").setLevel(logging.INFO)

    def rank_backend(self, reference: bool) -> Any:
        if self.override is not None and not reference:
            return self.override.make()
        return super().rank_backend(reference)

    def op_use_backend(self, target: str | None) -> None:
        """Engines started from now on run on this backend (``module:Class``); None: back to the host backend."""
        self.override = Target(target) if target else None

    def rank_cache(self, backend: Any, geom: model.Geom, device: int, seed: int | None) -> dict[str, Any]:
        """Layers of one uint8 array (no backend ``make_test_cache``: the dtype is a label here)."""
        assert isinstance(geom, Geom), "the engine tests' workers take tests/helpers/procs.py's Geom"
        arr = make_cache(geom, seed)
        if geom.blocks_first:  # the same logical bytes, stored [layers, blocks, 2, ...]
            shape = geom.shape()
            physical = np.empty((shape[0], shape[2], shape[1], *shape[3:]), dtype=np.uint8)
            arr, logical = physical.swapaxes(1, 2), arr
            arr[...] = logical
        return {f"layer{i}": arr[i] for i in range(geom.layers)}

    def op_snapshot(self, key: str, blocks: list[int] | None = None) -> np.ndarray:
        """The whole cache's logical bytes (a blocks-first cache read through its logical view); ``blocks``:
        only theirs (``[..., blocks, ...]`` of the whole), for a large cache of which a test checks a few."""
        r = self.ranks[key]
        if isinstance(r.geom, Geom) and r.geom.blocks_first:
            whole = np.stack([np.asarray(t) for t in r.kv.values()])
        else:
            whole = super().op_snapshot(key)
        return whole if blocks is None else whole[:, :, blocks]

    def op_blocks_not(self, key: str, blocks: list[int], value: int) -> list[int]:
        """Those of ``blocks`` that hold some byte other than ``value`` (checked here: no cache crosses)."""
        snap = self.op_snapshot(key, blocks)
        return [b for i, b in enumerate(blocks) if (snap[:, :, i] != value).any()]

    def op_prefill_started(self, key: str, tid: str, rid: str, blocks: list[int], n: int) -> None:
        self.ranks[key].engine.prefill_started(tid, rid, [blocks], n)

    def op_compute_layers(self, key: str, lo: int, hi: int, seed: int) -> None:
        """Stand-in for P's forward writing layers ``[lo, hi)``: fresh bytes there, nothing else touched."""
        rng = np.random.default_rng(seed)
        for i in range(lo, hi):
            layer = self.ranks[key].kv[f"layer{i}"]
            layer[...] = rng.integers(0, 256, layer.shape, dtype=np.uint8)

    def op_layer_written(self, key: str, tids: list[str], layer: int) -> None:
        self.ranks[key].engine.layer_written(tids, layer)

    def op_index_cost(self, key: str, us: float) -> float:
        """P rank ``key`` weighs ``us`` per index when it chooses how to make a direct part's WRITE (its NIXL's
        own figure otherwise: ``kvpush.transport.nixl_agent.index_cost_us``), so that a test's choices do not
        depend on the NIXL version; returns the figure it replaced."""
        engine = self.ranks[key].engine

        def swap() -> float:
            old = engine.runner.costs.index_s
            engine.runner.costs = replace(engine.runner.costs, index_s=us * 1e-6)
            return old * 1e6

        return float(engine.call_sync(swap))

    def op_receiver(
        self,
        key: str,
        geom: model.Geom,
        cfg: dict[str, Any],
        engine_id: str,
        seed: int | None = None,
        ref: bool = False,
    ) -> None:
        """A D rank; its cache holds the sentinel unless ``seed`` is given."""
        self.start_rank(key, "receiver", geom, cfg, engine_id, seed, ref)

    def op_abort(self, key: str, tid: str, reason: str) -> None:
        self.ranks[key].engine.abort(tid, reason)

    def op_fence(self, key: str, peer: tuple[str, int, int], reason: str) -> None:
        """The operator fenced P instance ``peer`` for good (the connector's fence order)."""
        from kvpush.engine import PeerAddress

        self.ranks[key].engine.fence(PeerAddress(*peer), reason)

    def op_cancel(self, key: str, tid: str, rid: str, peer: tuple[str, int, int], reason: str) -> None:
        """D gives up on a transfer it never registered (the connector's cancel order)."""
        from kvpush.engine import PeerAddress

        self.ranks[key].engine.cancel(tid, rid, PeerAddress(*peer), reason, key_set.session_capability(tid))

    def op_fill(self, key: str, blocks: list[int], value: int) -> None:
        """Write ``value`` into every byte of these blocks, as vLLM reusing them for another request would."""
        for layer in self.ranks[key].kv.values():
            layer[:, blocks] = value

    def op_stop_at_post(self, key: str, look_first: bool = False) -> None:
        """The engine's next WRITE post stops this whole process (SIGSTOP) just before it is handed to NIXL:
        a P frozen mid-push, its WRITE decided, at a moment the test does not have to guess (a WRITE already
        handed over may complete at once, within the post, over a shared-memory transport). ``look_first``:
        once resumed, P's peer table looks at its D ranks' silence before anything more is read from its side
        channel, the order its timer meets when ZMQ's own thread has not yet moved what D sent meanwhile."""
        import signal

        engine = self.ranks[key].engine
        agent = engine.agent
        post = agent.post

        def stop_then_post(handle: Any) -> Any:
            agent.post = post
            # To this very thread: it then stops the process before it returns from the call. A signal to the
            # process may be taken by another thread while this one goes on, into the post (a small WRITE
            # then lands before the process stops).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            if look_first:
                engine.peers.check(time.monotonic())  # on the engine's thread: the post is its call
            return post(handle)

        agent.post = stop_then_post

    def op_run_at_post(self, key: str, commands: list[list[str]], nth: int = 1) -> None:
        """The engine's ``nth`` WRITE post from now runs ``commands`` (argv lists, each must succeed) right after
        NIXL took the WRITE, on the engine's thread: a network cut mid-push (``helpers_netns``), at a moment the
        test does not have to guess (a whole WRITE may cross before a test process that polls would act)."""
        import subprocess

        agent = self.ranks[key].engine.agent
        post = agent.post
        seen = 0

        def post_then_run(handle: Any, *args: Any) -> Any:
            nonlocal seen
            state = post(handle, *args)
            seen += 1
            if seen == nth:
                agent.post = post
                for argv in commands:
                    subprocess.run(argv, check=True, capture_output=True, timeout=30)
            return state

        agent.post = post_then_run

    def op_copies(self, key: str) -> list[tuple[str, int, float, float | None]]:
        """The copies this engine's backend made, when each started and landed (``DeferredHostBackend.timeline``;
        [] for a backend that copies synchronously)."""
        timeline = getattr(self.ranks[key].backend, "timeline", None)
        return timeline() if timeline is not None else []

    def op_loops(self, key: str) -> int:
        return int(self.ranks[key].engine.loops)

    def op_mute_posting(self, key: str) -> None:
        """P stops telling D that a push starts: as if every ``Posting`` were lost on the way."""
        self.ranks[key].engine.send_postings = False

    def op_forge_notif(self, key: str, agent: str, msg: bytes, d_rank: tuple[str, int] | None = None) -> None:
        """This P rank's NIXL agent (a real P of the fleet's key, which has D's metadata because D said hello
        to it) sends D's agent ``msg`` as a notification: a Completion or Failure of a transfer D registered
        with another P. ``d_rank`` (engine id, rank): sealed first with this P rank's own key of that D rank's
        session, as everything it sends there is (the seal verifies: D must still refuse it as foreign)."""
        engine = self.ranks[key].engine

        def send() -> None:
            peer = engine.peers.get(d_rank) if d_rank is not None else None
            engine.agent.send_notif(agent, peer.seal(msg) if peer is not None else msg)

        engine.call_sync(send)

    def op_rogue(self, name: str, metadata: bytes, timeout_s: float = 10.0) -> str:
        """A NIXL agent under the name ``name`` (another engine's agent name: a name is the agent's own choice),
        with the peer of ``metadata`` loaded (what any holder of that peer's metadata can do), progressed by a
        thread of its own as an engine would; returns the loaded peer's agent name ("": the load did not end
        within ``timeout_s``, as where loading connects and the peer does not progress its agent). ``rogue_send``
        sends as it. Never closed nor joined: a call the peer never answers may leave its threads blocked in
        NIXL, and the worker's exit does not wait for them."""
        from kvpush.transport.nixl_agent import Agent

        agent = Agent(name, self.target.nixl_backends)
        lock = threading.Lock()
        loaded: list[str] = []

        def load() -> None:
            with lock:
                loaded.append(agent.add_peer(metadata))

        t = threading.Thread(target=load, name=f"rogue-load-{name}", daemon=True)
        t.start()
        t.join(timeout_s)
        stop = threading.Event()
        self.rogues[name] = (agent, loaded[0] if loaded else "", lock, stop)
        if not loaded:
            return ""
        t = threading.Thread(target=_progress_until, args=(agent, stop, None, lock), name=f"rogue-{name}", daemon=True)
        t.start()
        return loaded[0]

    def op_rogue_send(self, name: str, msgs: list[bytes], timeout_s: float = 5.0) -> int:
        """The agent ``rogue`` made under ``name`` sends its peer these notifications; how many were sent within
        ``timeout_s`` (a send NIXL refuses is counted out; one that never returns, as over a connection the peer
        never accepts, leaves the rest unsent and the agent unusable)."""
        agent, peer, lock, _ = self.rogues[name]
        sent: list[int] = []
        if not peer:
            return 0

        def send() -> None:
            for msg in msgs:
                with lock:
                    try:
                        agent.send_notif(peer, msg)
                    except Exception as exc:
                        logging.getLogger("kvpush.tests.rogue").warning("%s: send_notif failed: %s", name, exc)
                        continue
                sent.append(1)

        t = threading.Thread(target=send, name=f"rogue-send-{name}", daemon=True)
        t.start()
        t.join(timeout_s)
        return len(sent)

    def op_tap_notifs(self, key: str) -> None:
        """From now on, keep a copy of every NIXL notification this engine's agent hands the engine (``tapped``):
        what a wire recording would give a replayer."""
        agent = self.ranks[key].engine.agent
        notifs = agent.notifs
        kept: list[tuple[str, bytes]] = []

        def tapped(drain: bool = False) -> list[tuple[str, bytes]]:
            got = notifs(drain=drain)
            kept.extend(got)
            return got

        agent.notifs = tapped
        self.taps[key] = kept

    def op_tapped(self, key: str) -> list[tuple[str, bytes]]:
        return list(self.taps[key])

    def op_wakeups(self, key: str) -> int:
        return int(self.ranks[key].engine.wakeups)

    def op_layout(self, key: str) -> bytes:
        import msgspec

        return msgspec.msgpack.encode(self.ranks[key].engine.layout)

    def op_bare_agent(self, name: str) -> bytes:
        """A NIXL agent that belongs to no engine: its metadata lets a raw socket say a valid hello.

        A thread drives its progress every millisecond, as a D's engine does from the moment it says
        hello: on LIBFABRIC's tcp provider the handshake P sends when it loads the metadata completes
        only once the peer's agent progresses (docs/libfabric.md)."""
        from kvpush.transport.nixl_agent import Agent

        a = Agent(name, self.target.nixl_backends)
        self.agents.append(a)
        meta = a.metadata()
        stop = threading.Event()
        t = threading.Thread(target=_progress_until, args=(a, stop), name=f"progress-{name}", daemon=True)
        t.start()
        self.progressing.append((stop, t))
        return meta

    def op_reload_live_peer(self, mib: int) -> list[bool]:
        """Two agents in this process, the receiver progressed by a thread as a D's engine does: write,
        give the receiver up and load its (unchanged) metadata again, write again. Returns, per write,
        whether the WRITE ended well and the receiver, once notified, holds exactly the sender's bytes."""
        from kvpush.backends.base import MemRegistration
        from kvpush.transport.nixl_agent import Agent

        backends, n = self.target.nixl_backends, mib << 20
        p, d = Agent("reload-P", backends), Agent("reload-D", backends)
        self.agents += [p, d]
        src, dst = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        self.retired.append((src, dst))
        p.register([MemRegistration(src.ctypes.data, n, 0, "DRAM")])
        d.register([MemRegistration(dst.ctypes.data, n, 0, "DRAM")])
        notified: list[bytes] = []
        stop = threading.Event()
        t = threading.Thread(target=_progress_until, args=(d, stop, notified), name="progress-reload-D", daemon=True)
        t.start()
        self.progressing.append((stop, t))
        rows = 16
        local = np.array([(src.ctypes.data + i * n // rows, n // rows, 0) for i in range(rows)], np.int64)
        remote = np.array([(dst.ctypes.data + i * n // rows, n // rows, 0) for i in range(rows)], np.int64)
        landed = []
        name = p.add_peer(d.metadata(), d.name)
        for value in (1, 2):
            src[:] = value
            handle = p.prepare_write(local, "DRAM", remote, "DRAM", name, b"w%d" % value)
            state = p.post(handle)
            while state.name == "PROC":
                state = p.state(handle)
            p.release(handle)
            deadline = time.monotonic() + 10.0
            while b"w%d" % value not in notified and time.monotonic() < deadline:
                time.sleep(1e-3)
            landed.append(state.name == "DONE" and bool((dst == value).all()))
            p.remove_peer(name)  # given up (declared dead, or it said hello again) ...
            name = p.add_peer(d.metadata(), d.name)  # ... and back with the same session
        return landed

    def op_nixl_backends(self) -> tuple[str, ...]:
        """The NIXL backends this worker's agents were created with (its warm-up agent's)."""
        return tuple(self.warmup.backends)

    def op_nixl_traits(self) -> tuple[str, Any]:
        """The NIXL version this worker runs and the backend traits its agents drive (its warm-up agent's)."""
        return self.warmup.nixl_version, self.warmup.traits

    def op_logs(self) -> list[str]:
        lines, self.warnings.lines = self.warnings.lines, []
        return lines

    def op_crashes(self) -> list[str]:
        lines, self.capture.crashes = self.capture.crashes, []
        return lines

    def op_gdn_engine(
        self, key: str, kind: str, cfg: dict[str, Any], engine_id: str, seed: int | None, ssm_dtype: str = "float32"
    ) -> tuple[str, int] | None:
        """A P (``sender``) or D (``receiver``) rank over a vLLM-shaped GDN hybrid cache (``helpers_gdn``) that
        the connector described; its pool filled from ``seed`` (None: the sentinel). Returns P's address."""
        import helpers_gdn as gdn
        import torch

        from kvpush.conformance.worker import Rank
        from kvpush.engine import Receiver, Sender

        config = gdn.kv_cache_config(gdn.state_spec((torch.bfloat16, getattr(torch, ssm_dtype))))
        kv = gdn.caches(config)
        buf = gdn.pool(kv).numpy()
        buf[:] = SENTINEL if seed is None else np.random.default_rng(seed).integers(0, 256, buf.size, np.uint8)
        backend = self.rank_backend(False)
        layout = gdn.connector_layout(kv, config, backend)
        cls = Sender if kind == "sender" else Receiver
        engine = cls(self.engine_config(cfg), backend, layout, engine_id, rank=0, tp_size=1)
        self.ranks[key] = Rank(engine, backend, kv, None)
        return engine.address if kind == "sender" else None

    def op_gdn_prefill(self, key: str, tid: str, rid: str, blocks: list[list[int]], n: int) -> None:
        r = self.ranks[key]
        r.engine.prefill_finished(tid, rid, blocks, n, ready=r.backend.record_ready())

    def op_gdn_register(
        self, key: str, tid: str, rid: str, peer: tuple[str, int, int], blocks: list[list[int]], n: int
    ) -> None:
        from kvpush.engine import PeerAddress

        self.ranks[key].engine.register(
            tid, rid, PeerAddress(*peer), blocks, n, 0, capability=key_set.session_capability(tid)
        )

    def op_gdn_pool(self, key: str) -> np.ndarray:
        """A copy of the rank's whole pool (every layer's bytes)."""
        import helpers_gdn as gdn

        return gdn.pool(self.ranks[key].kv).numpy().copy()

    def op_close(self, key: str, keep_memory: bool = False) -> dict[str, Any]:
        """Close an engine; ``keep_memory`` keeps its cache mapped, for a peer that may still write into it."""
        if keep_memory:
            self.retired.append(self.ranks[key].kv)
        return super().op_close(key)

    def op_exit(self) -> dict[str, Any]:
        for *_, stop in self.rogues.values():
            stop.set()
        report = super().op_exit()
        for stop, t in self.progressing:
            stop.set()
            t.join()
        for a in self.agents:
            a.close()
        return report


def _progress_until(
    agent: Any, stop: threading.Event, notified: list[bytes] | None = None, lock: threading.Lock | None = None
) -> None:
    """Drive ``agent``'s progress until ``stop`` (the only thread that touches it from now on, or each call under
    ``lock``, shared with whoever else calls it); the notifications it brings go to ``notified`` when given."""
    while not stop.wait(1e-3):
        if lock is None:
            got = agent.notifs()
        else:
            with lock:
                got = agent.notifs()
        if notified is not None:
            notified.extend(msg for _, msg in got)


def worker_main(
    name: str, target: Target, cmds: mp.Queue, answers: mp.Queue, netns: tuple[str, dict[str, str]] | None = None
) -> None:
    """Entry point of a worker process (spawn target): the conformance loop, then a fast exit.

    ``netns``: first enter that network namespace with that environment (``helpers_netns.enter``), before
    anything starts a thread."""
    if netns is not None:
        import helpers_netns

        helpers_netns.enter(*netns)
    conformance.worker_main(name, target, cmds, answers, worker_cls=Worker)
    # Engines and agents are closed; skip the interpreter's slow teardown of
    # NIXL/UCX globals once the last answer is out.
    answers.close()
    answers.join_thread()
    os._exit(0)


class Node(conformance.Node):
    """Test-side handle of one worker process on the host backend, its engines over ``nixl_backend``.

    A LIBFABRIC node must be started inside ``helpers_libfabric.spawn_env`` (its libraries). ``netns``: the
    worker runs in that network namespace with that environment (``helpers_netns``)."""

    def __init__(self, name: str, nixl_backend: str = "UCX", netns: tuple[str, dict[str, str]] | None = None) -> None:
        main = worker_main if netns is None else functools.partial(worker_main, netns=netns)
        super().__init__(name, replace(HOST, nixl_backends=(nixl_backend,)), main=main)

    def wait_logged(self, needles: list[str], timeout_s: float = 10.0) -> list[str]:
        """The lines this worker logs from now on (it keeps them no longer) until each needle is in one;
        fails naming the needles never logged."""
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines += self.call("logs")
            if all(any(n in line for line in lines) for n in needles):
                return lines
            time.sleep(0.05)
        missing = [n for n in needles if not any(n in line for line in lines)]
        raise AssertionError(f"{self.name} never logged {missing}; it logged {lines[-20:]}")
