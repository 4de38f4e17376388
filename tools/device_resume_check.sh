#!/usr/bin/env bash
# Resuming on CUDA (the bf16 optimizer-moment bug of docs/distributed.md): 4 steps of the
# tiny-math config with checkpoints at 2 and 4, then the checkpoint of step 2 resumed to step 4;
# prints both runs' steps 2-3 and the largest adapter difference at step 4.
# There (carry .device/qerl.tar.gz): bash tools/device_resume_check.sh
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p $out /tmp/o
[ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
source tools/device_cache.sh
export CUBECL_AUTOTUNE_LEVEL=minimal
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ
[ -f runs/demo/tiny-math-nvfp4/config.json ] || /tmp/qerl quantize models/tiny-math runs/demo/tiny-math-nvfp4 > /dev/null
c=(train --config configs/tiny-math.toml --device cuda --quiet --set rollout.batch_prompts=16 --set train.steps=4)
timeout -k 10 ${FIRST_TIMEOUT:-480} /tmp/qerl "${c[@]}" --set train.ckpt_interval=2 --set 'train.output_dir="/tmp/o/straight"' > /tmp/o/straight.log 2>&1
echo "straight run: exit $?, $SECONDS s"
timeout -k 10 120 /tmp/qerl "${c[@]}" --resume /tmp/o/straight/checkpoint-000002 --set 'train.output_dir="/tmp/o/resumed"' > /tmp/o/resumed.log 2>&1
echo "resumed run: exit $?, $SECONDS s"
tail -n 3 /tmp/o/*.log
python3 - <<'PY'
import json
from safetensors.numpy import load_file
def m(run): return {x["step"]: x for x in map(json.loads, open(f"/tmp/o/{run}/metrics.jsonl"))}
a, b = m("straight"), m("resumed")
for s in (2, 3):
    print(s, *(f"{k} {a[s][k]} / {b[s][k]}" for k in ["reward_mean", "loss", "grad_norm", "completion_len_mean"]))
f = "checkpoint-000004/adapter_model.safetensors"
x, y = load_file(f"/tmp/o/straight/{f}"), load_file(f"/tmp/o/resumed/{f}")
print("max |adapter difference| at step 4, straight vs resumed:", max(float(abs(x[k].astype("float64") - y[k]).max()) for k in x))
PY
cp /tmp/o/*.log $out/ 2>/dev/null
