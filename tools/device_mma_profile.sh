#!/usr/bin/env bash
# Where the decode-batch product (gemm_mma, staged) spends its instructions: one device call.
# 1. GPU time of every kernel of one decode step at BATCH (tools/device_step_profile.sh);
# 2. ncu's instruction, scheduler and warp-state sections on a few gemm_mma launches
#    (executed instructions per launch, so instructions per `mma` follow from the shape);
# 3. registers and SASS of the gemm_mma kernels (tools/device_sass.sh) into $OUT/sass.tgz.
# Carry .device/qerl.tar.gz. Env: BATCH (64), MMA_ENV (environment of steps 2-3), MMA_SKIP
# (gemm_mma launches skipped, 60), MMA_COUNT (8), SASS (1), PROFILE (1: run step 1).
source tools/device_preamble.sh
b=${BATCH:-64}
[ "${PROFILE:-1}" = 1 ] && TOP=${TOP:-20} bash tools/device_step_profile.sh "def:${MMA_ENV:-}@$b"
reasons="long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle not_selected selected barrier no_instruction dispatch_stall drain branch_resolving tex_throttle misc"
metrics=$(for r in $reasons; do printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done)
metrics="${metrics}smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,sm__cycles_active.avg,smsp__cycles_active.avg"
start=$SECONDS
env ${MMA_ENV:-} timeout -k 10 ${NCU_T:-200} ncu --clock-control none --kernel-name regex:gemm_mma \
  --launch-skip ${MMA_SKIP:-60} --launch-count ${MMA_COUNT:-8} \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --metrics "$metrics" \
  /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch $b --prompt 256 \
  --new-tokens 16 --no-check > "$OUT/ncu-mma.txt" 2>&1
echo "== gemm_mma sections: $((SECONDS - start)) s"
grep -E "^  [a-z_]*gemm_mma|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Warp Per|No Eligible|Eligible Warps|Grid Size|Block Size|Waves Per SM|Executed Ipc A|inst_executed|cycles_active|stalled_(long_scoreboard|short_scoreboard|wait|math_pipe|mio|lg_throttle|not_selected|no_instruction|barrier|dispatch)" "$OUT/ncu-mma.txt" | sed 's/  */ /g' | head -${MMA_LINES:-260}
if [ "${SASS:-1}" = 1 ]; then
  PATTERN=${SASS_PATTERN:-gemm_mma} BATCHES=$b bash tools/device_sass.sh /tmp/qerl 2>&1 | tail -12
fi
