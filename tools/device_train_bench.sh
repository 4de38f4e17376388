#!/usr/bin/env bash
# The training benchmark of issue 16 on a GPU machine: `qerl bench train` (GRPO steps on random
# Qwen2.5-shaped weights built in memory, NVFP4 against BF16 LoRA in one process), then one
# markdown table of every part.
#
# Usage: bash tools/device_train_bench.sh QERL_BINARY [PART...]
#   QERL_BINARY: the release `qerl` built with --features cuda.
#   PART (default: 7b 32b 32b-context; each fits one 10-minute device call):
#     7b          8 prompts x G 8, 256 + 1,024 tokens, grad_accum 4 (target: peak <= 24 GB,
#                 NVFP4 step >= 1.3x the BF16 LoRA step)
#     7b-nockpt   the same without activation checkpointing (what checkpointing saves)
#     7b-ga8      the same at grad_accum 8 (22.7 GB peak on an H100, 2026-11-27)
#     32b         the paper's 32B settings: 1 prompt x G 8, 256 + 2,048 tokens, beta 0.04
#     32b-context NVFP4 32B, synthetic rollouts: the longest completion whose step fits
#                 (target: prompt + completion >= 8,192; the search takes several calls)
#     32b-8k      NVFP4 32B, 1 x 8 sequences of 256 + 7,936 tokens, grad_accum 4, synthetic
#                 rollouts, no reference pass: one update at the 8,192-token target (~6 min)
# Env: OUT (logs, default /tmp/out/train-bench), T (seconds per part, default 560),
#   EXTRA (more `qerl bench train` arguments for every part).
set -uo pipefail
qerl=${1:?usage: tools/device_train_bench.sh QERL_BINARY [PART...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(7b 32b 32b-context)
out=${OUT:-/tmp/out}/train-bench
mkdir -p "$out"
limit=${T:-560}
# shellcheck disable=SC2206
extra=(${EXTRA:-})

device=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
date=$(date -u +%F)
echo "device: ${device:-unknown}; date: $date; binary: $qerl" | tee "$out/device.txt"

run_part() {
  local part=$1
  local args
  case $part in
    7b) args=(--shape qwen2.5-7b --prompts 8 --group 8 --prompt-len 256 --completion-len 1024
      --grad-accum 4 --steps 2) ;;
    7b-nockpt) args=(--shape qwen2.5-7b --prompts 8 --group 8 --prompt-len 256 --completion-len 1024
      --grad-accum 4 --steps 2 --no-checkpointing) ;;
    32b) args=(--shape qwen2.5-32b --prompts 1 --group 8 --prompt-len 256 --completion-len 2048
      --grad-accum 1 --steps 2) ;;
    32b-context) args=(--shape qwen2.5-32b --precision nvfp4 --prompts 1 --group 8 --prompt-len 256
      --completion-len 2048 --grad-accum 1 --steps 1 --rollout synthetic --max-context
      --max-context-limit 32768) ;;
    7b-ga8) args=(--shape qwen2.5-7b --prompts 8 --group 8 --prompt-len 256 --completion-len 1024
      --grad-accum 8 --steps 2) ;;
    32b-8k) args=(--shape qwen2.5-32b --precision nvfp4 --prompts 1 --group 8 --prompt-len 256
      --completion-len 7936 --grad-accum 4 --steps 1 --rollout synthetic --beta 0) ;;
    *) echo "unknown part \`$part\` (7b, 7b-nockpt, 7b-ga8, 32b, 32b-context, 32b-8k)" >&2; return 2 ;;
  esac
  echo "== $part: qerl bench train ${args[*]} ${extra[*]}"
  local start=$SECONDS
  timeout -k 10 "$limit" "$qerl" bench train --device cuda "${args[@]}" "${extra[@]}" 2>&1 |
    tee "$out/$part.log"
  local rc=${PIPESTATUS[0]}
  echo "== $part: exit $rc after $((SECONDS - start)) s"
}

for p in "${parts[@]}"; do run_part "$p"; done

echo
echo "Training benchmark, $device, $date (\`bash tools/device_train_bench.sh qerl ${parts[*]}\`)"
echo
echo "| part | shape | weights | prompts x G | tokens | step s | rollout s | reference s | update s | update TFLOP/s | peak reserved GB | first step s | max context |"
echo "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for p in "${parts[@]}"; do
  [ -f "$out/$p.log" ] || continue
  grep -E '^\| qwen' "$out/$p.log" | sed "s/^|/| $p |/"
  if ! grep -qE '^\| qwen' "$out/$p.log"; then
    echo "| $p | (no table: see $out/$p.log) | | | | | | | | | | | |"
  fi
done
