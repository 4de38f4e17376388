#!/usr/bin/env bash
# One device call for the warpgroup (`wgmma`) decode-batch product (crates/qerl-kernels/src/
# gemm_mma/warpgroup.{rs,cu}, session 23): its CUDA tests against the host f64 reference first
# (segments, then every decode batch, `QERL_MMA_TEST_KERNEL=warpgroup`); then, only if they
# passed, the rollout benchmark with the staged kernel and the warpgroup kernel alternating in one
# binary (VARIANTS), then (PROFILE=1) one decode step's GPU time by kernel (ncu) under each.
# Carry .device/qerl.tar.gz (the release `qerl`, --features cuda) and .device/kernels.xz (the
# kernel test binary, `cargo test --release -p qerl-kernels --features cuda --test kernels
# --no-run`, stripped, xz).
# Env: TESTS (1), VARIANTS (device_mma_check.sh's), PROFILE (0), PROFILE_SPEC, PROFILE256 (0),
#   SECTIONS (0: ncu's stall sections of the warpgroup launches).
# Everything the call prints is also in $OUT/log.txt; the rest is packed into $OUT/results.tgz.
# There: bash tools/device_warpgroup.sh
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
exec > >(tee "$OUT/log.txt") 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  xz -dkf .device/kernels.xz && chmod +x .device/kernels
  export QERL_MMA_TEST_KERNEL=warpgroup QERL_MMA_TEST_TILES=default
  for f in cuda_bf16::matmul_mma_segments cuda_bf16::matmul_mma_decode_batches; do
    start=$SECONDS
    echo "== $f (warpgroup)"
    timeout -k 10 ${TEST_T:-200} .device/kernels --ignored --test-threads=1 --nocapture "$f" \
      > "$OUT/test.txt" 2>&1
    grep -E "^test |test result|panicked|warpgroup kernel|error|Error|seed" "$OUT/test.txt" | head -20
    echo "$f: $((SECONDS - start)) s"
    if ! grep -q "test result: ok" "$OUT/test.txt"; then
      grep -iE -A12 "compilation error|\[Compilation" "$OUT/test.txt" | head -60
      echo "== the warpgroup kernel fails its tests: no timing"
      exit 0
    fi
  done
fi
# Since session 23 the warpgroup kernel is the default on sm_90 from 33 rows: `staged` asks for
# the staged kernel by name.
s=QERL_MMA_KERNEL=staged
TESTS=0 TAIL=${TAIL:-6} ROLLOUT_T=${ROLLOUT_T:-150} QERL_TAR=.device/qerl.tar.gz \
  VARIANTS=${VARIANTS:-"wg:CHECK=1,B=16+64+256 staged:$s,B=16+64+256 wg2:B=64+256 staged2:$s,B=64+256"} \
  bash tools/device_mma_check.sh
if [ "${PROFILE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  TOP=${TOP:-16} bash tools/device_step_profile.sh ${PROFILE_SPEC:-"staged:$s@64" "wg:@64"}
fi
if [ "${PROFILE256:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  SKIP=${SKIP256:-56000} COUNT=${COUNT256:-16000} NEW=64 NCU_T=${NCU_T256:-240} TOP=${TOP:-16} \
    bash tools/device_step_profile.sh ${PROFILE256_SPEC:-"staged:$s@256" "wg:@256"}
fi
# SECTIONS=1: ncu's stall and occupancy sections of four consecutive warpgroup launches (one
# layer's q/k/v, o, gate/up and down) of the batch-64 decode steps.
if [ "${SECTIONS:-0}" = 1 ]; then
  start=$SECONDS
  [ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
  timeout -k 10 ${NCU_T:-150} ncu --clock-control none --kernel-name qerl_wgmma_w4a16 \
    --launch-skip ${SECTIONS_SKIP:-300} --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 64 --prompt 256 \
    --new-tokens 16 --no-check > "$OUT/ncu-sections.txt" 2>&1
  echo "== warpgroup launches, ncu sections: $((SECONDS - start)) s"
  grep -E "^  qerl_wgmma|Grid Size|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|L1/TEX Hit|Shared Memory|Compute \(SM\)|Local Memory|Stall|stall|OPT" \
    "$OUT/ncu-sections.txt" | sed 's/  */ /g' | head -${SECTIONS_LINES:-90}
fi
cd "$OUT" && tar -czf results.tgz --exclude results.tgz --exclude log.txt ./* && rm -f ./*.csv ./*.jsonl ./ncu-*.txt ./test.txt
