#!/usr/bin/env bash
# The training's element-wise ops on an H100: the CUDA tests of the fused SwiGLU gate and RoPE
# (kernels, modules, transformers parity), then `qerl bench train` with them and with burn's ops
# (QERL_SILU_MUL=burn QERL_ROPE=burn) in the same call. One device call; carry .device
# (qerl.tar.gz: the release `qerl` --features cuda; tests.txz: the release test binaries
# kernels, modules, parity, stripped).
# there: bash tools/device_train_ops.sh
# Env: VARIANTS (space-separated NAME:ENV,ENV..., default "fused: burn:QERL_SILU_MUL=burn,QERL_ROPE=burn"),
#   ARGS (the bench's arguments, default issue 16's 7B step with synthetic rollouts), TESTS (1),
#   T (seconds per bench run, 300).
source tools/device_preamble.sh
if [ "${TESTS:-1}" = 1 ]; then
  mkdir -p /tmp/tb && tar -xJf .device/tests.txz -C /tmp/tb
  # the parity test finds its fixtures from the path it was built in
  mkdir -p /work && { [ -e /work/main ] || ln -sfn "$PWD" /work/main; }
  start=$SECONDS
  (cd crates/qerl-kernels && timeout 300 /tmp/tb/kernels --ignored --test-threads=1 \
    cuda_bf16::rope cuda_f16::rope cuda_f32::rope cuda_bf16::silu cuda_f16::silu cuda_f32::silu \
    > "$OUT/t-kernels.log" 2>&1; echo "kernels exit $?") &
  (cd crates/qerl-nn && timeout 300 /tmp/tb/modules --ignored --test-threads=1 cuda \
    > "$OUT/t-modules.log" 2>&1; echo "modules exit $?") &
  (cd crates/qerl-model && timeout 300 /tmp/tb/parity --ignored --test-threads=1 cuda \
    > "$OUT/t-parity.log" 2>&1; echo "parity exit $?") &
  wait
  echo "tests took $((SECONDS - start)) s"
  grep -hE "^test |test result|panicked|relative error|max \|" "$OUT"/t-*.log | grep -v "ignored, " | head -n 60
fi
args=${ARGS:-"--shape qwen2.5-7b --precision nvfp4 --prompts 8 --group 8 --prompt-len 256 --completion-len 1024 --grad-accum 4 --rollout synthetic --steps 2"}
variants=${VARIANTS:-fused: burn:QERL_SILU_MUL=burn,QERL_ROPE=burn}
for v in $variants; do
  name=${v%%:*}; envs=${v#*:}
  echo "== $name (${envs:-defaults}): qerl bench train $args"
  start=$SECONDS
  # shellcheck disable=SC2086
  env ${envs//,/ } timeout -k 10 "${T:-300}" /tmp/qerl bench train --device cuda $args \
    > "$OUT/bench-$name.log" 2>&1
  echo "exit $? after $((SECONDS - start)) s"
  grep -E "step [0-9]|^\| |peak|grad" "$OUT/bench-$name.log" | tail -n 8
done
