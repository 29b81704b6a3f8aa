"""kvpush against vLLM's NixlConnector (pull) and NixlPushConnector (push) under a Poisson load.

Thin wrapper over ``kvpush_tools.bench.serve`` (the same as ``kvpush bench serve``):

    python examples/bench_serve.py --quick                 # one point, one iteration
    python examples/bench_serve.py                         # the default sweep, 3 iterations (~45-60 min here)
    python examples/bench_serve.py --inputs 1024 --qps 1,2,4 --iterations 3
    python examples/bench_serve.py --modes kvpush,vllm-pull --routers kvpush,vllm-router --inputs 1024 --qps 1

Writes ``results/bench_serve/run-<time>/`` (``--out`` to change): one JSON per
(mode, router, QPS, input, output, iteration), ``summary.json``, ``summary.txt`` and
``ttft_vs_qps.png`` / ``tpot_vs_qps.png``. Redraw with ``kvpush bench plot DIR``.
"""

import sys

from kvpush_tools.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
