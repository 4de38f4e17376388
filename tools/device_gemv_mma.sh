#!/usr/bin/env bash
# One device call for the decode product on tensor cores (crates/qerl-kernels/src/gemv_mma.
# {rs,cu}, session 24): its CUDA tests against the host f64 reference first (the new test, then
# the decode kernel's own tests, which it now serves where K is a multiple of 128); then, only if
# they passed, the rollout benchmark at batch 1 with it (default) and without it
# (QERL_GEMV_MMA=0: the CUDA-core decode kernel) alternating in one binary (VARIANTS), then
# (PROFILE=1) one decode step's GPU time by kernel (ncu) under each.
# Carry .device/qerl.tar.gz (the release `qerl`, --features cuda) and .device/kernels.xz (the
# kernel test binary, `cargo test --release -p qerl-kernels --features cuda --test kernels
# --no-run`, stripped, xz).
# Env: TESTS (1), TEST_FILTERS, VARIANTS (device_mma_check.sh's), PROFILE (0), PROFILE_SPEC
#   (batch 1: SKIP 13000, COUNT 1200, NEW 64), SECTIONS (0: ncu's stall sections of one layer's
#   launches of the new kernel at batch 1), SASS (0: each .device/sass/*.cu, the kernel text as
#   the host generates it, compiled by nvcc for sm_90a: registers, spills, and its SASS
#   instruction mix, the whole SASS in results.tgz).
# Everything the call prints is also in $OUT/log.txt; the rest is packed into $OUT/results.tgz.
# There: bash tools/device_gemv_mma.sh
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
exec > >(tee "$OUT/log.txt") 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  xz -dkf .device/kernels.xz && chmod +x .device/kernels
  export QERL_GEMV_MMA_EXPECT=1
  for f in ${TEST_FILTERS:-cuda_bf16::matmul_decode_mma cuda_bf16::matmul_decode_split_k cuda_bf16::matmul_decode_segments}; do
    start=$SECONDS
    echo "== $f"
    timeout -k 10 ${TEST_T:-200} .device/kernels --ignored --test-threads=1 --nocapture "$f" \
      > "$OUT/test.txt" 2>&1
    grep -E "^test |test result|panicked|decode mma kernel|error|Error|seed" "$OUT/test.txt" | head -20
    echo "$f: $((SECONDS - start)) s"
    if ! grep -q "test result: ok" "$OUT/test.txt"; then
      grep -iE -A12 "compilation error|\[Compilation" "$OUT/test.txt" | head -60
      tail -5 "$OUT/test.txt"
      echo "== the decode mma kernel fails its tests: no timing"
      exit 0
    fi
  done
  unset QERL_GEMV_MMA_EXPECT
fi
off=QERL_GEMV_MMA=0
TESTS=0 TAIL=${TAIL:-6} ROLLOUT_T=${ROLLOUT_T:-100} QERL_TAR=.device/qerl.tar.gz \
  VARIANTS=${VARIANTS:-"new:CHECK=1,B=1 old:$off,B=1 new2:B=1 old2:$off,B=1 s32:S=qwen2.5-32b,B=1 o32:$off,S=qwen2.5-32b,B=1"} \
  bash tools/device_mma_check.sh
if [ "${PROFILE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  SKIP=${SKIP:-13000} COUNT=${COUNT:-1200} NEW=${NEW:-64} TOP=${TOP:-16} \
    bash tools/device_step_profile.sh ${PROFILE_SPEC:-"old:$off@1" "new:@1"}
fi
if [ "${SASS:-0}" = 1 ]; then
  PATH=$PATH:/usr/local/cuda/bin
  for f in .device/sass/*.cu; do
    b=$(basename "$f" .cu)
    echo "== SASS $b"
    nvcc -arch=sm_90a -cubin -Xptxas -v -o "/tmp/$b.cubin" "$f" 2>&1 | grep -E "registers|spill|error" | head -5
    cuobjdump -sass "/tmp/$b.cubin" > "$OUT/$b.sass" 2>&1
    python3 - "$OUT/$b.sass" <<'PY'
import collections, re, sys
ops = collections.Counter()
for line in open(sys.argv[1]):
    m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m:
        ops[m.group(2)] += 1
print(sum(ops.values()), "instructions:", " ".join(f"{k} {v}" for k, v in ops.most_common(18)))
PY
    echo
  done
fi
if [ "${SECTIONS:-0}" = 1 ]; then
  start=$SECONDS
  [ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
  timeout -k 10 ${NCU_T:-150} ncu --clock-control none --kernel-name qerl_gemv_mma \
    --launch-skip ${SECTIONS_SKIP:-300} --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1 --prompt 256 \
    --new-tokens 16 --no-check > "$OUT/ncu-sections.txt" 2>&1
  echo "== decode mma launches, ncu sections: $((SECONDS - start)) s"
  grep -E "^  qerl_gemv|Grid Size|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|L1/TEX Hit|Compute \(SM\)|Local Memory|Stall|stall|OPT" \
    "$OUT/ncu-sections.txt" | sed 's/  */ /g' | head -${SECTIONS_LINES:-90}
fi
# STALLS=1: one launch of the new kernel (STALLS_SKIP, default 302: a gate/up product) under
# ncu's full set, then its warp-state totals and the SASS lines with the most stall samples.
if [ "${STALLS:-0}" = 1 ]; then
  start=$SECONDS
  [ -x /tmp/qerl ] || tar -xzf .device/qerl.tar.gz -C /tmp
  timeout -k 10 ${NCU_T:-150} ncu --clock-control none --kernel-name qerl_gemv_mma \
    --launch-skip ${STALLS_SKIP:-302} --launch-count 1 --set full --import-source no -f -o /tmp/stalls \
    /tmp/qerl bench rollout --shape ${STALLS_SHAPE:-qwen2.5-7b} --precision nvfp4 --batch 1 \
    --prompt 256 --new-tokens 16 --no-check > "$OUT/ncu-stalls.txt" 2>&1
  ncu --import /tmp/stalls.ncu-rep --page details --print-details all > "$OUT/stalls-details.txt" 2>&1
  ncu --import /tmp/stalls.ncu-rep --page source --csv --print-source sass > "$OUT/stalls-source.csv" 2>&1
  echo "== stalls of one launch: $((SECONDS - start)) s"
  grep -E "Duration|Registers Per|Achieved Active Warps|Issued Warp Per|Warp Cycles Per Issued|DRAM Throughput|Stall [A-Z]|stall_" \
    "$OUT/stalls-details.txt" | sed 's/  */ /g' | head -${STALLS_LINES:-60}
  python3 - "$OUT/stalls-source.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((i for i, r in enumerate(rows) if "Source" in r), None)
if hdr is None:
    print("no source table"); sys.exit()
h = rows[hdr]; body = rows[hdr + 1:]
key = next((c for c in h if c.startswith("Warp Stall Sampling (All")), None)
print("columns:", "; ".join(h[:40]))
if key is None: sys.exit()
ki, si = h.index(key), h.index("Source")
num = lambda v: float(v.replace(",", "") or 0)
total = sum(num(r[ki]) for r in body if len(r) > ki)
top = sorted((r for r in body if len(r) > ki), key=lambda r: -num(r[ki]))[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]
print(f"stall samples: {total:.0f}")
for r in top:
    print(f"{num(r[ki]):7.0f} {100*num(r[ki])/max(total,1):5.1f}%  {r[si][:90]}")
PY
fi
cd "$OUT" && tar -czf results.tgz --exclude results.tgz --exclude log.txt ./* && rm -f ./*.csv ./*.jsonl ./ncu-*.txt ./test.txt
