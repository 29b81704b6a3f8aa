"""The GPU's SM clock and power over a benchmark run, sampled by ``nvidia-smi`` in the background.

Why: in the layer-wise benchmark every run that pushes layers during the
forward has a longer forward (H200, 16k tokens: +3.7 ms) than a run without
a transfer, whatever the part count or the copier's priority. One candidate
is the power cap: moving 512 MiB while GEMMs run at the limit would lower
the clocks. Lining up each run with the clock and power samples of its own
window tells.
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap"


def smi_command(device: int, period_ms: int = 20) -> list[str]:
    """``nvidia-smi`` printing FIELDS every ``period_ms``; ``KVPUSH_GPU_SAMPLES_CMD`` (a shell-style
    command line printing lines of the same form) replaces it where nvidia-smi is elsewhere, and in tests."""
    override = os.environ.get("KVPUSH_GPU_SAMPLES_CMD")
    if override:
        return shlex.split(override)
    return [
        "nvidia-smi",
        f"--query-gpu={FIELDS}",
        "--format=csv,noheader,nounits",
        f"-lms={period_ms}",
        f"-i={device}",
    ]


def parse(line: str) -> tuple[float, float, bool] | None:
    """``"1980, 612.35, Not Active"`` -> (SM MHz, W, power-capped); None for anything else."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return float(parts[0]), float(parts[1]), parts[2].lower() == "active"
    except ValueError:
        return None


class GpuSampler:
    """Reads a sampling command's lines on a thread, stamping each with ``time.monotonic()`` on arrival."""

    def __init__(self, cmd: Sequence[str]) -> None:
        self._proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._samples: list[tuple[float, float, float, bool]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="gpu-samples", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            got = parse(line)
            if got is not None:
                with self._lock:
                    self._samples.append((time.monotonic(), *got))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Median SM clock, mean power and the share of power-capped samples between ``t0`` and ``t1``."""
        with self._lock:
            inside = [s for s in self._samples if t0 <= s[0] <= t1]
        if not inside:
            return {"gpu_samples": 0}
        return {
            "gpu_samples": len(inside),
            "gpu_sm_mhz": statistics.median(s[1] for s in inside),
            "gpu_power_w": statistics.fmean(s[2] for s in inside),
            "gpu_power_capped": sum(s[3] for s in inside) / len(inside),
        }

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._thread.join(timeout=5)
