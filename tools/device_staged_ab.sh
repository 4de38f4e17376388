#!/usr/bin/env bash
# One device call for a change to the staged decode-batch kernel (gemm_mma/staged.rs): the CUDA
# mma tests against the host reference, the rollout benchmark with this build and the previous
# one alternating, then this build's batch-64 step by kernel and the mma kernels' instruction
# counts (ncu) and SASS.
# Carry .device (qerl.tar.gz: this build; qerl-old.tar.gz: the previous; kernels.xz: the kernel
# test binary, `cargo test --release -p qerl-kernels --features cuda --test kernels --no-run`).
# Env: VARIANTS (device_mma_check.sh's), PROFILE (1), MMA (1).
set -uo pipefail
[ -f .device/kernels.xz ] && xz -dkf .device/kernels.xz && chmod +x .device/kernels
export QERL_TAR=.device/qerl.tar.gz
TESTS=${TESTS:-1} TEST_FILTERS=${TEST_FILTERS:-cuda_bf16::matmul_mma} QERL_MMA_TEST_KERNEL=staged \
  TEST_T=${TEST_T:-300} TAIL=${TAIL:-6} ROLLOUT_T=${ROLLOUT_T:-150} \
  VARIANTS=${VARIANTS:-"new:CHECK=1,B=16+64+256 old:T=.device/qerl-old.tar.gz,B=16+64+256 new2:B=64+256 p2:QERL_MMA_PREFETCH=2,B=64+256"} \
  bash tools/device_mma_check.sh
[ "${PROFILE:-1}" = 1 ] && TOP=${TOP:-16} bash tools/device_step_profile.sh "new:@64"
[ "${MMA:-1}" = 1 ] && PROFILE=0 MMA_COUNT=4 bash tools/device_mma_profile.sh 2>&1 | grep -E "gemm_mma|Duration|inst_executed|Issued|Registers|compile|SASS" | head -60
