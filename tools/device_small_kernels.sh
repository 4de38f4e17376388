#!/usr/bin/env bash
# One device call: ncu's sections (throughput, memory, warp stalls, occupancy) of the small
# kernels of one batch-64 decode step (the LoRA down-projections, the norms, RoPE and SiLU·mul
# from the slices, attention), for seeing what bounds a kernel of a few microseconds.
# Carry .device/qerl.tar.gz. There: bash tools/device_small_kernels.sh
# Env: SKIP (launches skipped: the step-profile estimate for batch 64 plus 400), COUNT (170).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
source tools/device_cuda_libs.sh > /dev/null
[ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ
start=$SECONDS
timeout -k 10 ${NCU_T:-300} ncu --clock-control none --launch-skip ${SKIP:-20321} \
  --launch-count ${COUNT:-170} \
  --kernel-name regex:"${KERNELS:-lora_down|add_rms_norm|rope_kv_parts|silu_mul_parts|attention_tc}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section Occupancy --section LaunchStats \
  /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 64 --prompt 256 \
  --new-tokens 16 --no-check > "$OUT/ncu-small.txt" 2>&1
echo "ncu: $((SECONDS - start)) s"
python3 - "$OUT/ncu-small.txt" <<'PY'
import re, sys, collections
text = open(sys.argv[1]).read()
blocks = re.split(r"\n  (?=[a-z_0-9]+_kernel|attention)", text)
seen = collections.OrderedDict()
keys = ["Duration", "Memory Throughput", "DRAM Throughput", "L2 Cache Throughput",
        "L1/TEX Cache Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
        "Registers Per Thread", "Grid Size", "Block Size", "Warp Cycles Per Issued Instruction",
        "Issued Warp Per Scheduler", "Waves Per SM"]
for b in blocks[1:]:
    name = b.split("(")[0].strip()[:40]
    grid = re.search(r"\((\d+), (\d+), (\d+)\)x", b)
    k = name + (" " + "x".join(grid.groups()) if grid else "")
    if k in seen:
        continue
    vals = []
    for key in keys:
        m = re.search(re.escape(key) + r"\s+(\S+)\s+([\d.,]+)", b)
        if m:
            vals.append(f"{key}={m.group(2)}{'' if m.group(1) in ('%',) else m.group(1)}".replace("%%", "%"))
    stalls = re.findall(r"(?:spent|On average).{0,220}", b)
    seen[k] = (vals, stalls[:2])
for k, (vals, stalls) in seen.items():
    print("==", k)
    print("  " + "; ".join(vals))
    for s in stalls:
        print("  >", s.strip()[:220])
PY
