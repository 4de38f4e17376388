#!/usr/bin/env bash
# Device checks of the rollout engine beyond the benchmark (issue 15), one call:
#  1. ncu: the GPU time of the kernels of one decode step at batch 1 (7B-shaped NVFP4), to set
#     against the step's wall time (how much of it is launch overhead);
#  2. `qerl generate` on models/tiny-math (bf16 and nvfp4) through the engine and through the
#     burn path (QERL_ENGINE=0): the same greedy tokens;
#  3. the strategy stress test of the training products (issue 16, item 4), when carried.
# Carry .device (qerl.tar.gz; strategy_stress: the release test binary).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
source tools/device_cuda_libs.sh > "$OUT/cuda-libs.txt"
tar -xzf .device/qerl.tar.gz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
start=$SECONDS
# 1. Kernel times of ~600 launches in the steady decode of a 24-token batch-1 run.
timeout -k 10 ${NCU_T:-200} ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  --launch-skip ${NCU_SKIP:-9000} --launch-count ${NCU_COUNT:-1200} \
  /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1 --prompt 256 --new-tokens 24 --no-check \
  > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu: $((SECONDS - start)) s, $(grep -c gpu__time_duration "$OUT/ncu.csv") kernel rows"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = [r for r in rows[1:] if r[head.index("Metric Name")] == "gpu__time_duration.sum"]
ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
t = collections.Counter(); n = collections.Counter()
for r in rows:
    name = r[ki].split("(")[0][:48]
    t[name] += float(r[vi].replace(",", "")) * scale.get(r[ui], 1.0); n[name] += 1
total = sum(t.values())
print(f"{len(rows)} kernels, {total/1e3:.2f} ms of GPU time ({total/max(len(rows),1):.1f} us each)")
for k, v in t.most_common(12):
    print(f"  {k:48s} {n[k]:5d} launches {v/1e3:8.2f} ms")
PY
# 2. The engine and the burn path on the embedded model.
for p in ${GEN_PRECISIONS:-nvfp4}; do
  for e in 1 0; do
    start=$SECONDS
    QERL_ENGINE=$e timeout -k 10 ${GEN_T:-150} /tmp/qerl generate --device cuda --model models/tiny-math --precision $p \
      --prompt "Question: Tom has 12 apples and buys 35 more. How many apples does he have?" --greedy --max-new-tokens 48 --json \
      > "$OUT/gen-$p-engine$e.json" 2> "$OUT/gen-$p-engine$e.err"
    echo "generate $p engine=$e: rc $? in $((SECONDS - start)) s: $(python3 -c "import json,sys; d=json.load(open('$OUT/gen-$p-engine$e.json')); c=d['completions'][0] if 'completions' in d else d; print(c.get('ids', c)[:48])" 2>&1)"
  done
done
# 3. The training products back to back through every strategy.
if [ -f .device/strategy_stress ]; then
  start=$SECONDS
  timeout -k 10 ${STRESS_T:-240} .device/strategy_stress --ignored --test-threads=1 > "$OUT/stress.log" 2>&1
  echo "strategy_stress: rc $? in $((SECONDS - start)) s"; tail -15 "$OUT/stress.log"
fi
