#!/usr/bin/env bash
# Everything the CUDA backend needs a GPU for, in one command (tests, then the
# benchmark), with logs and JSON under $OUT. Written for the lent H200 machine
# of this workplace, which has torch but no registry: wheels for nixl,
# msgspec and pyzmq travel in .whl/ (see docs/cuda.md). On a GPU host where
# `pip install -e . -e backends/cuda` worked, skip the install part
# (CONFORMANCE=1 also runs `kvpush conformance --backend cuda`; TESTS=0 skips the tests, BENCH=0 the benchmark):
#   python -m pytest backends/cuda/tests -m gpu
#   python examples/bench_cuda_push.py --json cuda_push.json --plot cuda_push.png
set -u
OUT=${OUT:-/tmp/kvpush-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  nvidia-smi
  nvidia-smi topo -m
  python3 -c 'import torch, triton; print("torch", torch.__version__, torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} >"$OUT/env.log" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
# kvpush and kvpush-cuda with their entry points (no registry: no build isolation).
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/kvp . ./backends/cuda ./tools \
  >"$OUT/install.log" 2>&1 || echo "install of kvpush failed, see install.log"
export PYTHONPATH=/tmp/kvp:${PYTHONPATH:-}
cd /tmp/kvp >/dev/null && python3 -c 'import kvpush, kvpush_cuda, nixl; print("kvpush from", kvpush.__file__)'; cd - >/dev/null
tail -3 "$OUT/env.log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests"
  timeout "${TEST_TIMEOUT:-180}" python3 -m pytest backends/cuda/tests -m "gpu or not gpu" -p no:cacheprovider -q -rs \
    >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"
  tail -25 "$OUT/pytest.log"
fi

if [ "${CONFORMANCE:-0}" = 1 ]; then
  echo "== conformance (devices ${CONFORMANCE_DEVICES:-0,1})"
  timeout 300 python3 -m kvpush.cli conformance --backend cuda --devices "${CONFORMANCE_DEVICES:-0,1}" \
    -- -q -p no:cacheprovider --junitxml="$OUT/conformance.xml" >"$OUT/conformance.log" 2>&1
  echo "conformance rc=$?"
  tail -5 "$OUT/conformance.log"
fi
[ "${BENCH:-1}" = 1 ] || exit 0

echo "== benchmark"
UCX_PROTO_INFO=${UCX_PROTO_INFO:-y} timeout "${BENCH_TIMEOUT:-360}" python3 examples/bench_cuda_push.py \
  --json "$OUT/cuda_push.json" --plot "$OUT/cuda_push.png" "$@" >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v "NIXL INFO" "$OUT/bench.log" | grep -E "^\[bench|^ +[a-z]|Error|error|Traceback|cuda_ipc" | tail -60
