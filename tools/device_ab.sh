#!/usr/bin/env bash
# One device call for an engine change measured by A/B (session 27: the LoRA down-projection
# inside the warpgroup product, the o/down K-slices read by the next norm): the segment tests
# against the host f64 reference first (warpgroup kernel; stops here if they fail), then the
# rollout at batch AB_BATCH (64) under AB_VARIANTS alternating ROUNDS (3) times (wall time),
# then batch 256 under VARIANTS256 (the first with the benchmark's check unless CHECK=0), then
# (SASS=1) ptxas registers and spills of the warpgroup kernel per SASS_VARIANTS, then
# (PROFILE="name:ENV@64 ...") tools/device_step_profile.sh's per-kernel GPU time of a step
# (OLD_PROFILE: the same for the OLD_TGZ build).
# ENGINE_TESTS="filter ...": the engine's CUDA tests matching these filters instead of the
# segment tests (carry .device/kernels_cuda, stripped, or kernels_cuda.xz: a call carries 64 MiB;
# session 28: the tensor-core LoRA down-projections).
# EXTRA="name:ENV=v,ENV=v@batch ...": one more wall-time run each, at its batch (session 29);
# SHAPE=qwen2.5-32b among the ENV picks the model shape (session 31).
# KTESTS: the kernel tests' filter (the segment tests on the warpgroup kernel by default).
# CHECK1=1: the benchmark's check at batch 1 (16 new tokens) before the timings (CHECK_T: its
# limit in seconds, 420).
# SANITIZE="ENV=v,...": compute-sanitizer on the kernel tests SANITIZE_TESTS, last.
# Carry .device/qerl.tar.gz and .device/kernels.xz. There: bash tools/device_ab.sh
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
source tools/device_cuda_libs.sh > /dev/null
mkdir -p /tmp/qm && tar -xzf .device/qerl.tar.gz -C /tmp/qm
# OLD_TGZ: a baseline build's tarball, unpacked to /tmp/qm-old; a variant (AB_VARIANTS, EXTRA)
# whose environment holds QERL_BIN=/tmp/qm-old/qerl runs it (session 32).
if [ -n "${OLD_TGZ:-}" ]; then mkdir -p /tmp/qm-old && tar -xzf "$OLD_TGZ" -C /tmp/qm-old; fi
bin_of() { # env words -> the binary they name (QERL_BIN), else the carried one
  local b=/tmp/qm/qerl e; for e in "$@"; do [ "${e%%=*}" = QERL_BIN ] && b=${e#QERL_BIN=}; done
  echo "$b"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ
if [ -n "${ENGINE_TESTS:-}" ]; then
  [ -f .device/kernels_cuda.xz ] && xz -dkf .device/kernels_cuda.xz
  chmod +x .device/kernels_cuda
  start=$SECONDS
  # shellcheck disable=SC2086 # the filters are words
  timeout -k 10 300 .device/kernels_cuda --ignored --test-threads=1 $ENGINE_TESTS \
    > "$OUT/test.txt" 2>&1
  grep -E "^test |test result|panicked|seed|differs|want" "$OUT/test.txt" | cut -c1-300 | head -16
  echo "engine tests: $((SECONDS - start)) s"
  grep -q "test result: ok" "$OUT/test.txt" || { echo "== tests failed: no timing"; exit 0; }
elif [ "${TESTS:-1}" = 1 ]; then
  xz -dkf .device/kernels.xz && chmod +x .device/kernels
  start=$SECONDS
  # shellcheck disable=SC2086 # the filters are words
  QERL_MMA_TEST_KERNEL=warpgroup QERL_MMA_TEST_TILES=default timeout -k 10 200 .device/kernels \
    --ignored --test-threads=1 --nocapture ${KTESTS:-cuda_bf16::matmul_mma_segments} \
    > "$OUT/test.txt" 2>&1
  grep -E "^test |test result|panicked|inside|warpgroup kernel|seed|programmatic" "$OUT/test.txt" | head -12
  echo "segments tests: $((SECONDS - start)) s"
  grep -q "test result: ok" "$OUT/test.txt" || { echo "== tests failed: no timing"; exit 0; }
fi
if [ "${CHECK1:-0}" = 1 ]; then
  echo "== check at batch 1"
  # The exit status and any panic too: a check that hangs or panics prints no check line. On a
  # fresh machine the first run compiles ~217 kernels (NVRTC, one after another): session 33
  # found a 200 s limit too short there (tools/device_hang.sh), hence CHECK_T.
  timeout -k 5 ${CHECK_T:-420} /tmp/qm/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 1 \
    --prompt 256 --new-tokens 16 > "$OUT/check1.txt" 2>&1
  echo "check exit status: $? (124: timed out)"
  grep -E "^\| qwen|check|error|panicked|pdl|graphs" "$OUT/check1.txt" | cut -c1-300
fi
bench() { # env... -- batch check
  timeout -k 5 ${RUN_T:-150} "$@" 2>&1 | grep -E "^\| qwen|check|error" ; }
for i in $(seq 1 ${ROUNDS:-3}); do
  for v in ${AB_VARIANTS:-old:QERL_LORA_INSIDE=0,QERL_RESIDUAL_PARTS=0 new:}; do
    name=${v%%:*}; IFS=, read -ra ev <<< "${v#*:}"
    o=$(env "${ev[@]}" timeout -k 5 150 "$(bin_of "${ev[@]}")" bench rollout --shape qwen2.5-7b \
      --precision nvfp4 --batch ${AB_BATCH:-64} --prompt 256 --new-tokens 128 --no-check 2>&1)
    r=$(echo "$o" | grep "| qwen" | awk -F'|' '{print $6, $8}')
    # The CUDA graphs' report (QERL_GRAPH=1), and any error.
    g=$(echo "$o" | grep -oE "tokens [0-9a-f]{16}|graphs:.*|error.*|panicked.*" | head -3 | tr '\n' ' ' | cut -c1-240)
    echo "ab $i $name: ms/step, decode tokens/s = $r $g"
  done
done
first=1
for v in ${VARIANTS256:-new: old:QERL_LORA_INSIDE=0,QERL_RESIDUAL_PARTS=0}; do
  name=${v%%:*}; IFS=, read -ra ev <<< "${v#*:}"
  check=--no-check; [ $first = 1 ] && [ "${CHECK:-1}" = 1 ] && check=; first=0
  echo "== b256 $name (${v#*:}) $check"
  env "${ev[@]}" timeout -k 5 200 /tmp/qm/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 \
    --batch 256 --prompt 256 --new-tokens 128 $check 2>&1 | grep -E "^\| qwen|check|error"
done
if [ "${SASS:-1}" = 1 ]; then
  for v in ${SASS_VARIANTS:-old:QERL_LORA_INSIDE=0 inside:}; do
    name=${v%%:*}; IFS=, read -ra ev <<< "${v#*:}"
    rm -rf /tmp/sass-run
    echo "== ptxas $name (${v#*:})"
    env "${ev[@]}" OUT="$OUT/$name" PATTERN=wgmma ARCH=sm_90a BATCHES=64 \
      bash tools/device_sass.sh /tmp/qm/qerl > /dev/null 2>&1
    mkdir -p "/tmp/s-$name" && tar -xzf "$OUT/$name/sass.tgz" -C "/tmp/s-$name" 2>/dev/null
    for f in /tmp/s-$name/*.ptxas.txt; do
      echo "-- $(basename "$f")"
      grep -E "registers|spill|C7515" "$f" | cut -c1-200 | head -4
    done
  done
fi
for v in ${EXTRA:-}; do
  name=${v%%:*}; spec=${v#*:}; IFS=, read -ra ev <<< "${spec%@*}"
  shape=qwen2.5-7b
  for e in "${ev[@]}"; do [ "${e%%=*}" = SHAPE ] && shape=${e#SHAPE=}; done
  o=$(env "${ev[@]}" timeout -k 5 150 "$(bin_of "${ev[@]}")" bench rollout --shape "$shape" \
    --precision nvfp4 --batch "${spec##*@}" --prompt 256 --new-tokens 128 --no-check 2>&1)
  r=$(echo "$o" | grep "| qwen" | awk -F'|' '{print $6, $8}')
  g=$(echo "$o" | grep -oE "tokens [0-9a-f]{16}|graphs:.*|error.*|panicked.*" | head -3 | tr '\n' ' ' | cut -c1-240)
  echo "extra $name (batch ${spec##*@}): ms/step, decode tokens/s = $r $g"
done
# STALLS="name:ENV=v,...@kernel-regex ...": one launch of that kernel at batch AB_BATCH under
# ncu's full set (STALLS_SKIP launches of it skipped, 100): its totals and hottest SASS lines.
for v in ${STALLS:-}; do
  name=${v%%:*}; spec=${v#*:}; IFS=, read -ra ev <<< "${spec%@*}"
  rm -f /tmp/st.ncu-rep
  env "${ev[@]}" timeout -k 10 150 ncu --clock-control none --kernel-name "regex:${spec##*@}" \
    --launch-skip ${STALLS_SKIP:-100} --launch-count 1 --set full --import-source no -f -o /tmp/st \
    /tmp/qm/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch ${AB_BATCH:-64} \
    --prompt 256 --new-tokens 16 --no-check > /dev/null 2>&1
  ncu --import /tmp/st.ncu-rep --page details --print-details all > "$OUT/st-$name.txt" 2>&1
  ncu --import /tmp/st.ncu-rep --page source --csv --print-source sass > "$OUT/st-$name.csv" 2>&1
  echo "== stalls $name (${spec})"
  grep -E "Duration|Registers Per|Achieved Active Warps|Issued Warp Per|Warp Cycles Per Issued|L2 Cache Throughput|Memory Throughput|Stall [A-Z]" \
    "$OUT/st-$name.txt" | sed 's/  */ /g' | sort -u | head -${STALLS_LINES:-30}
  python3 - "$OUT/st-$name.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((i for i, r in enumerate(rows) if "Source" in r), None)
if hdr is None:
    print("no source table"); sys.exit()
h = rows[hdr]; body = rows[hdr + 1:]
key = next((c for c in h if c.startswith("Warp Stall Sampling (All")), None)
if key is None: sys.exit()
ki, si = h.index(key), h.index("Source")
num = lambda v: float(v.replace(",", "") or 0)
total = sum(num(r[ki]) for r in body if len(r) > ki) or 1
for r in sorted((r for r in body if len(r) > ki), key=lambda r: -num(r[ki]))[:14]:
    print(f"  {100 * num(r[ki]) / total:5.1f}%  {r[si][:90]}")
PY
done
if [ -n "${PROFILE:-}" ]; then
  # shellcheck disable=SC2086 # the variants are words
  TOP=${TOP:-22} bash tools/device_step_profile.sh $PROFILE
fi
if [ -n "${OLD_PROFILE:-}" ] && [ -n "${OLD_TGZ:-}" ]; then
  # shellcheck disable=SC2086 # the variants are words
  QERL_TGZ=$OLD_TGZ TOP=${TOP:-22} bash tools/device_step_profile.sh $OLD_PROFILE
  tar -xzf .device/qerl.tar.gz -C /tmp
fi
# SANITIZE="ENV=v,...": compute-sanitizer (SANITIZE_TOOLS: memcheck, racecheck, synccheck) on
# the kernel tests SANITIZE_TESTS under those variables (session 32: the shared ring's
# hang); last, after the timings.
if [ -n "${SANITIZE:-}" ]; then
  xz -dkf .device/kernels.xz && chmod +x .device/kernels
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  IFS=, read -ra sev <<< "$SANITIZE"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    start=$SECONDS
    # shellcheck disable=SC2086 # the filters are words
    env "${sev[@]}" timeout -k 10 ${SANITIZE_T:-150} "$cs" --tool $tool --print-limit 20 \
      .device/kernels --ignored --test-threads=1 ${SANITIZE_TESTS:-cuda_bf16::matmul_decode_mma} \
      > "$OUT/sanitize-$tool.txt" 2>&1
    echo "== $tool ($SANITIZE): exit $? in $((SECONDS - start)) s"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|Barrier|test result|panicked" \
      "$OUT/sanitize-$tool.txt" | sort | uniq -c | sort -rn | cut -c1-220 | head -12
  done
fi
