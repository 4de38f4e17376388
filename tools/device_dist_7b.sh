#!/usr/bin/env bash
# Data-parallel scaling on a Qwen2.5-7B-shaped model (docs/distributed.md), on a 2-GPU machine
# (device kind nvidia-h200-x2), from the repository root, carrying .device/qerl.tar.gz (the
# release binary built here with --features cuda, tar -czf'd). Two stages, one device call each,
# on the same warm machine (the model and cubecl's kernel caches stay on it between calls):
#
#   tools/device_dist_7b.sh prepare  # random 7B-shaped bf16 model (transformers, GPU 1), quantized
#                                    # to NVFP4 by qerl; meanwhile, on GPU 0, the tiny-math data-
#                                    # parallel checks (tools/device_distributed.sh: 1 vs 2 GPUs,
#                                    # 2 -> 1 GPU resume, a killed rank) compile most kernels
#   tools/device_dist_7b.sh runs     # the 7B-shaped GRPO run on 1 GPU, then on 2 (--gpus 2), with
#                                    # the same global batch; step times and adapters compared
#
# With SFT_RUNS set, prepare also runs tools/device_sft_sweep.sh on GPU 1 (the machine has cores
# to spare while the kernels compile). Only logs (and the sweep's models) come back in $OUT; the
# runs' directories stay in /tmp/dist-work.
#
# The 7B run is configs/qwen2.5-7b-gsm8k-grpo.toml (the paper's GRPO settings: LoRA 16 on all
# projections + norms, beta 0.04, AQN) with a batch that can be split: 8 GSM8K prompts x 8
# samples, 128 completion tokens (a random model never stops), micro-batches of 16 sequences
# (grad_accum 4 on 1 GPU, 2 per rank on 2: 32 sequences at once ran out of the H200's memory,
# 73 GB peak at 16), and the toy
# `length` reward beside the GSM8K ones (no checker accepts a random model's text; this one
# varies, so groups have advantages and the adapters real gradients). Truncated completions are
# kept in the loss (a random model's are all truncated). DEADLINE (default 560 s) bounds every
# stage so the logs come back.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/dist7b}
work=/tmp/dist-work
mkdir -p "$out" $work
deadline=${DEADLINE:-560}
bin=/tmp/qerl
[ -x $bin ] || tar -xzf .device/qerl.tar.gz -C /tmp
model=/tmp/q7b-nvfp4
left() { echo $((deadline - SECONDS)); }

case ${1:?usage: tools/device_dist_7b.sh prepare|runs} in
prepare)
  if [ ! -d runs/demo/tiny-math-nvfp4 ]; then
    $bin quantize models/tiny-math runs/demo/tiny-math-nvfp4 > "$out/quantize-tiny.log" 2>&1
  fi
  (OUT=$work/tiny TOKENIZER= EXTRA="--set rollout.batch_prompts=16" \
    timeout -k 5 $(($(left) - 10)) tools/device_distributed.sh $bin configs/tiny-math.toml 6 \
    > "$out/tiny.log" 2>&1; echo "tiny-math checks: exit $?" >> "$out/tiny.log") &
  tiny=$!
  if [ -n "${SFT_RUNS:-}" ]; then
    (CUDA_VISIBLE_DEVICES=1 OUT=$out SFT_TIMEOUT=$(($(left) - 25)) bash tools/device_sft_sweep.sh \
      > "$out/sft-sweep.log" 2>&1) &
  fi
  if [ ! -d $model ]; then
    t0=$SECONDS
    CUDA_VISIBLE_DEVICES=1 QWEN_SIZE=7b python3 tools/device-model/make_random_qwen.py /tmp/q7b 2>&1 |
      grep -v Warning | tee "$out/q7b.log"
    timeout -k 5 $(left) $bin quantize /tmp/q7b $model 2>&1 | tail -n 6 | tee -a "$out/q7b.log"
    echo "7B-shaped model made and quantized in $((SECONDS - t0)) s" | tee -a "$out/q7b.log"
    du -sh /tmp/q7b $model | tee -a "$out/q7b.log"
    rm -rf /tmp/q7b
  fi
  wait
  tail -n 40 "$out/tiny.log"
  [ -f "$out/sft-sweep.log" ] && cat "$out/sft-sweep.log"
  ;;
runs)
  [ -d $model ] || { echo "no $model: run the prepare stage first on this machine"; exit 1; }
  OUT=$work/7b STAGES=${DIST_STAGES:-runs} TOKENIZER=tests/fixtures/tokenizers/qwen2.5/tokenizer.json \
    EXTRA="--set model.dir=\"$model\" --set rollout.batch_prompts=${PROMPTS:-8} --set rollout.group_size=${GROUP:-8}
      --set rollout.max_completion_tokens=128
      --set loss.mask_truncated=false --set rewards=[{name=\"format\",weight=0.2},{name=\"gsm8k\",weight=2.0,accuracy=true},{name=\"length\",weight=1.0}]" \
    EXTRA1="--set optim.grad_accum=${ACCUM1:-4}" EXTRA2="--set optim.grad_accum=${ACCUM2:-2}" \
    timeout -k 5 $(left) tools/device_distributed.sh $bin configs/qwen2.5-7b-gsm8k-grpo.toml ${STEPS:-4}
  cp $work/7b/dist.log "$out/dist7b.log"
  for r in gpu1 gpu2; do cp $work/7b/$r/metrics.jsonl "$out/metrics-7b-$r.jsonl"; done
  # DIST_STAGES="gpu1 compare" reruns a part on the same machine; PROMPTS, GROUP, ACCUM1,
  # ACCUM2, STEPS change the batch (e.g. PROMPTS=16 GROUP=16 ACCUM1=16 ACCUM2=8 STEPS=3)
  ;;
esac
