#!/usr/bin/env bash
# One device call for the batch-1 decode path (crates/qerl-kernels/src/gemv.rs and the engine's
# row kernels): the CUDA kernel tests against the host f64 reference first, then
# `qerl bench rollout` under each variant, then ncu: one decode step by kernel, and (DENSE=1)
# the sections of the LoRA down-projection kernel (dense_kernel) at batch 1 and 64.
# Everything goes to $OUT/log.txt; a summary is printed last (test results and failures, one
# line per rollout run, the step profile).
# Carry .device/qerl.tar.gz and .device/kernels (see tools/device_mma_check.sh); ENGINE_TESTS=1
# with .device/kernels_cuda runs the engine's CUDA tests (ENGINE_FILTER).
# Env: GEMV_VARIANTS (tools/device_mma_check.sh VARIANTS), PROFILE (1), PROFILE_SPEC
# (tools/device_step_profile.sh spec, "auto:@1"), DENSE (0).
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
TESTS=${TESTS:-1} TEST_T=${TEST_T:-300} QERL_TAR=.device/qerl.tar.gz \
  TEST_FILTERS=${TEST_FILTERS:-"cuda_bf16::matmul_decode cuda_f32::matmul_decode_split_k cuda_f16::matmul_decode_segments"} \
  VARIANTS=${GEMV_VARIANTS:-"auto:CHECK=1,B=1 kp1:QERL_GEMV_K_PLANES=1,B=1"} TAIL=${TAIL:-3} \
  bash tools/device_mma_check.sh
cp /tmp/qm/qerl /tmp/qerl
if [ "${PROFILE:-1}" = 1 ]; then
  SKIP=${SKIP:-20000} COUNT=${COUNT:-1500} NEW=${NEW:-64} TOP=${TOP:-24} \
    bash tools/device_step_profile.sh ${PROFILE_SPEC:-"auto:@1"}
fi
if [ "${DENSE:-0}" = 1 ]; then
  reasons="long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle not_selected barrier no_instruction dispatch_stall"
  metrics=$(for r in $reasons; do printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done)
  for b in 1 64; do
    start=$SECONDS
    timeout -k 10 ${NCU_T:-150} ncu --clock-control none --kernel-name regex:dense_kernel \
      --launch-skip 400 --launch-count 5 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section SchedulerStats --section WarpStateStats --metrics "${metrics%,}" \
      /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch $b --prompt 256 \
      --new-tokens 16 --no-check > "$OUT/ncu-dense-b$b.txt" 2>&1
    echo "== dense_kernel sections, batch $b: $((SECONDS - start)) s"
    grep -E "^  [a-z_]*dense|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Warp Per|Eligible Warps|Grid Size|Block Size|stalled_(long_scoreboard|short_scoreboard|wait|barrier|mio|not_selected|no_instruction)" \
      "$OUT/ncu-dense-b$b.txt" | sed 's/  */ /g' | head -${DENSE_LINES:-70}
  done
fi
} > "$OUT/log.txt" 2>&1
echo "== summary (full log: log.txt)"
grep -E "^== kernel tests|^== engine|test result|panicked|FAILED|failed|^tests |^engine tests" "$OUT/log.txt" | head -40
grep -E "^rollout .*: [0-9]+ s|^check|error|Error" "$OUT/log.txt" | head -24
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "rollout-*.jsonl")), key=os.path.getmtime):
    name = os.path.basename(f)[8:-6]
    for line in open(f):
        d = json.loads(line)
        print(f"{name:12s} {d['shape']:12s} {d['weights']:6s} b{d['batch']:<4d} decode {d['decode_ms_per_step']:7.3f} ms/step "
              f"{d['decode_tokens_per_s']:9.1f} tok/s  prefill {d['prefill_ms']:8.1f} ms  {d.get('reserved_mb', 0)/1e3:5.1f} GB")
PY
sed -n '/^== .* batch [0-9]* (/,$p' "$OUT/log.txt" | grep -vE "^compile|^qwen" | head -${PROFILE_LINES:-40}
