#!/usr/bin/env bash
# Where a decode step of the rollout engine goes (issue 15): ncu's GPU time of every kernel of a
# few steady decode steps, summed per kernel name, for each batch size given, against the wall
# time per step of the same run without ncu. One device call.
# Carry .device (qerl.tar.gz: the release `qerl` built with --features cuda).
# Usage there: bash tools/device_engine_profile.sh [batch...]   (default: 1 64)
#   env: SHAPE (qwen2.5-7b), PRECISION (nvfp4), NEW (24 new tokens), SKIP (launches skipped:
#   the prefill and the first steps), COUNT (launches profiled); the wall-time bench after:
#   BENCH_BATCHES, BENCH_PRECISION, BENCH_NEW; HF_BATCHES runs the transformers peer too
source tools/device_preamble.sh
batches=("$@")
[ ${#batches[@]} -eq 0 ] && batches=(1 64)
for b in "${batches[@]}"; do
  start=$SECONDS
  timeout -k 10 ${NCU_T:-200} ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip ${SKIP:-$((b > 8 ? 12500 : 9000))} --launch-count ${COUNT:-1200} \
    /tmp/qerl bench rollout --shape ${SHAPE:-qwen2.5-7b} --precision ${PRECISION:-nvfp4} --batch $b \
    --prompt 256 --new-tokens ${NEW:-24} --no-check > "$OUT/ncu-b$b.csv" 2> "$OUT/ncu-b$b.err"
  echo "== batch $b: ncu $((SECONDS - start)) s"
  python3 - "$OUT/ncu-b$b.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("no ncu rows"); sys.exit()
head = rows[0]; rows = [r for r in rows[1:] if r[head.index("Metric Name")] == "gpu__time_duration.sum"]
ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
gi, bi = head.index("Grid Size") if "Grid Size" in head else None, head.index("Block Size") if "Block Size" in head else None
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
t = collections.Counter(); n = collections.Counter(); grid = {}
for r in rows:
    name = r[ki].split("(")[0][:44]
    t[name] += float(r[vi].replace(",", "")) * scale.get(r[ui], 1.0); n[name] += 1
    if gi is not None: grid.setdefault(name, set()).add(r[gi])
total = sum(t.values())
print(f"{len(rows)} kernels, {total/1e3:.2f} ms of GPU time ({total/max(len(rows),1):.1f} us each)")
for k, v in t.most_common(16):
    g = ",".join(sorted(grid.get(k, []))[:3]) if gi is not None else ""
    print(f"  {k:44s} {n[k]:5d} x {v/n[k]:8.1f} us = {v/1e3:7.2f} ms  {g}")
PY
done
# Wall time per step without ncu, same shapes.
timeout -k 10 ${BENCH_T:-300} /tmp/qerl bench rollout --shape ${SHAPE:-qwen2.5-7b} --precision ${BENCH_PRECISION:-nvfp4} \
  --batch ${BENCH_BATCHES:-$(IFS=,; echo "${batches[*]}")} --prompt 256 --new-tokens ${BENCH_NEW:-128} --json "$OUT/bench.jsonl" 2>&1 | tail -${BENCH_LINES:-14}
if [ -n "${HF_BATCHES:-}" ]; then
  timeout -k 10 ${HF_T:-150} python3 tools/hf_rollout_peer.py --shape 7b --batch $HF_BATCHES --prompt 256 --new 128 --budget ${HF_BUDGET:-100} --json "$OUT/hf.jsonl" 2>&1 | grep -v Warning | tail -6
fi
# Details of chosen kernels (DETAIL="regex:batch ...", e.g. "gemv:1 tc_:64"): occupancy,
# registers, throughput and warp stalls of a few launches of the steady decode.
for spec in ${DETAIL:-}; do
  re=${spec%%:*}; b=${spec##*:}
  timeout -k 10 ${DETAIL_T:-120} ncu --clock-control none --kernel-name regex:$re --launch-skip ${DETAIL_SKIP:-300} --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    /tmp/qerl bench rollout --shape ${SHAPE:-qwen2.5-7b} --precision ${PRECISION:-nvfp4} --batch $b \
    --prompt 256 --new-tokens 8 --no-check > "$OUT/detail-$re-$b.txt" 2>&1
  echo "== detail $re batch $b"
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Grid Size|Block Size|Warp Cycles Per Issued|Issue Slots Busy|Shared Memory Configuration Size|Dynamic Shared|L1/TEX Hit|L2 Hit|Executed Ipc A|stall|Stall" "$OUT/detail-$re-$b.txt" | head -${DETAIL_LINES:-60}
done
