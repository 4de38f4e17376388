#!/usr/bin/env bash
# Makes models/tiny-math on a GPU machine, then checks a short CUDA training run.
# Here (the development machine):
#   CARGO_TARGET_DIR=/tmp/tgt-rel cargo build --release -p qerl-train --features cuda
#   mkdir -p .device && cp /tmp/tgt-rel/release/qerl .device/ && strip .device/qerl && tar -czf .device/qerl.tar.gz -C .device qerl
# There (device tool, carry .device):
#   bash tools/device_sft.sh
# Writes into $OUT: tiny-math/ (the model directory), device.txt, sft.log, train-cuda.log.
set -uo pipefail
out=${OUT:-/tmp}
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee $out/device.txt
budget=${SFT_BUDGET:-270}
start=$SECONDS
/tmp/qerl sft --out $out/tiny-math --device cuda --time-budget $budget --steps 20000 --batch 64 \
  --lr 1e-3 --warmup 200 --eval-limit 200 --quiet 2>&1 | tee $out/sft.log
echo "qerl sft wall time: $((SECONDS - start)) s" | tee -a $out/sft.log
# The trainer on CUDA (bf16): the tiny fixture, 4 steps (the NaN of the first GPU attempt).
timeout ${TRAIN_TIMEOUT:-150} /tmp/qerl train --config configs/tiny-cpu.toml \
  --tokenizer tests/fixtures/tokenizers/tiny/tokenizer.json --device cuda --quiet \
  --set train.output_dir=\"$out/tiny-cpu-cuda\" 2>&1 | tail -n 8 | tee $out/train-cuda.log
tail -n 4 $out/tiny-cpu-cuda/metrics.jsonl 2>/dev/null | cut -c1-400
