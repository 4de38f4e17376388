#!/usr/bin/env bash
# One device call for the decode-batch mma kernel (crates/qerl-kernels/src/gemm_mma): first the
# CUDA kernel tests against the host f64 reference (the mma kernel, then the products it sits
# beside), then the rollout benchmark at the decode batches it serves, with the kernel off (the
# tiled tensor-core kernel, the previous path) and on, under each variant.
# Here: the release `qerl` (--features cuda) in .device/qerl-mma.tar.gz and the kernel test binary
# (`cargo test --release -p qerl-kernels --features cuda --test kernels --no-run`, copied and
# stripped) in .device/kernels.
# There: bash tools/device_mma_check.sh   (carry .device/qerl-mma.tar.gz, .device/kernels; QERL_TAR
# names another tarball of the binary)
# Env: TESTS (1: run the kernel tests), TEST_FILTERS, ENGINE_TESTS (1: the engine's CUDA tests), STRESS (1: .device/strategy_stress too), VARIANTS ("name:ENV=v,ENV=v ..."; "off"
# is QERL_MMA=off; CHECK=1 among a variant's settings keeps the check, PREC=a+b its precisions, B=a+b its batches,
# S=SHAPE its model shape, default SHAPE or qwen2.5-7b; T=TARBALL another build of qerl for this variant; N=TOKENS its new tokens), BATCHES (16,64), NEW_TOKENS (128), PRECISIONS (nvfp4), ROLLOUT_T (150).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
# libcublas for the cuBLAS strategy (QERL_GEMM, and Strategy::Auto from QERL_CUBLAS_MIN_M rows)
source tools/device_cuda_libs.sh
mkdir -p /tmp/qm && tar -xzf "${QERL_TAR:-.device/qerl-mma.tar.gz}" -C /tmp/qm
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
# SOURCE_LOG=1: cubecl logs every kernel's generated CUDA source to /tmp/cubecl-src.log; after
# the tests, the lines around each match of SOURCE_GREP (default `__threadfence`: session 15
# checked a fence injected through `comment!`, docs/design/w4a16-pipeline.md §9) are shown.
if [ "${SOURCE_LOG:-0}" = 1 ]; then
  printf '\n[compilation.logger]\nlevel = "full"\nfile = "/tmp/cubecl-src.log"\n' >> cubecl.toml
fi
if [ "${TESTS:-1}" = 1 ] && [ -x .device/kernels ]; then
  for f in ${TEST_FILTERS:-cuda_bf16::matmul_mma cuda_f16::matmul_mma cuda_bf16::matmul_}; do
    start=$SECONDS
    echo "== kernel tests $f (CUDA, against the host reference)"
    timeout -k 10 ${TEST_T:-240} .device/kernels --ignored --test-threads=1 "$f" 2>&1 |
      grep -E "^test |test result|panicked|assert|error|seed" | head -30
    echo "tests $f: $((SECONDS - start)) s"
  done
fi
if [ "${SOURCE_LOG:-0}" = 1 ]; then
  pat=${SOURCE_GREP:-__threadfence}
  echo "== generated source: $(grep -c -- "$pat" /tmp/cubecl-src.log 2>/dev/null || echo 0) lines match '$pat' in $(du -h /tmp/cubecl-src.log 2>/dev/null | cut -f1) of source"
  grep -n -B3 -A3 -- "$pat" /tmp/cubecl-src.log 2>/dev/null | head -${SOURCE_LINES:-24}
fi
# ENGINE_TESTS=1: the engine's CUDA kernel tests (.device/kernels_cuda, built with
# `cargo test --release -p qerl-engine --features cuda --test kernels_cuda --no-run`), filter
# ENGINE_FILTER (default cuda_attention)
if [ "${ENGINE_TESTS:-0}" = 1 ] && [ -x .device/kernels_cuda ]; then
  start=$SECONDS
  echo "== engine kernel tests ${ENGINE_FILTER:-cuda_attention} (CUDA)"
  timeout -k 10 ${TEST_T:-240} .device/kernels_cuda --ignored --test-threads=1 "${ENGINE_FILTER:-cuda_attention}" 2>&1 |
    grep -E "^test |test result|panicked|assert|error|seed|err" | head -30
  echo "engine tests: $((SECONDS - start)) s"
fi
# STRESS=1: the strategy stress test (.device/strategy_stress, bf16: every strategy, chains of
# products back to back against the f64 reference)
if [ "${STRESS:-0}" = 1 ] && [ -x .device/strategy_stress ]; then
  start=$SECONDS
  echo "== strategy stress (CUDA bf16)"
  timeout -k 10 ${TEST_T:-240} .device/strategy_stress --ignored --test-threads=1 cuda_bf16 2>&1 |
    grep -E "^test |test result|panicked|assert|error|seed" | head -30
  echo "stress: $((SECONDS - start)) s"
fi
for v in ${VARIANTS:-off on bits:QERL_MMA_DECODE=bits}; do
  name=${v%%:*}
  envs=()
  case $v in
    off) envs=(QERL_MMA=off) ;;
    on) ;;
    *:*) IFS=, read -ra envs <<< "${v#*:}" ;;
  esac
  # CHECK=1 among a variant's settings runs the benchmark's check against the host reference
  # PREC=nvfp4+bf16 among them sets this variant's precisions, B=128+256 its batches
  check=--no-check
  shape=${SHAPE:-qwen2.5-7b}
  new=${NEW_TOKENS:-128}
  bin=/tmp/qm/qerl
  prec=${PRECISIONS:-nvfp4}
  batches=${BATCHES:-16,64}
  for e in "${envs[@]}"; do
    [ "$e" = CHECK=1 ] && check=
    case $e in
      PREC=*) prec=${e#PREC=}; prec=${prec//+/,} ;;
      B=*) batches=${e#B=}; batches=${batches//+/,} ;;
      S=*) shape=${e#S=} ;;
      N=*) new=${e#N=} ;;
      T=*) mkdir -p /tmp/qm-alt && tar -xzf "${e#T=}" -C /tmp/qm-alt && bin=/tmp/qm-alt/qerl ;;
    esac
  done
  start=$SECONDS
  echo "== rollout $name (${envs[*]:-defaults})"
  env "${envs[@]}" timeout -k 10 ${ROLLOUT_T:-150} $bin bench rollout --shape $shape \
    --precision $prec --batch $batches --prompt 256 \
    --new-tokens $new $check --json "$OUT/rollout-$name.jsonl" 2>&1 |
    grep -vE "^qwen" | tail -${TAIL:-5}
  echo "rollout $name: $((SECONDS - start)) s"
done
