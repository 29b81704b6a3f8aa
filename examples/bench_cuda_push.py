"""Push one 16k-token request GPU0 -> GPU1 with every strategy, next to peer copy.

Thin wrapper over ``kvpush_tools.cuda.bench`` (install ``backends/cuda`` first):

    python examples/bench_cuda_push.py --json results/cuda.json --plot results/cuda.png

``--backend host --quick`` dry-runs the same code on CPU memory.
"""

import sys

from kvpush_tools.cuda.bench import main

if __name__ == "__main__":
    sys.exit(main())
