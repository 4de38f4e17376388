#!/usr/bin/env bash
# One device call for the update products on dequantize + cuBLAS (issue 16): correctness first
# (the strategy stress test, cuBLAS against cubecl's stream, every strategy), then the products
# at M >= 1024 and their parts (the decode, cuBLAS on a decoded weight) beside torch's cuBLAS
# bf16, the table last. Binaries are built here and carried in .device-k/bins.tgz:
#   export CARGO_TARGET_DIR=/work/target-rel
#   cargo build --release -p qerl-bench --features cuda
#   cargo test --release -p qerl-kernels --features cuda --test kernels --test strategy_stress --no-run
#   mkdir -p .device-k/b && cp $CARGO_TARGET_DIR/release/qerl-kernel-bench .device-k/b/
#   cp <deps>/kernels-<hash> .device-k/b/kernels; cp <deps>/strategy_stress-<hash> .device-k/b/strategy_stress
#   strip .device-k/b/* && tar czf .device-k/bins.tgz -C .device-k/b . && rm -r .device-k/b
# there: bash tools/device_update_products.sh
# Env: M (rows, 1024,2048,4096), MODELS (qwen2.5-7b,qwen2.5-32b), T_STRESS (seconds, 200;
#   0 skips the stress test).
set -uo pipefail
out=${OUT:-/tmp}
dir=.device-k
tar xzf $dir/bins.tgz -C $dir
source tools/device_cuda_libs.sh
if [ "${T_STRESS:-200}" -gt 0 ]; then
  echo "== strategy stress (chains of products from one and two threads, every strategy)"
  start=$SECONDS
  timeout "${T_STRESS:-200}" $dir/strategy_stress --ignored --test-threads=1 > "$out/stress.log" 2>&1
  echo "stress exit: $? ($((SECONDS - start)) s)"
  grep -E "^test |test result|panicked" "$out/stress.log" | tail -n 12
fi
m=${M:-1024,2048,4096}
TESTS="cuda_bf16::blas_ordering cuda_f16::blas_ordering cuda_bf16::blas_products cuda_bf16::dense_operands cuda_bf16::matmul_tensor_cores" \
  T_NCU=0 TABLE_M=$m bash tools/device_kernel_bench.sh --models "${MODELS:-qwen2.5-7b,qwen2.5-32b}" \
  --formats nvfp4 --m "$m" --kernels strategies
