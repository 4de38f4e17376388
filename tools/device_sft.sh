#!/usr/bin/env bash
# Makes models/tiny-math on a GPU machine, then checks a short CUDA training run.
# Here (the development machine):
#   CARGO_TARGET_DIR=/tmp/tgt-rel cargo build --release -p qerl-train --features cuda
#   mkdir -p .device && cp /tmp/tgt-rel/release/qerl .device/ && strip .device/qerl && tar -czf .device/qerl.tar.gz -C .device qerl
# There (device tool, carry .device):
#   bash tools/device_sft.sh
# Writes into $OUT: tiny-math.tgz (the model directory), device.txt, sft.log, train-cuda.log.
set -uo pipefail
out=${OUT:-/tmp}
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee $out/device.txt
# burn's matmul autotune compiles every candidate kernel of every new shape with NVRTC: on a
# run this short that costs more than it saves.
export CUBECL_AUTOTUNE_LEVEL=minimal
budget=${SFT_BUDGET:-330}
/tmp/qerl sft --out $out/tiny-math --device cuda --time-budget $budget --steps ${STEPS:-20000} --batch 64 \
  --lr 1e-3 --warmup ${WARMUP:-200} --eval-limit ${EVAL_LIMIT:-150} --quiet 2>&1 | tee $out/sft.log
echo "qerl sft wall time: $SECONDS s" | tee -a $out/sft.log
# one archive: the device tool brings back a limited number of files
tar -czf $out/tiny-math.tgz -C $out tiny-math && rm -rf $out/tiny-math
# The trainer on CUDA (bf16): the tiny fixture, 4 steps (the NaN of the first GPU attempt).
if [ -z "${SKIP_TRAIN:-}" ] && [ $SECONDS -lt 500 ]; then
  QERL_DATA_DIR=$PWD/data timeout $((590 - SECONDS)) /tmp/qerl train --config configs/tiny-cpu.toml \
    --tokenizer tests/fixtures/tokenizers/tiny/tokenizer.json --device cuda --quiet \
    --set train.output_dir=\"$out/tiny-cpu-cuda\" 2>&1 | tail -n 8 | tee $out/train-cuda.log
  tail -n 4 $out/tiny-cpu-cuda/metrics.jsonl 2>/dev/null | cut -c1-300
  rm -rf $out/tiny-cpu-cuda/checkpoint-* $out/tiny-cpu-cuda/*.png
fi
