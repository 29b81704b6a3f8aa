#!/usr/bin/env bash
# GPU A/B, old (a908f20, this folder) and new (the repo root) taking turns: old new old new.
set -u
ROOT=$(pwd)
A="--patterns contiguous,shuffled --strategies staged --write-descs 1 --engine-iters 11 --iters 3 --busy-poll-us 5 --lw-tokens 4096,16384 --lw-iters 10 --lw-modes none,whole,layer"
cp -r .whl .old29/ 2>/dev/null
for i in 1 2; do
  for tree in old new; do
    rm -rf /tmp/kvp
    if [ $tree = old ]; then cd "$ROOT/.old29"; P="--engine-parts 4,2"; else cd "$ROOT"; P="--engine-parts 0,2"; fi
    export TESTS=0 BENCH_TIMEOUT=200 OUT="$OUTBASE/${tree}$i"
    bash backends/cuda/scripts/gpu_check.sh $A $P > /dev/null 2>&1
    echo "== $tree $i"; grep -E "^\[bench.*(engine|raw WRITE)" "$OUT/bench.log" | sed 's/^\[bench [0-9:]*\] //'
    grep -E "layerwise +[0-9]+ +(whole|layer):" "$OUT/bench.log" | sed -E "s/.*layerwise +([0-9]+) +([a-z]+):.*'d_result_ms': ([-0-9.]+).*'kv_on_d_ms': ([-0-9.]+).*/lw \1 \2 tail=\3 kv_on_d=\4/"
    rm -f "$OUT/bench.log" "$OUT"/*.png
  done
done
