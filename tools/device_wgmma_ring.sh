#!/usr/bin/env bash
# One device call for the warpgroup product's variants of session 26
# (crates/qerl-kernels/src/gemm_mma/warpgroup.cu: QERL_WGMMA_STAGES, the cp.async ring of codes;
# QERL_WGMMA_SYNC, chunks between barriers): the warpgroup CUDA tests under each environment of
# TEST_ENVS first (space-separated, each comma-separated ENV=v; "-" for the defaults), then
# device_warpgroup.sh without its tests: the rollout variants and (PROFILE=1) the step profiles.
# Carry .device/qerl.tar.gz and .device/kernels.xz (as device_warpgroup.sh says).
# There: TEST_ENVS="- QERL_WGMMA_SYNC=2" VARIANTS="..." PROFILE=1 PROFILE_SPEC="..." \
#   bash tools/device_wgmma_ring.sh
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
xz -dkf .device/kernels.xz && chmod +x .device/kernels
for te in ${TEST_ENVS:--}; do
  envs=(QERL_MMA_TEST_KERNEL=warpgroup QERL_MMA_TEST_TILES=default)
  [ "$te" != - ] && IFS=, read -ra more <<< "$te" && envs+=("${more[@]}")
  for f in ${TEST_FILTERS:-cuda_bf16::matmul_mma_segments cuda_bf16::matmul_mma_decode_batches}; do
    start=$SECONDS
    echo "== $f (warpgroup, $te)"
    env "${envs[@]}" timeout -k 10 ${TEST_T:-200} .device/kernels --ignored --test-threads=1 \
      --nocapture "$f" > "$OUT/test.txt" 2>&1
    grep -E "^test |test result|panicked|warpgroup kernel|error|seed" "$OUT/test.txt" | head -12
    echo "$f ($te): $((SECONDS - start)) s"
    if ! grep -q "test result: ok" "$OUT/test.txt"; then
      grep -iE -A12 "compilation error|\[Compilation" "$OUT/test.txt" | head -40
      echo "== a warpgroup test failed: no timing"
      exit 0
    fi
  done
done
TESTS=0 bash tools/device_warpgroup.sh
