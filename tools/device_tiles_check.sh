#!/usr/bin/env bash
# One device call for the tensor-core product's tile choice by row count (16x64 tiles up to 16
# rows, 32x128 up to 32, 64x128 up to 64; `QERL_TC_TILES=cubes` is the old choice by cube count)
# and the fused attention: first the CUDA kernel suites against their host references, then the
# rollout benchmark at batch 16 and 64 under both tile choices, then `qerl bench attention`.
# Here: the release `qerl` (--features cuda) in .device/qerl.tar.gz, the test binaries
# (`cargo test --release -p qerl-kernels --features cuda --test kernels --test attention
# --no-run`, copied and stripped) in .device/kernels and .device/attention.
# There: bash tools/device_tiles_check.sh   (carry .device)
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
source tools/device_cuda_libs.sh > "$OUT/cuda-libs.txt"
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
for t in kernels attention; do
  [ -x .device/$t ] || continue
  start=$SECONDS
  echo "== $t (CUDA, against the host reference)"
  timeout -k 10 ${TEST_T:-200} .device/$t --ignored cuda --test-threads=1 2>&1 |
    grep -E "^test |test result|panicked|assert|mismatch" | tail -25
  echo "$t: $((SECONDS - start)) s"
done
for tiles in auto cubes; do
  start=$SECONDS
  echo "== rollout, tiles $tiles"
  if [ $tiles = auto ]; then unset QERL_TC_TILES; check=(); else export QERL_TC_TILES=$tiles; check=(--no-check); fi
  timeout -k 10 ${ROLLOUT_T:-170} /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4,bf16 --batch 16,64 \
    --prompt 256 --new-tokens 128 "${check[@]}" --json "$OUT/rollout-$tiles.jsonl" 2>&1 | grep -vE "^qwen" | tail -8
  echo "rollout $tiles: $((SECONDS - start)) s"
done
unset QERL_TC_TILES
if [ -z "${SKIP_ATTENTION:-}" ]; then
  start=$SECONDS
  echo "== qerl bench attention"
  timeout -k 10 ${ATT_T:-120} /tmp/qerl bench attention --device cuda --dtype bf16 2>&1 | tail -12
  echo "attention: $((SECONDS - start)) s"
fi
