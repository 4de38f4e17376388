#!/usr/bin/env bash
# One device call for the warpgroup product's `cp.async` ring of codes (session 26,
# crates/qerl-kernels/src/gemm_mma/warpgroup.cu, QERL_WGMMA_STAGES): the register ring's tests
# (STAGES=0, the refactored previous path) first, then device_warpgroup.sh with its tests on the
# default ring, the rollout variants and (PROFILE=1) the step profiles.
# Carry .device/qerl.tar.gz and .device/kernels.xz (as device_warpgroup.sh says).
# Env: OLD_TEST (1), and device_warpgroup.sh's.
# There: VARIANTS="..." PROFILE=1 PROFILE_SPEC="..." bash tools/device_wgmma_ring.sh
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${OLD_TEST:-1}" = 1 ]; then
  xz -dkf .device/kernels.xz && chmod +x .device/kernels
  start=$SECONDS
  echo "== cuda_bf16::matmul_mma_decode_batches (warpgroup, QERL_WGMMA_STAGES=0)"
  QERL_WGMMA_STAGES=0 QERL_MMA_TEST_KERNEL=warpgroup QERL_MMA_TEST_TILES=default \
    timeout -k 10 ${TEST_T:-200} .device/kernels --ignored --test-threads=1 --nocapture \
    cuda_bf16::matmul_mma_decode_batches > "$OUT/test-old.txt" 2>&1
  grep -E "^test |test result|panicked|warpgroup kernel|error|seed" "$OUT/test-old.txt" | head -12
  echo "old ring test: $((SECONDS - start)) s"
fi
bash tools/device_warpgroup.sh
