#!/usr/bin/env bash
# Data-parallel training on a 2-GPU machine (device kind nvidia-h200-x2): the same run on 1 GPU
# and on 2 GPUs (`--gpus 2`, NCCL), their metrics and adapters compared; the 2-GPU checkpoint
# of step 2 resumed on 1 GPU; a rank killed mid-run must end the other with a message naming it.
#
# The GPU machine has no Rust: build here, carry the binary (see docs/distributed.md):
#   cargo build --release -p qerl-train --features cuda
#   mkdir -p .device && cp target/release/qerl .device/qerl     # .device/ in .git/info/exclude
# then, there, from the repository root (carry: .device):
#   tools/device_distributed.sh .device/qerl [CONFIG] [STEPS]
# e.g. on the embedded model, 16 prompts x 8 samples a step (the global batch of both runs):
#   qerl quantize models/tiny-math runs/demo/tiny-math-nvfp4
#   TOKENIZER= EXTRA="--set rollout.batch_prompts=16" tools/device_distributed.sh .device/qerl configs/tiny-math.toml 10
# TOKENIZER: tokenizer.json for a model directory without one (default: the tiny fixture's;
# empty: the model's own). EXTRA1 / EXTRA2: flags for the 1-GPU / 2-GPU run only (e.g. a
# grad_accum that keeps the micro-batch the same). STAGES (default "runs resume kill"): which
# parts run; "runs" is "gpu1 gpu2 compare", the two runs and their comparison. Everything printed also lands in $OUT (dist.log,
# metrics of both runs). tools/device_dist_7b.sh runs it on a Qwen2.5-7B-shaped random model.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 # NVLink multicast stays off on the shared machines (KINDS.md)
bin=${1:?usage: tools/device_distributed.sh QERL_BINARY [CONFIG] [STEPS]}
config=${2:-configs/tiny-cpu.toml}
steps=${3:-4}
out=${OUT:-/tmp/dist}
mkdir -p "$out"
exec > >(tee "$out/dist.log") 2>&1

source tools/device_cuda_libs.sh # libnccl (and libcublas) for cudarc
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
echo "date: $(date -u +%F), config: $config, steps: $steps, LD_LIBRARY_PATH: ${LD_LIBRARY_PATH:-}"

export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
source tools/device_cache.sh # the driver's PTX cache under target/, beside cubecl's
tok=${TOKENIZER-tests/fixtures/tokenizers/tiny/tokenizer.json}
common=(--config "$config" ${tok:+--tokenizer "$tok"} ${EXTRA:-}
  --device cuda --quiet --set "train.steps=$steps" --set train.ckpt_interval=2)
status=0
timed() { # name, command...
  local name=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  "$@"
  local rc=$?
  t1=$(date +%s.%N)
  echo "== $name: exit $rc, $(python3 -c "print(f'{$t1-$t0:.1f}')") s"
  [ $rc -eq 0 ] || status=1
  return $rc
}

stages=" ${STAGES:-runs resume kill} "
stages=${stages/ runs / gpu1 gpu2 compare }
if [[ $stages == *" gpu1 "* ]]; then
  timed "1 GPU" "$bin" train "${common[@]}" ${EXTRA1:-} --dist-timeout 300 --set "train.output_dir=\"$out/gpu1\""
fi
if [[ $stages == *" gpu2 "* ]]; then
  timed "2 GPUs" "$bin" train "${common[@]}" ${EXTRA2:-} --dist-timeout 300 --gpus 2 --set "train.output_dir=\"$out/gpu2\""
fi
if [[ $stages == *" resume "* ]]; then
  timed "2 GPUs, then resumed on 1 GPU from step 2" "$bin" train "${common[@]}" --dist-timeout 300 \
    --resume "$out/gpu2/checkpoint-000002" --set "train.output_dir=\"$out/gpu2to1\""
fi

if [[ $stages == *" compare "* ]]; then
python3 - "$out" "$steps" <<'EOF'
import json, os, statistics, sys
from safetensors.numpy import load_file
out, steps = sys.argv[1], int(sys.argv[2])
def metrics(run):
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl")]
a, b = metrics("gpu1"), metrics("gpu2")
keys = ["reward_mean", "loss", "grad_norm", "kl", "entropy", "groups_dropped",
        "completion_len_mean", "rollout_time_s", "step_time_s"]
print("step | " + " | ".join(f"{k} (1 GPU / 2 GPUs)" for k in keys))
for x, y in zip(a, b):
    print(f"{x['step']} | " + " | ".join(f"{x[k]} / {y[k]}" for k in keys))
for name, m in [("1 GPU", a), ("2 GPUs", b)]:
    later = m[1:] or m  # step 0 carries the kernel compilation of a fresh process
    print(f"{name}: median step {statistics.median(x['step_time_s'] for x in later):.3f} s, "
          f"median rollout {statistics.median(x['rollout_tokens_per_s'] for x in later):.0f} tokens/s "
          f"(steps 1-{len(m) - 1})")
ckpt = f"checkpoint-{steps:06d}"
for other in ["gpu2", "gpu2to1"]:
    if not os.path.isdir(f"{out}/{other}/{ckpt}"):
        continue
    worst = 0.0
    # LoRA and the trained norms (modules_to_save) are both in the adapter's file
    for f in ["adapter_model.safetensors"]:
        t1, t2 = load_file(f"{out}/gpu1/{ckpt}/{f}"), load_file(f"{out}/{other}/{ckpt}/{f}")
        assert t1.keys() == t2.keys(), f
        worst = max([worst] + [float(abs(t1[k].astype("float64") - t2[k]).max()) for k in t1])
    print(f"max |adapter/norm difference| gpu1 vs {other} at {ckpt}: {worst:.3e}")
EOF
[ $? -eq 0 ] || status=1
fi
[[ $stages == *" kill "* ]] || exit $status

# A rank that dies: kill rank 1 once step 1 is logged; rank 0 must end naming it, and the
# checkpoint of step 2 (if written) must stay loadable.
"$bin" train "${common[@]}" --gpus 2 --set "train.steps=8" --set train.ckpt_interval=1 \
  --dist-timeout 60 --set "train.output_dir=\"$out/kill\"" > "$out/kill.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  [ -s "$out/kill/metrics.jsonl" ] && break
  sleep 1
done
victim=
for p in $(pgrep -P $launcher); do
  if tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=1; then victim=$p; fi
done
echo "== killing rank 1 (pid $victim)"
kill -9 "$victim"
wait $launcher
echo "== launcher exit $? (expected non-zero); its last lines:"
tail -n 5 "$out/kill.log"
grep -q "rank 1" "$out/kill.log" || { echo "the message does not name rank 1"; status=1; }
echo "latest checkpoint: $(cat "$out/kill/latest" 2>/dev/null)"
exit $status
