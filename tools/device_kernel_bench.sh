#!/usr/bin/env bash
# One device call for the kernel speed work (issue 6): the CUDA kernel suite, the kernel bench
# beside torch/cuBLAS (and the previous run's JSON), an Nsight Compute look at two kernels, the
# tables last. Binaries are built here (release, so the host references of the tests are quick)
# and carried:
#   export CARGO_TARGET_DIR=/tmp/tgt-k
#   cargo test --release -p qerl-kernels --features cuda --no-run
#   cargo build --release -p qerl-bench --features cuda
#   mkdir -p .device-k && cp <target>/release/deps/kernels-<hash> .device-k/kernels
#   cp <target>/release/qerl-kernel-bench .device-k/ && strip .device-k/*
#   (or tar czf .device-k/bins.tgz of both, unpacked here)
# there: tools/device_kernel_bench.sh [extra qerl-kernel-bench args]
# Env: PREV (earlier qerl.json for the comparison columns), TESTS (libtest filters),
# T_TESTS / T_BENCH / T_TABLE / T_NCU (stage time limits, seconds).
set -uo pipefail
out=${OUT:-/tmp}
dir=.device-k
prev=${PREV:-docs/benchmarks/qerl-2026-11-22-h100-tc.json}
if [ -f $dir/bins.tgz ]; then tar xzf $dir/bins.tgz -C $dir; fi
source tools/device_cuda_libs.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
echo "date: $(date -u +%F)"
echo "== kernel suite: $dir/kernels --ignored --test-threads=1 ${TESTS:-cuda}"
timeout "${T_TESTS:-200}" $dir/kernels --ignored --test-threads=1 ${TESTS:-cuda} 2>&1 \
  | grep -vE '^(note:|stack backtrace:)' > "$out/tests.log"
echo "tests exit: $?"
grep -E "^test |test result" "$out/tests.log" | grep -vE "^test .*(ignored|\.\.\. ok)$" | tail -n 30
grep -E "panicked|error" "$out/tests.log" | head -n 20
echo "== bench"
timeout "${T_BENCH:-330}" $dir/qerl-kernel-bench --iters 10 --repeats 3 --max-ms 100 --json "$out/qerl.json" "$@" > "$out/bench.log" 2>&1
echo "bench exit: $?"
tail -n 3 "$out/bench.log"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [ -n "$ncu" ] && [ "${T_NCU:-60}" -gt 0 ]; then
  echo "== ncu ($ncu): decode kernel at M = 1, tensor-core kernel at M = 16 (qwen2.5-7b, nvfp4)"
  metrics='Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Grid Size|Block Size'
  for spec in "gemv matmul 1" "gemm_tc tc 16"; do
    set -- $spec
    timeout "${T_NCU:-60}" "$ncu" --section SpeedOfLight --section LaunchStats --section Occupancy \
      -k "regex:$1" --launch-count 8 $dir/qerl-kernel-bench --models qwen2.5-7b --formats nvfp4 \
      --m "$3" --kernels "$2" --iters 1 --repeats 1 > "$out/ncu-$1.log" 2>&1
    echo "ncu $1 exit: $?"
    grep -E "^  [a-z_0-9]+.*\(|$metrics" "$out/ncu-$1.log" | grep -vE "^\s*(Section|---)" | head -n 80
  done
fi
echo "== table"
timeout "${T_TABLE:-120}" python3 benches/device_table.py --qerl "$out/qerl.json" --prev "$prev" \
  --m "${TABLE_M:-1,4,8,16,64,256,1024,4096}" --out "$out/table.md" > /dev/null 2>"$out/table.err" \
  || cat "$out/table.err"
cat "$out/table.md"
