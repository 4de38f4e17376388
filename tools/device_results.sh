#!/usr/bin/env bash
# The tiny-math RL comparison of docs/results.md on one GPU: the default demo (NVFP4 + LoRA,
# GRPO + AQN) beside the same run with BF16 LoRA and with NVFP4 without AQN, all three at once
# on the one GPU, each with its before / after held-out accuracy.
# Here:  CARGO_TARGET_DIR=/tmp/tgt-rel cargo build --release -p qerl-train --features cuda
#        cp /tmp/tgt-rel/release/qerl .device/qerl && strip .device/qerl && tar -czf .device/qerl.tar.gz -C .device qerl && rm .device/qerl
# There: bash tools/device_results.sh   (device tool, carry .device)
# Knobs: RL_BUDGET (training seconds a run), STEPS, PROMPTS, EVAL_LIMIT, EVAL_INTERVAL, RUN_TIMEOUT.
set -uo pipefail
out=${OUT:-/tmp}
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee $out/device.txt
export CUBECL_AUTOTUNE_LEVEL=minimal
budget=${RL_BUDGET:-330}
/tmp/qerl quantize models/tiny-math runs/demo/tiny-math-nvfp4 > $out/quantize.log 2>&1
common=(--time-budget $budget --set train.steps=${STEPS:-200} --set rollout.batch_prompts=${PROMPTS:-16} --set eval.limit=${EVAL_LIMIT:-64}
  --set train.eval_interval=${EVAL_INTERVAL:-0})
timeout -k 20 ${RUN_TIMEOUT:-545} /tmp/qerl "${common[@]}" --set 'train.output_dir="runs/nvfp4-aqn"' > $out/nvfp4-aqn.log 2>&1 &
timeout -k 20 ${RUN_TIMEOUT:-545} /tmp/qerl "${common[@]}" --set 'train.output_dir="runs/bf16-aqn"' --set 'model.dir="models/tiny-math"' \
  --set 'model.precision="bf16"' > $out/bf16-aqn.log 2>&1 &
timeout -k 20 ${RUN_TIMEOUT:-545} /tmp/qerl "${common[@]}" --set 'train.output_dir="runs/nvfp4-noaqn"' --set 'aqn.schedule="none"' > $out/nvfp4-noaqn.log 2>&1 &
wait
for r in nvfp4-aqn bf16-aqn nvfp4-noaqn; do
  cp runs/$r/metrics.jsonl $out/$r.metrics.jsonl 2>/dev/null
  cp runs/$r/eval.jsonl $out/$r.eval.jsonl 2>/dev/null
  cp runs/$r/metrics.png $out/$r.png 2>/dev/null
done
tar -czf $out/results.tgz -C $out $(cd $out && ls *.metrics.jsonl *.eval.jsonl *.png *.log 2>/dev/null) &&
  rm -f $out/*.metrics.jsonl $out/*.eval.jsonl $out/*.png
for r in nvfp4-aqn bf16-aqn nvfp4-noaqn; do
  echo "== $r"; grep -v "^step " $out/$r.log | tr '\r' '\n' | grep -v "^\s*$" | tail -n 9
done
