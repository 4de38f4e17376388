#!/usr/bin/env bash
# Where the batch-1 decode product (gemv) loses its time: one device call.
# 1. GPU time of every kernel of one batch-1 decode step (tools/device_step_profile.sh);
# 2. ncu's sections (speed of light, occupancy, launch, scheduler and warp-state stats, the
#    stall reasons and the source counters) on a few gemv launches of the decode steps;
# 3. registers and SASS of the gemv kernels (tools/device_sass.sh, PATTERN=gemv).
# Carry .device/qerl.tar.gz. Env: VARIANTS (step-profile specs, default "def:@1"), GEMV_ENV
# (environment of step 2, e.g. QERL_GEMV=v2), GEMV_SKIP (gemv launches skipped, 300),
# GEMV_COUNT (6), SASS (1: run step 3).
source tools/device_preamble.sh
TOP=${TOP:-24} bash tools/device_step_profile.sh ${VARIANTS:-"def:@1"}
reasons="long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle not_selected selected barrier no_instruction dispatch_stall drain imc_miss branch_resolving membar sleeping tex_throttle misc"
metrics=$(for r in $reasons; do printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done)
start=$SECONDS
env ${GEMV_ENV:-} timeout -k 10 ${NCU_T:-200} ncu --clock-control none --kernel-name regex:gemv \
  --launch-skip ${GEMV_SKIP:-300} --launch-count ${GEMV_COUNT:-6} \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "${metrics%,}" \
  /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1 --prompt 256 \
  --new-tokens 16 --no-check > "$OUT/ncu-gemv.txt" 2>&1
echo "== gemv sections: $((SECONDS - start)) s"
grep -E "^  [a-z_]*gemv|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp Per|No Eligible|Active Warps Per|Eligible Warps|Grid Size|Block Size|Waves Per SM|Executed Ipc A|stalled_(long_scoreboard|short_scoreboard|wait|math_pipe|mio|lg_throttle|not_selected|no_instruction|barrier|dispatch)" "$OUT/ncu-gemv.txt" | sed 's/  */ /g' | head -${GEMV_LINES:-200}
if [ "${SASS:-1}" = 1 ]; then
  PATTERN=${SASS_PATTERN:-gemv} BATCHES=1 bash tools/device_sass.sh /tmp/qerl 2>&1 | tail -12
fi
