#!/usr/bin/env bash
# Which kernels a first training step compiles, and where its minutes go (issue 14).
#   tools/device_compile_census.sh QERL [WORK]
# Runs `qerl bench train` (one step, small lengths, Qwen2.5-7B shapes unless SHAPE) on empty
# kernel caches with cubecl's compilation logger at "full" on stderr, timestamps every line,
# then tools/compile_census.py compiles the logged sources again with NVRTC (all cores, and a
# serial sample with option variants) and loads each PTX (driver cache off).
# Env: SHAPE (qwen2.5-7b), PRECISION (nvfp4; `nvfp4,bf16` runs both in one process), STEP_T (seconds allowed for the steps, 420), TRAIN_ARGS (the
# `qerl bench train` arguments after --shape and --precision; default 2 x 4, 128 + 128, 2 steps), AUTOTUNE (cubecl autotune level, default: cubecl's),
# NVRTC (0: skip compiling the sources again), OUT (where the log, the census and its JSON go).
set -uo pipefail
QERL=$(realpath "$1"); WORK=${2:-/tmp/qerl-census}; OUT=${OUT:-/tmp/out}
ROOT=$PWD
rm -rf "$WORK"; mkdir -p "$WORK/run" "$WORK/cache" "$OUT"
{
  echo "[compilation]"
  echo "cache = { file = \"$WORK/cache\" }"
  echo "logger = { level = \"full\", stderr = true }"
  echo "[autotune]"
  echo "cache = { file = \"$WORK/cache\" }"
  echo "logger = { level = \"full\", stderr = true }"
  [ -n "${AUTOTUNE:-}" ] && echo "level = \"$AUTOTUNE\""
} > "$WORK/run/cubecl.toml"
export CUDA_CACHE_PATH=$WORK/cache/nv CUDA_CACHE_MAXSIZE=4294967296
echo "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); $(date -u)"
cd "$WORK/run"
# shellcheck disable=SC2206
args=(${TRAIN_ARGS:---prompts 2 --group 4 --prompt-len 128 --completion-len 128 --grad-accum 2 --steps 2})
timeout "${STEP_T:-420}" "$QERL" bench train --device cuda --shape "${SHAPE:-qwen2.5-7b}" \
  --precision "${PRECISION:-nvfp4}" "${args[@]}" 2>&1 | python3 -u -c '
import sys, time
t0 = time.monotonic()
for line in sys.stdin:
    sys.stdout.write(f"{time.monotonic() - t0:.3f}\t{line}")
' > "$WORK/log.txt"
echo "bench exit: ${PIPESTATUS[0]}"
grep -v "^[0-9.]*	\(  \|[a-z_]*:\|\[\|#\|{\|}\|extern\|typedef\|struct\|\`\`\`\|$\)" "$WORK/log.txt" \
  | grep -iv "kernel\|autotun" | cut -c1-200 | tail -n 25
cache_line="cache: $(du -sh "$WORK/cache" | cut -f1) ($(du -sh "$WORK/cache/nv" 2>/dev/null | cut -f1) of it the driver's)"
echo "$cache_line"
cd "$ROOT"
flags=(--nvrtc --jit); [ "${NVRTC:-1}" = 0 ] && flags=()
python3 tools/compile_census.py "$WORK/log.txt" "${flags[@]}" --json "$OUT/census.json" | tee "$OUT/census.md"
echo "$cache_line" >> "$OUT/census.md"
grep -a "Autotune\|autotune\|Tuning\|fastest" "$WORK/log.txt" | cut -c1-300 > "$OUT/autotune.txt"
echo "autotune lines: $(wc -l < "$OUT/autotune.txt")"
gzip -c "$WORK/log.txt" > "$OUT/compile-log.txt.gz"
