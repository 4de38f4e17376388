#!/usr/bin/env bash
# One device call: the 7B GRPO step's reference and update (synthetic rollouts) with cuBLAS
# ordered against cubecl on the device (the default) and through the host
# (QERL_CUBLAS_ORDER=host), one process each, the first on empty kernel caches. Carry
# .device/qerl.tar.gz (the release `qerl`, --features cuda).
# there: bash tools/device_train_order.sh
# Env: ORDERS (device host), STEPS (3), T (seconds per process, 260), ARGS (the bench's shape
#   arguments, default issue 16's 7B configuration).
source tools/device_preamble.sh
args=${ARGS:-"--shape qwen2.5-7b --precision nvfp4 --prompts 8 --group 8 --prompt-len 256 --completion-len 1024 --grad-accum 4 --rollout synthetic"}
for order in ${ORDERS:-device host}; do
  echo "== QERL_CUBLAS_ORDER=$order: qerl bench train $args --steps ${STEPS:-3}"
  start=$SECONDS
  # shellcheck disable=SC2086
  QERL_CUBLAS_ORDER=$order timeout -k 10 "${T:-260}" /tmp/qerl bench train --device cuda $args \
    --steps "${STEPS:-3}" > "$OUT/train-$order.log" 2>&1
  echo "exit $? after $((SECONDS - start)) s"
  grep -vE '^\s*$' "$OUT/train-$order.log" | grep -E 'step|norm|^\|' | tail -n 12
done
