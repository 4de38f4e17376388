#!/usr/bin/env bash
# GPU time of every kernel of one steady decode step (ncu), per variant and batch, summed by kernel
# name and grid, for comparing kernel variants without the step-to-step noise of wall times.
# One device call. Carry .device/qerl.tar.gz (the release `qerl`, --features cuda).
# There: bash tools/device_step_profile.sh "name:ENV=v,ENV=v@64+256" ...
#   each argument: a variant name, its environment (comma-separated, may be empty) and its batches.
# Env: SHAPE (qwen2.5-7b), PRECISION (nvfp4), NCU_T (per run, 150 s), TOP (kernels listed, 12),
#   STEP (launches between two sampling launches that make one decode step, 200-900: ~285 at
#   batch 1 since session 17's fusions, 480-800 at batch 64), NEW (new tokens a run, 16),
#   PROMPT (prompt tokens, 256; the skip estimate assumes 256), COUNT (launches profiled, 3000),
#   CACHE (ncu's --cache-control: all, the default, flushes the caches before each kernel;
#   none keeps what the kernels before left in L2),
#   SKIP (launches skipped, overriding the estimate below; at batch 256 the estimate and 53,000
#   with NEW=64 both fell in the timed prefill: session 22 used SKIP=56000 COUNT=16000 NEW=64).
# The launches skipped are estimated per batch from a 7B profile (2026-11-27): ~7,200 building
# the model, then a warm-up (the prefill, ~1,400 launches per 4,096-row pass, and one decode step
# of ~677) and the timed run's prefill; the window (COUNT, 3000) then holds a few decode steps,
# and the last whole one (between two sampling launches, 600-800 launches) is reported.
source tools/device_preamble.sh
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; envs=${rest%@*}; batches=${rest##*@}
  IFS=, read -ra ev <<< "$envs"
  for b in ${batches//+/ }; do
    passes=$(( (b * ${PROMPT:-256} + 4095) / 4096 ))
    skip=${SKIP:-$(( 7190 + 2 * 1400 * passes + 677 * 3 - 500 ))}
    csv="$OUT/ncu-$name-b$b.csv"
    start=$SECONDS
    env "${ev[@]}" timeout -k 10 ${NCU_T:-150} ncu --clock-control none --cache-control ${CACHE:-all} --metrics gpu__time_duration.sum --csv \
      --launch-skip $skip --launch-count ${COUNT:-3000} \
      /tmp/qerl bench rollout --shape ${SHAPE:-qwen2.5-7b} --precision ${PRECISION:-nvfp4} --batch $b \
      --prompt ${PROMPT:-256} --new-tokens ${NEW:-16} --no-check > "$csv" 2>/dev/null
    echo "== $name batch $b (${envs:-defaults}): ncu $((SECONDS - start)) s"
    python3 - "$csv" "${TOP:-12}" "${STEP:-200-900}" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("  no ncu rows"); sys.exit()
h = rows[0]; rows = [r for r in rows[1:] if r[h.index("Metric Name")] == "gpu__time_duration.sum"]
ki, vi, ii, gi = h.index("Kernel Name"), h.index("Metric Value"), h.index("ID"), h.index("Grid Size")
unit = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[rows[0][h.index("Metric Unit")]]
# one decode step: from a sample_kernel launch to the next one, STEP launches apart
lo, hi = map(int, sys.argv[3].split("-"))
marks = [i for i, r in enumerate(rows) if r[ki].startswith("sample_kernel")]
steps = [(a, b) for a, b in zip(marks, marks[1:]) if lo <= b - a <= hi]
if not steps:
    print(f"  no whole decode step in the window ({len(rows)} kernels, samples at {marks[:8]})"); sys.exit()
a, b = steps[-1]
step = rows[a + 1: b + 1]
t = collections.Counter(); n = collections.Counter()
for r in step:
    k = r[ki].split("(")[0][:34] + " " + r[gi].replace(" ", "")
    t[k] += float(r[vi].replace(",", "")) * unit; n[k] += 1
total = sum(t.values())
print(f"  one step: {len(step)} kernels, {total/1e3:.2f} ms of GPU time")
for k, v in t.most_common(int(sys.argv[2])):
    print(f"  {k:52s} {n[k]:4d} x {v/n[k]:7.1f} us = {v/1e3:6.3f} ms")
PY
  done
done
