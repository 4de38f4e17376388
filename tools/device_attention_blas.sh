#!/usr/bin/env bash
# One device call for attention on cuBLAS (issue 16): the attention suite on CUDA (bf16 and f16
# take the cuBLAS path, f32 the fused kernels) against the f64 host reference, then
# `qerl bench attention` at the training shape with cuBLAS and with the fused kernels
# (QERL_ATTENTION=fused), then the 7B GRPO step (synthetic rollouts). Carry .device/ with
# qerl.tar.gz (the release `qerl`, --features cuda) and attention (the release test binary of
# `cargo test --release -p qerl-kernels --features cuda --test attention --no-run`, stripped).
# there: bash tools/device_attention_blas.sh
# Env: SEQ (1280), BATCH (16), STEPS (2), T_TRAIN (seconds, 240).
source tools/device_preamble.sh
echo "== attention suite"
timeout 200 .device/attention --ignored --test-threads=1 cuda > "$OUT/attention-tests.log" 2>&1
echo "exit $?"
grep -E "^test |test result|panicked" "$OUT/attention-tests.log" | tail -n 8
for path in cublas fused; do
  echo "== qerl bench attention, $path, ${BATCH:-16} x ${SEQ:-1280}"
  QERL_ATTENTION=$path timeout 150 /tmp/qerl bench attention --device cuda --dtype bf16 \
    --batch "${BATCH:-16}" --seq "${SEQ:-1280}" --iters 5 2>&1 | tail -n 6
done
echo "== qerl bench train, 7B, synthetic rollouts"
timeout -k 10 "${T_TRAIN:-240}" /tmp/qerl bench train --device cuda --shape qwen2.5-7b \
  --precision nvfp4 --prompts 8 --group 8 --prompt-len 256 --completion-len 1024 --grad-accum 4 \
  --rollout synthetic --steps "${STEPS:-2}" 2>&1 | grep -E "step|^\|" | tail -n 6
