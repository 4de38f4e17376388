#!/usr/bin/env bash
# Issue 19 item 6 on a GPU: a 7B GRPO update that cannot fit must end with qerl's message
# ("out of device memory in ...: lower ...") and a non-zero exit, not a panic screen.
# 64 sequences of 256 + 1024 tokens in one micro-batch without activation checkpointing: the
# MLP activation is 1.6e9 elements (under the 2^31 refused at start-up), and keeping every
# layer's activations needs several hundred GB.
# There (repository root; carry .device/qerl.tar.gz):  bash tools/device_oom_check.sh
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out" runs/oom
tar -xzf .device/qerl.tar.gz -C runs/oom || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$SECONDS
timeout -k 10 "${OOM_TIMEOUT:-200}" runs/oom/qerl bench train --shape qwen2.5-7b --precision nvfp4 \
  --rollout synthetic --prompt-len 256 --completion-len 1024 --grad-accum 1 --steps 1 --beta 0 \
  --no-checkpointing > "$out/oom.log" 2>&1
code=$?
tail -n 12 "$out/oom.log"
echo "oom-check exit $code after $((SECONDS - start)) s"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
