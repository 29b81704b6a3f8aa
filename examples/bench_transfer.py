"""Push one long-prompt request between two processes over real NIXL, per plan and block pattern.

Thin wrapper over ``kvpush_tools.bench.transfer`` (the same as ``kvpush bench transfer``):

    python examples/bench_transfer.py                  # 4096 tokens = 128 MiB, all plans and patterns
    python examples/bench_transfer.py --tokens 16384   # the full 16k-token prompt (512 MiB)
    python examples/bench_transfer.py --plans coalesced,staged --patterns shuffled --iters 9

Writes ``results/bench_transfer/transfer_<tokens>tok.{json,png}`` (``--out`` to change).
"""

import sys

from kvpush_tools.bench.transfer import main

if __name__ == "__main__":
    sys.exit(main())
