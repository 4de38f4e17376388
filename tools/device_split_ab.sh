#!/usr/bin/env bash
# One device call for the split-K planner of the staged decode-batch product
# (`splitk::plan_waves`, session 22): the rollout benchmark with the wave planner (the default,
# with the check) and the earlier warp-target planner (`QERL_MMA_WARPS_PER_SM=24`) alternating
# in one binary, then one decode step's GPU time by kernel (ncu) under each.
# Carry .device/qerl.tar.gz (the release `qerl`, --features cuda).
# Env: VARIANTS (device_mma_check.sh's), PROFILE (1), PROFILE_SPEC (device_step_profile.sh's
#   arguments), TOP (kernels listed, 24), PROFILE256 (1: batch-256 steps too, PROFILE256_SPEC,
#   default waves and target, 64 new tokens, SKIP256 56000, COUNT256 16000 launches), GEMV (0: the
#   batch-1 products' launch geometry).
# Everything the call prints is also in $OUT/log.txt; the files under $OUT are packed into
# $OUT/results.tgz at the end (a call brings back only a few files).
# There: bash tools/device_split_ab.sh
set -uo pipefail
export QERL_TAR=.device/qerl.tar.gz OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
exec > >(tee "$OUT/log.txt") 2>&1
TESTS=0 TAIL=${TAIL:-6} ROLLOUT_T=${ROLLOUT_T:-150} \
  VARIANTS=${VARIANTS:-"waves:CHECK=1,B=16+64+256 target:QERL_MMA_WARPS_PER_SM=24,B=16+64+256 waves2:B=16+64+256 target2:QERL_MMA_WARPS_PER_SM=24,B=16+64+256 w32:S=qwen2.5-32b,B=64 t32:S=qwen2.5-32b,QERL_MMA_WARPS_PER_SM=24,B=64"} \
  bash tools/device_mma_check.sh
if [ "${PROFILE:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  TOP=${TOP:-24} bash tools/device_step_profile.sh ${PROFILE_SPEC:-"waves:@64" "target:QERL_MMA_WARPS_PER_SM=24@64"}
fi
if [ "${PROFILE256:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  SKIP=${SKIP256:-56000} COUNT=${COUNT256:-16000} NEW=64 NCU_T=${NCU_T256:-240} TOP=${TOP:-24} \
    bash tools/device_step_profile.sh ${PROFILE256_SPEC:-"waves:@256" "target:QERL_MMA_WARPS_PER_SM=24@256"}
fi
# GEMV=1: the batch-1 decode products' launch geometry (ncu: grid, registers, waves, the time
# the multiprocessors were busy) on GEMV_COUNT gemv launches of the decode steps.
if [ "${GEMV:-0}" = 1 ]; then
  start=$SECONDS
  [ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
  timeout -k 10 ${NCU_T:-150} ncu --clock-control none --kernel-name regex:gemv \
    --launch-skip ${GEMV_SKIP:-300} --launch-count ${GEMV_COUNT:-8} \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1 --prompt 256 \
    --new-tokens 16 --no-check > "$OUT/ncu-gemv.txt" 2>&1
  echo "== gemv launches: $((SECONDS - start)) s"
  grep -E "^  [a-z_]*gemv|Duration|Elapsed Cycles|SM Active Cycles|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Waves Per SM" \
    "$OUT/ncu-gemv.txt" | sed 's/  */ /g' | head -${GEMV_LINES:-120}
fi
cd "$OUT" && tar -czf results.tgz --exclude results.tgz --exclude log.txt ./* && rm -f ./*.csv ./*.jsonl ./ncu-*.txt
