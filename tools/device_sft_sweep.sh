#!/usr/bin/env bash
# Several `qerl sft` runs of models/tiny-math's recipe side by side on one GPU, differing in the
# flags each names, to pick the model that leaves RL room (see models/tiny-math/README.md).
# Here: build and pack the binary as in tools/device_sft.sh. There (carry .device):
#   SFT_RUNS="sc50-900 --steps 900 --shortcut-fraction 0.5; sc50-1200 --steps 1200 --shortcut-fraction 0.5" \
#     bash tools/device_sft_sweep.sh
# SFT_RUNS: runs separated by ';', each a name and its flags (default: "sft-420 --steps 420").
# Every run also gets --device cuda --batch 64 --lr 1e-3 --warmup 30 --eval-limit $EVAL_LIMIT.
# Writes into $OUT: NAME.tgz (each model directory, logs included).
set -uo pipefail
out=${OUT:-/tmp}
[ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
export CUBECL_AUTOTUNE_LEVEL=minimal
IFS=';' read -ra runs <<< "${SFT_RUNS:-sft-420 --steps 420}"
names=()
for r in "${runs[@]}"; do
  set -- $r
  name=$1
  shift
  names+=("$name")
  timeout -k 15 ${SFT_TIMEOUT:-500} /tmp/qerl sft --out /tmp/$name --device cuda --batch 64 \
    --lr 1e-3 --warmup 30 --eval-limit ${EVAL_LIMIT:-150} --quiet "$@" > /tmp/$name.log 2>&1 &
done
wait
for name in "${names[@]}"; do
  mkdir -p /tmp/$name && cp /tmp/$name.log /tmp/$name/device_sft.log
  echo "== $name"
  tail -n 4 /tmp/$name.log
  tar -czf $out/$name.tgz -C /tmp $name
done
