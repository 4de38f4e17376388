#!/usr/bin/env bash
# Runs the kernel test suite on a CUDA machine, from a test binary built elsewhere:
#   cargo test --workspace --features qerl-kernels/cuda --test kernels --no-run
#   cp target/debug/deps/kernels-<hash> .device/kernels && strip .device/kernels
# then, on the GPU machine: tools/device_kernel_suite.sh .device/kernels
# Prints the device, the CUDA toolkit and the results of every CUDA test (bf16, f16, f32).
set -uo pipefail
bin=${1:-.device/kernels}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -n 2
echo "date: $(date -u +%F)"
"$bin" --ignored cuda --test-threads=1 2>&1 | tee "$out/kernel_suite.log"
