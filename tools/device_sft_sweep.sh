#!/usr/bin/env bash
# Several `qerl sft` runs of models/tiny-math's recipe side by side on one GPU, differing only in
# the number of steps, to pick the model whose held-out accuracy leaves RL room (20-60%).
# Here: build and pack the binary as in tools/device_sft.sh. There (carry .device):
#   SFT_STEPS="260 330 420 550" bash tools/device_sft_sweep.sh
# Writes into $OUT: sft-N.tgz (each model directory, logs included).
set -uo pipefail
out=${OUT:-/tmp}
[ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
export CUBECL_AUTOTUNE_LEVEL=minimal
for n in ${SFT_STEPS:-260 330 420 550}; do
  timeout -k 15 ${SFT_TIMEOUT:-500} /tmp/qerl sft --out /tmp/sft-$n --device cuda --steps $n --batch 64 \
    --lr 1e-3 --warmup 30 --eval-limit ${EVAL_LIMIT:-150} --quiet > /tmp/sft-$n.log 2>&1 &
done
wait
for n in ${SFT_STEPS:-260 330 420 550}; do
  mkdir -p /tmp/sft-$n && cp /tmp/sft-$n.log /tmp/sft-$n/device_sft.log
  tail -n 3 /tmp/sft-$n.log
  tar -czf $out/sft-$n.tgz -C /tmp sft-$n
done
