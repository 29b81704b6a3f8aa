#!/usr/bin/env bash
# Issue #44 on a two-GPU kind (nvidia-h100-x2 / nvidia-h200-x2), once `status` lends one: every step after the
# vLLM 0.24 pieces are received and installed as for one GPU (tools/gpu/vllm024_h200.sh receive/install, one
# piece a call). Each step is one device call of under ten minutes; results under $OUT.
#
#   bash tools/gpu/two_gpus.sh tests      # the CUDA backend's tests (the two-GPU ones no longer skip) and the
#                                         # conformance suite with P's and D's memory on different GPUs
#   bash tools/gpu/two_gpus.sh copies     # peer copies across GPUs against NIXL UCX between them, 64 MiB-2 GiB,
#                                         # contiguous and shuffled, both orders (kvpush_tools.cuda.bench)
#   bash tools/gpu/two_gpus.sh sweep A    # through vLLM 0.24, P on GPU 0 and D on GPU 1: kvpush defaults,
#                                         # kvpush with peer copies off, NixlPushConnector, NixlConnector (pass A)
#   bash tools/gpu/two_gpus.sh sweep B    # the same modes again, interleaved in another order (pass B)
#   bash tools/gpu/two_gpus.sh tp2        # a TP 2 P on both GPUs feeding a TP 1 D on GPU 1: correctness first
set -u
OUT=${OUT:-/tmp/two-gpus-out}
C=.carry/gpu024
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:$PWD/tools:$PWD/backends/cuda:$PWD/tests/helpers:$PWD/backends/cuda/tests:$PWD/$C/kvp:$PWD/$C/site
POINTS="1024:8;4096:2;16384:0.5,1;32768:0.25"
SWEEP=(--points "$POINTS" --seconds-per-point 8 --min-prompts 6 --max-model-len 33792 --kv-cache-gib 16
  --vllm-env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on --gpus split)

case "${1:-}" in
tests)
  nvidia-smi -L
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  python3 -m pytest -q -p no:cacheprovider backends/cuda/tests/test_gpu.py 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt"
  python3 -m kvpush.cli conformance --backend cuda --devices 0,1 2>&1 | tail -15 | tee "$OUT/conformance.txt"
  ;;
copies)
  # The bench's default request shape is 32 KiB a token: 2k, 16k and 64k tokens are 64 MiB, 512 MiB, 2 GiB.
  for t in 2048 16384 65536; do
    python3 -m kvpush_tools.cuda.bench --p-device 0 --d-device 1 --tokens "$t" --patterns contiguous,shuffled \
      --engine-orders ahead,finished --json "$OUT/copies_$t.json" --plot "$OUT/copies_$t.png" 2>&1 | tail -25
  done
  ;;
sweep)
  case "${2:-A}" in
  A) MODES=kvpush,kvpush-hosts,vllm-push ;;
  B) MODES=vllm-pull,vllm-push,kvpush-hosts,kvpush ;;
  *) echo "sweep A or B" >&2; exit 2 ;;
  esac
  bash tools/gpu/vllm024_h200.sh sweep "$MODES" "${SWEEP[@]}" --deadline-s 570 --out "$OUT/pass${2:-A}"
  ;;
tp2)
  bash tools/gpu/vllm024_h200.sh sweep kvpush,kvpush-hosts --points "4096:2;16384:0.5" --seconds-per-point 8 \
    --min-prompts 6 --max-model-len 33792 --kv-cache-gib 16 --gpus split --p-tp 2 --deadline-s 500 --out "$OUT/tp2"
  ;;
*)
  echo "usage: $0 tests|copies|sweep A|sweep B|tp2" >&2
  exit 2
  ;;
esac
