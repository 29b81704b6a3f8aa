#!/usr/bin/env bash
# CUDA VRAM pushed over NIXL's LIBFABRIC plugin on libfabric's tcp provider, on a GPU host with no
# package registry (the lent H200): one command, results under $OUT. What it needs travels in the
# checkout's ignored folders, made beforehand on a machine with a registry:
#   .whl/               nixl, nixl_cu13, msgspec, pyzmq wheels for the host's Python (docs/cuda.md)
#   .carry/libfabric/   bash tools/libfabric/setup.sh --carry .carry/libfabric
#                       (libfabric-src-autogen.tar.gz: the vendored snapshot with configure generated,
#                        so no autotools are needed here; hwloc/libhwloc.so.15 from Debian)
# Steps (each bounded in time, each logged): install the wheels and kvpush; build libfabric (tcp,
# shm; no CUDA support in libfabric, so tcp lacks FI_HMEM); kvpush doctor over LIBFABRIC; the
# conformance suite of the cuda backend over LIBFABRIC on GPU 0 (P and D two processes, every push
# checked byte for byte), with NIXL's log at INFO to record what the plugin does with VRAM (over tcp
# it takes none: kvpush refuses by name); then the cuda backend with host staging over LIBFABRIC
# (GPU tests of host staging and the conformance suite).
# Files in $OUT (at most 9): summary.txt, setup.log, doctor.json, doctor.log, conformance.xml,
# conformance.log, vram_lines.log, phase2.log, conformance_host_staging.xml.
set -u
OUT=${OUT:-/tmp/kvpush-lf-out}
mkdir -p "$OUT"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SUM=$OUT/summary.txt
say() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$SUM"; }
CARRY=${CARRY:-.carry/libfabric}

{
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, "gpus", torch.cuda.device_count())'
  ls -d /usr/local/cuda* 2>/dev/null
  /sbin/ldconfig -p | grep -E "libcuda.so.1|libcudart.so.1[23]|libhwloc|libudev.so.1" || true
} >"$OUT/setup.log" 2>&1
say "host: $(head -1 "$OUT/setup.log")"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$OUT/setup.log" 2>&1 || { say "wheel install failed (setup.log)"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/kvp . ./backends/cuda \
  >>"$OUT/setup.log" 2>&1 || { say "kvpush install failed (setup.log)"; exit 1; }
export PYTHONPATH=/tmp/kvp:${PYTHONPATH:-}
say "installed kvpush and wheels"

build() {  # $1: extra environment for setup.sh; prints the LD_LIBRARY_PATH entries
  env KVPUSH_LIBFABRIC_TARBALL="$CARRY/libfabric-src-autogen.tar.gz" KVPUSH_HWLOC_DIR="$CARRY/hwloc" \
    KVPUSH_CACHE=/tmp/kvpush-cache JOBS="$(nproc)" "$@" bash tools/libfabric/setup.sh --ld-path 2>>"$OUT/setup.log"
}
LDP=$(build) || { say "libfabric build failed (setup.log)"; tail -30 "$OUT/setup.log"; exit 1; }
say "libfabric built: $LDP ($(cat /tmp/kvpush-cache/libfabric-*/kvpush-libfabric.json | tr -d '\n' | head -c 600))"
LD=$LDP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

say "doctor over LIBFABRIC"
LD_LIBRARY_PATH=$LD timeout 180 python3 -m kvpush.cli doctor --nixl-backend LIBFABRIC --json "$OUT/doctor.json" \
  >"$OUT/doctor.log" 2>&1
say "doctor rc=$?"
grep -E "^\[" "$OUT/doctor.log" | grep -Ei "LIBFABRIC|libfabric|cuda|self-test" | tee -a "$SUM"

say "conformance: cuda backend over LIBFABRIC (tcp, no FI_HMEM), GPU 0"
LD_LIBRARY_PATH=$LD NIXL_LOG_LEVEL=INFO timeout "${CONF_TIMEOUT:-240}" python3 -m kvpush.cli conformance \
  --backend cuda --devices 0 --nixl-backend LIBFABRIC -- -q -p no:cacheprovider -x \
  --junitxml="$OUT/conformance.xml" >"$OUT/conformance.log" 2>&1
say "conformance rc=$? (124: timed out; 139/134: crashed)"
tail -4 "$OUT/conformance.log" | tee -a "$SUM"
grep -E "FI_HMEM|VRAM|falling back|memory registration|System runtime|Topology|NVIDIA GPUs|Bad address|EFAULT|rail 0" \
  "$OUT/conformance.log" | sed -E 's/^([IWEF])[0-9]{4} [0-9:.]+ +[0-9]+ /\1 /' | sort | uniq -c | sort -rn | head -40 \
  >"$OUT/vram_lines.log"
say "what the plugin said about VRAM (counts):"
head -12 "$OUT/vram_lines.log" | tee -a "$SUM"

say "phase 2: cuda backend with host staging over LIBFABRIC (the KV never registered; pinned host staging as DRAM)"
(
  LD_LIBRARY_PATH=$LD timeout 150 python3 -m pytest backends/cuda/tests/test_gpu.py -q -p no:cacheprovider \
    -k "host_staging or alloc_staging"
  echo "gpu tests rc=$?"
  LD_LIBRARY_PATH=$LD timeout "${CONF_TIMEOUT:-240}" python3 -m kvpush.cli conformance \
    --backend cuda --devices 0 --nixl-backend LIBFABRIC --option staging=host -- -q -p no:cacheprovider \
    --junitxml="$OUT/conformance_host_staging.xml"
  echo "host-staged conformance rc=$?"
) >"$OUT/phase2.log" 2>&1
grep -E "passed|failed|skipped|rc=|Error" "$OUT/phase2.log" | sort | uniq -c | head -20 | tee -a "$SUM"
say "done"
