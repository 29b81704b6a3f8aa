"""The engine thread: one per P or D rank, owning its sockets and NIXL agent.

Callers (vLLM's worker, tests) never block on I/O: they put a command in the
inbox, which wakes the thread through a pipe, and later collect ``Result``s.
The thread sleeps in ``zmq.poll`` when nothing is in flight, so an idle pair
costs no CPU; while transfers are in flight it polls NIXL with a short,
growing back-off (NIXL's own progress thread, which spins a core, is off).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvpush.backends.base import Backend, MemRegistration, StagingBuffer
from kvpush.backends.copy import copier
from kvpush.config import Config
from kvpush.core.counts import Count
from kvpush.core.errors import ConfigError
from kvpush.core.layout import KVLayout
from kvpush.core.outcome import Result
from kvpush.core.staging import SlotAllocator
from kvpush.observability import timeline
from kvpush.observability.metrics import Recorder
from kvpush.transport.nixl_agent import Agent

log = logging.getLogger(__name__)

BUSY_BACKOFF_MIN_S = 20e-6
DEFAULT_TIMER_SLACK_S = 50e-6
"""Linux's default timer slack: a thread's short sleep may overshoot by this much."""
TIGHT_TIMER_SLACK_NS = 1000


class EngineLoop:
    """Base of ``Sender`` and ``Receiver``: thread, inbox, wake-up, results."""

    SIDE = ""
    """``"prefill"`` or ``"decode"``: the label this engine's metrics and timeline lines carry."""

    def __init__(
        self, kind: str, config: Config, backend: Backend, layout: KVLayout, engine_id: str, rank: int, tp_size: int
    ) -> None:
        self.name = f"{kind}-{engine_id}-{rank}"
        self.idle_poll_max_s = config.polling.idle_poll_max_s
        busy = config.polling.busy_poll_max_s
        self.busy_poll_max_s = busy if busy is not None else backend.busy_poll_s
        """Longest sleep between polls of transfers in flight: the configured, else the backend's."""
        self.low_latency = self.busy_poll_max_s < DEFAULT_TIMER_SLACK_S
        """Polling faster than Linux's timer slack was asked for (GPU hosts): the thread's sleeps between
        polls of in-flight transfers are made to end on time (see ``_set_timer_slack``)."""
        self.cfg = config
        self.backend = backend
        self.copy = copier(backend)
        """The backend's asynchronous packs and unpacks, or synchronous ones (``kvpush.backends.copy``)."""
        # Peers learn from the layout whether this rank's KV may be accessed in place (Capabilities.direct).
        direct = layout.direct and backend.capabilities.direct
        self.layout = msgspec.structs.replace(layout, direct=direct).validate()
        chosen = config.staging.staging_bytes
        self.staging_bytes = chosen if chosen is not None else backend.staging_bytes
        """This rank's staging region: the configured size, else the backend's."""
        if not direct and (config.staging.plan == "direct" or self.staging_bytes <= 0):
            raise ConfigError(
                f"backend {backend.name!r} cannot let NIXL access its KV in place, so every transfer is staged: "
                f"plan {config.staging.plan!r} and staging_bytes {self.staging_bytes} leave none possible "
                "(use plan 'auto' or 'staged' and staging_bytes > 0)"
            )
        self.region_bases = [r.base for r in self.layout.regions]
        """Base address of each region, in order: what pack/unpack and their hints take."""
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self._staging: StagingBuffer | None = None
        self._slots = SlotAllocator(0)
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        self.poller.register(self._rfd, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.wakeups = 0
        self.loops = 0
        # Observability: every Result feeds the recorder (kvpush.observability.metrics) and,
        # with debug logging on, one kvpush.timeline log line. ``gauges`` is a
        # snapshot the engine thread replaces (never mutates), so other threads
        # read it without a call into the engine.
        self.recorder = Recorder(self.SIDE)
        self.gauges: dict[str, float] = {}
        self.counters: dict[Count, float] = {}
        """Event counters (engine thread writes; others copy it with ``dict(...)``)."""

    # -- caller side ---------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvpush-{self.name}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread soon."""
        self._inbox.put(fn)
        self.wake()

    def wake(self) -> None:
        """Make the engine thread step now (from any thread)."""
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):
            pass

    def call_sync(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread and wait for its value (setup and tests only)."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def wrapped() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            done.set()

        self.call(wrapped)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name}: engine thread did not answer in {timeout}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def poll(self) -> list[Result]:
        """Results since the last call; never blocks."""
        out: list[Result] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self.call(lambda: None)
        self._thread.join(timeout)
        self._thread = None
        os.close(self._rfd)
        os.close(self._wfd)

    # -- engine thread -------------------------------------------------
    def bump(self, what: Count, by: float = 1.0) -> None:
        self.counters[what] = self.counters.get(what, 0.0) + by

    def emit(self, result: Result) -> None:
        try:
            # Gauges as of this result: a report sent with it must not show the transfer as pending.
            self.refresh_gauges()
            self.recorder.observe(result)
            timeline.log_result(self.SIDE, self.name, result)
        except Exception:
            log.exception("%s: recording metrics for %s failed", self.name, result.transfer_id)
        self._results.put(result)

    def refresh_gauges(self) -> None:
        """Replace ``self.gauges`` with current values (engine thread; on timer ticks and results)."""

    def setup(self) -> None:
        """Create agent and sockets (on the engine thread)."""

    def open_agent(self, suffix: str) -> None:
        """NIXL agent with the KV cache and, unless plans are direct only, a staging region registered."""
        self.agent = Agent(f"{self.engine_id}-{suffix}{self.rank}", self.cfg.nixl_backends)
        self.agent.stuck_grace_s = self.cfg.polling.peer_dead_s  # a peer only stalled is back within it
        self.agent.register(self.backend.registrations(self.layout))
        if self.staging_bytes > 0 and (self.cfg.staging.plan != "direct" or not self.layout.direct):
            s = self.backend.alloc_staging(self.staging_bytes, self.layout.regions[0].device_id)
            self.agent.register([MemRegistration(s.addr, s.size, s.device_id, s.mem)])
            self._staging = s
            self._slots = SlotAllocator(s.size)

    def teardown(self) -> None:
        """Release agent and sockets (on the engine thread)."""

    def step(self, now: float) -> bool:
        """Handle socket events, progress NIXL, run timers; return True while busy."""
        raise NotImplementedError

    def idle_wait_s(self) -> float:
        """Longest wait for a socket event or a call when the last step was not busy."""
        return self.idle_poll_max_s

    def _run(self) -> None:
        _name_os_thread(f"kvpush-{self.name.split('-', 1)[0]}")
        if self.low_latency:
            _set_timer_slack(TIGHT_TIMER_SLACK_NS)
        try:
            self.backend.bind_engine_thread()  # the backend's thread hook, before any other call from this thread
            self.setup()
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        backoff = BUSY_BACKOFF_MIN_S
        busy = False
        try:
            while not self._stop.is_set():
                timeout_ms = 0 if busy else int(self.idle_wait_s() * 1000)
                events = dict(self.poller.poll(timeout_ms))
                if self._rfd in events:
                    self.wakeups += 1
                    try:
                        os.read(self._rfd, 65536)
                    except BlockingIOError:
                        pass
                while True:
                    try:
                        fn = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        fn()
                    except Exception:
                        log.exception("%s: command failed", self.name)
                self.loops += 1
                try:
                    busy = self.step(time.monotonic())
                except Exception:
                    log.exception("%s: engine step failed", self.name)
                    busy = False
                if busy and not events:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, self.busy_poll_max_s)
                else:
                    backoff = BUSY_BACKOFF_MIN_S
        finally:
            try:
                self.teardown()
            except Exception:
                log.exception("%s: teardown failed", self.name)


def _set_timer_slack(ns: int) -> None:
    """Let this thread's short sleeps end on time (Linux ``PR_SET_TIMERSLACK``, this thread only).

    Set where ``busy_poll_max_s`` is below the default slack: otherwise a
    poll interval shorter than the slack is really the slack, and a
    transfer's tail is a few polls (P noticing the last layer, its WRITE
    completing, D's notification).
    """
    _prctl(29, ns)


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-visible name (``top -H``, ``/proc/*/task/*/comm``).

    Python's thread names stay inside Python; without this the engine thread
    shows up as its process (e.g. ``VLLM::EngineCore``) and its CPU use
    cannot be told apart from vLLM's own threads.
    """
    _prctl(15, name.encode()[:15])  # PR_SET_NAME


def _prctl(option: int, arg: int | bytes) -> None:
    """``prctl(option, arg)`` for the calling thread; Linux only, best effort (a no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass
