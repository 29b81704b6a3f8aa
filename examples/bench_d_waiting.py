"""D's engine thread while its registrations wait for P's prefill: loops and CPU, side by side per checkout.

Under load a D rank always has registrations waiting (D registers while P
computes). How busily D polls NIXL for them decides how much of the GIL its
engine thread takes from vLLM's decode loop in the same process. This starts
a P and a D worker (the engine tests' processes, host memory, NIXL UCX), has
D register ``--requests`` transfers that P pairs with started prefills whose
KV never becomes ready, and reads D's engine loops and D's process CPU time
over ``--window`` seconds. Give several checkouts (``--roots``) to compare
them in one run, alternating. Prints and writes JSON.

    python examples/bench_d_waiting.py --roots /path/to/old,. --json d_waiting.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(root: str, requests: int, window: float, reps: int) -> dict:
    """One checkout, in this process (its kvpush and tests/ first on the path)."""
    sys.path[:0] = [root, os.path.join(root, "tests")]
    os.environ["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])
    from procs import Geom, Node
    from test_push_nixl import _cfg

    def cpu(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")

    p, d = Node("P"), Node("D")
    p.wait_ready()
    d.wait_ready()
    g = Geom(layers=6, num_blocks=4 * requests)
    fast = {"busy_poll_max_s": 5e-6, "idle_poll_max_s": 0.05}  # the README's GPU-host setting
    addr = p.call("sender", "kp", g, _cfg(**fast), "P", 1000)
    d.call("receiver", "kd", g, _cfg(**fast), "D")
    for i in range(requests):
        blocks = [4 * i + j for j in range(4)]
        d.call("register", "kd", f"t{i}", f"d{i}", (addr[0], addr[1], 1), blocks, 60, 0)
        p.call("prefill_started", "kp", f"t{i}", f"p{i}", blocks, 60)
    time.sleep(1.0)
    runs = []
    for _ in range(reps):
        l0, c0 = d.call("loops", "kd"), cpu(d.proc.pid)
        time.sleep(window)
        runs.append(
            {"loops_per_s": (d.call("loops", "kd") - l0) / window, "cpu_share": (cpu(d.proc.pid) - c0) / window}
        )
    p.call("close", "kp")
    d.call("close", "kd")
    p.stop()
    d.stop()
    return {"root": root, "runs": runs, **{f"median_{k}": statistics.median(r[k] for r in runs) for k in runs[0]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--roots", default=".", help="checkouts to compare, comma-separated")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="each checkout measured this many times, alternating")
    ap.add_argument("--json", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: measure this root in this process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.requests, a.window, a.reps)))
        return
    out = []
    for _ in range(a.rounds):
        for root in a.roots.split(","):
            cmd = [sys.executable, __file__, "--one", os.path.abspath(root), "--requests", str(a.requests)]
            cmd += ["--window", str(a.window), "--reps", str(a.reps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rec = json.loads(res.stdout.strip().splitlines()[-1])
            print(
                f"{rec['root']}: D loops/s {rec['median_loops_per_s']:.0f}, D process CPU {rec['median_cpu_share']:.1%}"
            )
            out.append(rec)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"requests": a.requests, "window_s": a.window, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
