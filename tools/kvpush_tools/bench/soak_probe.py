"""What the soak samples from its servers every couple of seconds: the resident memory of each server's process
tree (``/proc``) and a few gauges from its ``/metrics`` (vLLM's KV-cache usage, kvpush's withheld blocks,
transfers in flight, registrations and prefills waiting).

The parsers are pure (a ``/proc/PID/status`` text, a Prometheus page) and tested without servers; the
:class:`Sampler` thread only reads and records.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any

GAUGES = {
    "kv": "vllm:kv_cache_usage_perc",
    "quarantined": "vllm:kvpush_quarantined_blocks",
    "in_flight": "vllm:kvpush_transfers_in_flight",
    "pending": "vllm:kvpush_pending_registrations",
    "parked": "vllm:kvpush_parked_prefills",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}
"""Short name -> the metric sampled (its ``vllm:`` name: kvpush also exports bare names for one release, which
would count twice). ``kv_cache_usage_perc`` is a fraction, 0 to 1, despite its name."""
COUNTERS = ("vllm:kvpush_transfers_total", "vllm:kvpush_transfer_failures_total", "vllm:kvpush_dead_peers_total")
"""Read once at the end, by label: what the servers' own books say about the transfers since their last start."""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ENGINE_LABELS = frozenset({"engine", "model_name"})
"""Labels vLLM puts on every sample; a counter's breakdown leaves them out."""


def metric_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Per name, the sum of its samples on a Prometheus text page (over vLLM's engines); absent names are
    left out, so a metric the server does not export reads as missing, not as zero."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in wanted:
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def counter_breakdown(text: str, name: str) -> dict[str, float]:
    """One counter's samples summed by their own labels (``side=prefill,outcome=ok``), vLLM's engine labels
    left out; zero-valued rows dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        labels = {k: v for k, v in _LABEL.findall(m.group(2) or "") if k not in _ENGINE_LABELS}
        key = ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "all"
        try:
            out[key] = out.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return {k: v for k, v in out.items() if v}


def rss_kib(status: str) -> int:
    """``VmRSS`` of a ``/proc/PID/status`` text in KiB (0 for a process without one: a zombie, a kernel thread)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def parent_of(stat: str) -> int:
    """The parent pid in a ``/proc/PID/stat`` text (after the command's closing parenthesis, which a command
    name may itself contain)."""
    return int(stat.rsplit(")", 1)[1].split()[1])


def tree(root: int) -> list[int]:
    """``root`` and every descendant, from ``/proc``."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    kids.setdefault(parent_of(f.read()), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def tree_rss_mb(root: int) -> float | None:
    """Resident memory of ``root``'s process tree in MB (10^6 bytes), summed over its processes; None when
    the root is gone."""
    total, seen = 0, False
    for pid in tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                total += rss_kib(f.read())
            seen = True
        except OSError:
            continue
    return total * 1024 / 1e6 if seen else None


def scrape(url: str, timeout: float = 3.0) -> str | None:
    """A server's ``/metrics`` page, None when it does not answer (dead, starting, cut off)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            return str(r.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def gauges(text: str | None) -> dict[str, float] | None:
    """:data:`GAUGES` of a page by their short names; None for no page."""
    if text is None:
        return None
    sums = metric_sums(text, GAUGES.values())
    return {short: sums[name] for short, name in GAUGES.items() if name in sums}


Target = Callable[[], tuple[int | None, str | None]]
"""A server's current (root pid, base URL): a restart replaces both the process and the object."""


class Sampler(threading.Thread):
    """Every ``every`` seconds, for each named server: its tree's RSS and its gauges, with the time (seconds
    from ``t0``) and the number of requests ended so far (``ended``). ``rows`` holds one dict per sample."""

    def __init__(self, targets: Mapping[str, Target], ended: Callable[[], int], t0: float, every: float = 2.0):
        super().__init__(name="soak-sampler", daemon=True)
        self.targets, self.ended, self.t0, self.every = dict(targets), ended, t0, every
        self.rows: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 2), "ended": self.ended()}
        for name, target in self.targets.items():
            pid, url = target()
            row[f"{name}_rss_mb"] = None if pid is None else tree_rss_mb(pid)
            row[name] = gauges(scrape(url)) if url else None
        return row

    def run(self) -> None:
        while not self._halt.is_set():
            started = time.monotonic()
            self.rows.append(self.sample())
            self._halt.wait(max(0.0, self.every - (time.monotonic() - started)))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


def at_rest(g: Mapping[str, float] | None) -> bool:
    """A server's gauges say it holds nothing: no KV-cache block in use, none withheld (D), no WRITE in
    flight, no parked prefill (P). A server that did not answer is not at rest."""
    if g is None or "kv" not in g:
        return False
    return all(g.get(k, 0.0) == 0.0 for k in ("kv", "quarantined", "in_flight", "parked"))


def wait_at_rest(urls: Mapping[str, str], timeout_s: float, every: float = 1.0) -> dict[str, dict[str, Any]]:
    """After the load: per server, whether it came to rest (:func:`at_rest`) within ``timeout_s``, how long
    that took (``after_s``) and its last gauges (``last``)."""
    t0 = time.monotonic()
    out: dict[str, dict[str, Any]] = {name: {"zero": False} for name in urls}
    while True:
        for name, url in urls.items():
            if out[name]["zero"]:
                continue
            g = gauges(scrape(url))
            out[name]["last"] = g
            if at_rest(g):
                out[name].update(zero=True, after_s=round(time.monotonic() - t0, 1))
        if all(o["zero"] for o in out.values()) or time.monotonic() - t0 > timeout_s:
            return out
        time.sleep(every)
