#!/usr/bin/env bash
# One device call for the update products on dequantize + cuBLAS (issue 16, item 4), A/B over
# environment knobs: the CUDA checks of the decode and the cuBLAS path first, then one
# qerl-kernel-bench run per variant (`--kernels strategies --strategies cublas`), then torch's
# cuBLAS bf16 on the same shapes and one table (tools/cublas_ab_table.py). Binaries built here:
#   export CARGO_TARGET_DIR=/work/target-rel
#   cargo build --release -p qerl-bench --features cuda
#   cargo test --release -p qerl-kernels --features cuda --test kernels --no-run
#   mkdir -p .device-k/b && cp $CARGO_TARGET_DIR/release/qerl-kernel-bench .device-k/b/
#   cp <deps>/kernels-<hash> .device-k/b/kernels (and <deps>/strategy_stress-<hash>, --test strategy_stress)
#   strip .device-k/b/*
#   tar czf .device-k/bins.tgz -C .device-k/b . && rm -r .device-k/b
# there: bash tools/device_cublas_ab.sh
# Env: VARIANTS ("name:VAR=v,VAR=v name2:" ...), M (1024,2048), MODELS (qwen2.5-7b,qwen2.5-32b),
#   TESTS (libtest filters; "" skips), NCU=1 (kernel names and durations of the GEMMs, 7B, M 1024).
set -uo pipefail
out=${OUT:-/tmp}
dir=.device-k
tar xzf $dir/bins.tgz -C $dir
source tools/device_cuda_libs.sh > /dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
date -u +"%F %T UTC"
tests=${TESTS-cuda_bf16::dense_operands cuda_bf16::dequantize_all_formats cuda_bf16::blas_products cuda_f16::blas_products cuda_bf16::blas_ordering cuda_bf16::matmul_tensor_cores}
if [ -n "$tests" ]; then
  echo "== tests: $tests"
  QERL_EXPECT_CUBECL_STREAM=${QERL_EXPECT_CUBECL_STREAM:-1} timeout 300 $dir/kernels --ignored --test-threads=1 $tests > "$out/tests.log" 2>&1
  echo "tests exit: $?"
  grep -E "^test |test result|panicked" "$out/tests.log" | tail -n 14
fi
if [ -x $dir/strategy_stress ] && [ "${T_STRESS:-150}" -gt 0 ]; then
  echo "== strategy stress (chains of products from one and two threads, every strategy)"
  timeout "${T_STRESS:-150}" $dir/strategy_stress --ignored --test-threads=1 > "$out/stress.log" 2>&1
  echo "stress exit: $?"
  grep -E "^test |test result|panicked" "$out/stress.log" | tail -n 8
fi
m=${M:-1024,2048}
args=()
for v in ${VARIANTS:-"host:QERL_CUBLAS_STREAM=host" "stream:"}; do
  name=${v%%:*}
  vars=${v#*:}
  echo "== bench $name (${vars:-defaults})"
  start=$SECONDS
  env ${vars//,/ } timeout 300 $dir/qerl-kernel-bench --models "${MODELS:-qwen2.5-7b,qwen2.5-32b}" \
    --formats nvfp4 --m "$m" --kernels strategies --strategies cublas --iters 10 --repeats 3 \
    --json "$out/q-$name.json" > "$out/bench-$name.log" 2>&1
  echo "bench exit: $? ($((SECONDS - start)) s): $(tail -n 1 "$out/bench-$name.log")"
  args+=("$name=$out/q-$name.json")
done
if [ "${NCU:-0}" = 1 ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
  for v in ${VARIANTS:-"host:QERL_CUBLAS_STREAM=host" "stream:"}; do
    name=${v%%:*}
    vars=${v#*:}
    echo "== ncu $name: qerl's GEMMs, 7B, M 1024 (name, us)"
    env ${vars//,/ } timeout 120 "$ncu" --metrics gpu__time_duration.sum -k "regex:nvjet|gemm|sm90|cutlass|dequant" \
      --launch-count 40 $dir/qerl-kernel-bench --models qwen2.5-7b --formats nvfp4 --m 1024 \
      --kernels strategies --strategies cublas --iters 1 --repeats 1 > "$out/ncu-$name.log" 2>&1
    awk '/^  [^ ]/ && !/==PROF==/ {name=substr($0, 3, 100)} /gpu__time_duration.sum/ {print $(NF), name}' "$out/ncu-$name.log" | cut -c1-110 | uniq -c | head -n 30
  done
  echo "== ncu torch: x @ w.T and dy @ w, 7B, M 1024"
  timeout 120 "$ncu" --metrics gpu__time_duration.sum -k "regex:nvjet|gemm|sm90|cutlass" python3 - > "$out/ncu-torch.log" 2>&1 <<'PY'
import torch
for n, k in [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]:
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1024, k, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(1024, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        x @ w.t(); dy @ w
torch.cuda.synchronize()
PY
  awk '/^  [^ ]/ && !/==PROF==/ {name=substr($0, 3, 100)} /gpu__time_duration.sum/ {print $(NF), name}' "$out/ncu-torch.log" | cut -c1-110 | head -n 20
fi
echo "== table"
timeout 200 python3 tools/cublas_ab_table.py "${args[@]}"
if [ -n "$tests" ]; then
  echo "== tests again (summary): $(grep -E "^test result" "$out/tests.log")"
  grep -E "^test .*(FAILED|ok)$" "$out/tests.log" | tr '\n' ' ' | cut -c1-1500; echo
fi
