#!/usr/bin/env bash
# vLLM 0.24.0 (CUDA) with kvpush, vLLM's NixlConnector and NixlPushConnector on the lent H200, which
# has no package registry and takes at most 64 MiB of carried files a call. What it needs is made
# beforehand, here, by tools/gpu/vllm024_pack.sh: .carry/gpu024/pieces/NN (xz'd tree of the wheels in
# tools/gpu/vllm024_deps.txt) and .carry/gpu024/SHA256SUMS. Ignored folders stay on the machine between
# calls while it is held, so the pieces travel one per call and are put together by `install`.
#
#   bash tools/gpu/vllm024_h200.sh receive            # a piece arrived: check it (carry one piece a call)
#   bash tools/gpu/vllm024_h200.sh install            # all pieces: unpack, install kvpush, make the model
#   bash tools/gpu/vllm024_h200.sh sweep MODES [ARGS] # kvpush_tools.bench.gpu_sweep; results under $OUT
#
# The model: Qwen3-8B's shape, bf16, random weights built on the GPU (kvpush_tools.demo.tiny_model).
set -u
OUT=${OUT:-/tmp/gpu024-out}
C=.carry/gpu024
SITE=$C/site
KVP=$C/kvp
MODEL=$C/model
mkdir -p "$OUT"
# FlashInfer is not carried: its sampler is the only part vLLM would import on this path.
export VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The checkout first (it changes between calls; the installed copy in $KVP gives the entry points).
export PYTHONPATH=$PWD/tools:$PWD/backends/cuda:$PWD:$PWD/$KVP:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$PWD/$KVP/bin:$PATH
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/summary.txt"; }

check_pieces() {  # prints how many of the listed pieces are here and intact
  (cd $C/pieces 2>/dev/null && sha256sum --quiet -c ../SHA256SUMS --ignore-missing 2>&1) | tee -a "$OUT/summary.txt"
  local want have
  want=$(wc -l <$C/SHA256SUMS)
  have=$(ls $C/pieces 2>/dev/null | wc -l)
  say "pieces here: $have of $want"
  [ "$have" -eq "$want" ]
}

case "${1:-}" in
receive)
  check_pieces
  df -h . | tail -1
  nvidia-smi -L
  exit 0
  ;;
install)
  check_pieces || { say "pieces missing"; exit 1; }
  rm -rf "$SITE" "$KVP" && mkdir -p "$SITE"
  cat $C/pieces/* | xz -d -T0 | tar -x -C "$SITE" || { say "unpack failed"; exit 1; }
  say "unpacked: $(du -sh $SITE | cut -f1)"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$KVP" . ./backends/cuda ./tools \
    >"$OUT/install.log" 2>&1 || { say "kvpush install failed"; tail -20 "$OUT/install.log"; exit 1; }
  python3 - <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import importlib.metadata as md, torch
import vllm, nixl, kvpush, kvpush_tools
from vllm.vllm_flash_attn import flash_attn_interface as fa
print("vllm", vllm.__version__, "nixl", md.version("nixl"), "torch", torch.__version__, torch.version.cuda,
      "FA3", fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON)
print("GPU", torch.cuda.get_device_name(0), round(torch.cuda.get_device_properties(0).total_memory / 2**30), "GiB")
EOF
  say "making the model (Qwen3-8B shape, bf16, built on the GPU)"
  rm -rf "$MODEL"
  python3 -m kvpush_tools.demo.tiny_model "$MODEL" --qwen3-8b-shape --device cuda >>"$OUT/install.log" 2>&1 \
    || { say "model failed"; tail -20 "$OUT/install.log"; exit 1; }
  say "model: $(du -sh $MODEL | cut -f1) $(ls $MODEL | tr '\n' ' ')"
  ;;
sweep)
  shift
  MODES=${1:-kvpush,vllm-pull,vllm-push}
  shift || true
  say "sweep $MODES $*"
  python3 -m kvpush_tools.bench.gpu_sweep --model "$MODEL" --modes "$MODES" --out "$OUT" "$@" 2>&1 | tee "$OUT/sweep.log" \
    | grep -E "^\[" | tail -60
  # With KVPUSH_LOG_LEVEL=DEBUG kvpush logs one timeline line per transfer per side: join them per mode
  # (where each request's time went) before the logs go.
  for d in "$OUT"/*/logs; do
    p=$(ls "$d"/*-prefill.log 2>/dev/null | head -1) dl=$(ls "$d"/*-decode.log 2>/dev/null | head -1)
    if [ -n "$p" ] && [ -n "$dl" ] && grep -q "kvpush.timeline {" "$p"; then
      python3 -m kvpush.cli timeline "$p" "$dl" --png "$d/../timeline.png" >"$d/../timeline.txt" 2>&1
      head -40 "$d/../timeline.txt"
    fi
  done
  # Server logs are large: keep their first error and their last lines only.
  for f in "$OUT"/*/logs/*.log; do
    [ -f "$f" ] || continue
    { grep -m1 -n -B2 -A25 -E "Traceback|ERROR" "$f"; echo ...; tail -40 "$f"; } >"$f.excerpt" 2>/dev/null
    rm -f "$f"
  done
  ;;
*)
  echo "usage: $0 receive | install | sweep MODES [gpu_sweep args]" >&2
  exit 2
  ;;
esac
