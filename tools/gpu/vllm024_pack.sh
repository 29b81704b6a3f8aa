#!/usr/bin/env bash
# Packs vLLM 0.24.0 (CUDA wheel), NIXL 1.3.2 (nixl-cu13) and the few packages vLLM imports that the
# lent H200 image lacks (tools/gpu/vllm024_deps.txt) into pieces the device tool can carry (at most
# 64 MiB a call): run here, on a machine with a registry. The wheels are unpacked into one tree
# (what `pip install --target` makes of them: none of them has scripts or data we need), parts the
# GPU path never loads are left out, and the tree is xz-compressed and split:
#   .carry/gpu024/pieces/NN   (each carried by one device call: tools/gpu/vllm024_h200.sh install)
# Left out, each optional where vLLM loads it: FlashAttention 2 kernels (Hopper runs FA3), the MoE
# kernels (dense model), the Rust frontend binary, DeepGEMM builds for other Pythons, NIXL's EP
# extension and UCX's perftest.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.carry/gpu024
PIECE_MB=${PIECE_MB:-48}
mkdir -p "$OUT/dl" "$OUT/pieces"
grep -v '^#' tools/gpu/vllm024_deps.txt | xargs pip download -q --no-deps --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_34_x86_64 --platform any -d "$OUT/dl"
rm -rf "$OUT/site" && mkdir -p "$OUT/site"
for w in "$OUT"/dl/*.whl; do python -m zipfile -e "$w" "$OUT/site"; done
cd "$OUT/site"
rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
  vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-x86_64-linux-gnu.so vllm-*.data \
  nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest_cuda.so*
find . -name __pycache__ -prune -exec rm -rf {} +
cd ..
rm -f pieces/*
tar -C site -cf - . | xz -T0 -6 | split -b "${PIECE_MB}M" -d -a 2 - pieces/
(cd pieces && sha256sum -- * > ../SHA256SUMS)
du -sh site pieces
ls -l pieces
