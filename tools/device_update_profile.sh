#!/usr/bin/env bash
# GPU time of every kernel of one GRPO step's reference pass and update (synthetic rollouts), from
# Nsight Compute, summed by kernel name: where the update's seconds go. One device call; carry
# .device/qerl.tar.gz (the release `qerl`, --features cuda).
# there: bash tools/device_update_profile.sh
# Env: ARGS (the bench's arguments; default one micro-batch of issue 16's 7B configuration:
#   16 sequences of 256 + 1,024 tokens), SKIP (launches skipped: building the model, 7000),
#   COUNT (launches profiled, 40000), NCU_T (seconds, 420), TOP (kernels listed, 30).
source tools/device_preamble.sh
args=${ARGS:-"--shape qwen2.5-7b --precision nvfp4 --prompts 2 --group 8 --prompt-len 256 --completion-len 1024 --grad-accum 1 --rollout synthetic --steps 1"}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
csv="$OUT/update-ncu.csv"
echo "what ncu injects: $("$ncu" env 2>/dev/null | grep -i injection | tr '\n' ' ')"
start=$SECONDS
# shellcheck disable=SC2086
# cuBLAS ordered through the host: ncu runs one kernel at a time, so a kernel waiting on the
# device for another stream's GEMM would never end.
QERL_CUBLAS_ORDER=host timeout -k 10 "${NCU_T:-420}" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
  --launch-skip "${SKIP:-7000}" --launch-count "${COUNT:-40000}" \
  /tmp/qerl bench train --device cuda $args > "$csv" 2> "$OUT/update-ncu.err"
echo "ncu exit $? after $((SECONDS - start)) s"
grep -E "step 0|^\| qwen" "$csv" | head -n 4
python3 - "$csv" "${TOP:-30}" <<'PY'
import csv, sys, collections, re
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 10]
if not rows:
    print("no ncu rows"); sys.exit()
h = rows[0]
rows = [r for r in rows[1:] if r[h.index("Metric Name")] == "gpu__time_duration.sum"]
ki, vi = h.index("Kernel Name"), h.index("Metric Value")
unit = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}[rows[0][h.index("Metric Unit")]]
total = collections.Counter(); count = collections.Counter()
for r in rows:
    name = re.sub(r"<.*", "", r[ki]).strip()[:70]
    ms = float(r[vi].replace(",", "")) * unit
    total[name] += ms; count[name] += 1
all_ms = sum(total.values())
print(f"{len(rows)} kernels, {all_ms / 1e3:.2f} s of GPU time")
print("| kernel | launches | GPU ms | share | us a launch |")
print("| --- | ---: | ---: | ---: | ---: |")
for name, ms in total.most_common(int(sys.argv[2])):
    print(f"| {name} | {count[name]} | {ms:.1f} | {100 * ms / all_ms:.1f}% | {1e3 * ms / count[name]:.1f} |")
PY
