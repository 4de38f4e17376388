#!/usr/bin/env bash
# One device call for the tensor-core product's tile choice by row count (32x128 tiles up to 32
# rows, 64x128 up to 64; `QERL_TC_TILES=cubes` is the old choice by cube count)
# and the fused attention: first the CUDA kernel suites against their host references, then the
# rollout benchmark at batch 16 and 64 under each tile choice (VARIANTS: tile names, default
# "auto cubes"), then (LOAD=1) the staged upload against cubecl's, (ATTENTION=1)
# `qerl bench attention`.
# Here: the release `qerl` (--features cuda) in .device/qerl.tar.gz, the test binaries
# (`cargo test --release -p qerl-kernels --features cuda --test kernels --test attention
# --no-run`, copied and stripped) in .device/kernels and .device/attention.
# There: bash tools/device_tiles_check.sh   (carry .device)
source tools/device_preamble.sh
for t in ${TESTS-kernels attention}; do
  [ -x .device/$t ] || continue
  start=$SECONDS
  echo "== $t (CUDA, against the host reference)"
  timeout -k 10 ${TEST_T:-200} .device/$t --ignored ${TEST_FILTER:-cuda} --test-threads=1 2>&1 |
    grep -E "^test |test result|panicked|assert|mismatch" | head -40
  echo "$t: $((SECONDS - start)) s"
done
# Rollout variants: tile choices (auto = by row count, cubes = the old choice by cube count).
first=1
for tiles in ${VARIANTS:-auto cubes}; do
  start=$SECONDS
  echo "== rollout, tiles $tiles"
  check=(--no-check); [ $first = 1 ] && [ -n "${CHECK:-}" ] && check=(); first=0
  precisions=nvfp4; [ "$tiles" = auto ] && [ -n "${BF16:-}" ] && precisions=nvfp4,bf16
  QERL_TC_TILES=$tiles timeout -k 10 ${ROLLOUT_T:-150} /tmp/qerl bench rollout --shape qwen2.5-7b \
    --precision $precisions --batch ${BATCHES:-16,64} --prompt 256 --new-tokens ${NEW_TOKENS:-128} "${check[@]}" \
    --json "$OUT/rollout-$tiles.jsonl" 2>&1 | grep -vE "^qwen" | tail -6
  echo "rollout $tiles: $((SECONDS - start)) s"
done
if [ -n "${LOAD:-}" ]; then
  start=$SECONDS
  echo "== load: staged vs cubecl upload"
  timeout -k 10 ${LOAD_T:-150} /tmp/qerl bench load --check --dir /tmp/qcheck --device cuda 2>&1 | tail -4
  timeout -k 10 ${LOAD_T:-200} /tmp/qerl bench load --shape qwen2.5-7b --dir /tmp/q7 --device cuda --repeat ${LOAD_REPEAT:-2} \
    --upload cubecl,staged 2>&1 | tail -10
  echo "load: $((SECONDS - start)) s"
fi
if [ -n "${ATTENTION:-}" ]; then
  start=$SECONDS
  echo "== qerl bench attention"
  timeout -k 10 ${ATT_T:-120} /tmp/qerl bench attention --device cuda --dtype bf16 2>&1 | tail -12
  echo "attention: $((SECONDS - start)) s"
fi
