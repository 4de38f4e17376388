#!/usr/bin/env bash
# Runs the CUDA instantiations of the test suites on a GPU machine, from test binaries built
# elsewhere (the GPU machine has no Rust):
#   cargo test --workspace --features qerl-train/cuda --test kernels --test modules --no-run
#   mkdir -p .device && for t in kernels modules; do
#     cp "$(find target/debug/deps -name "$t-*" -type f -executable -newer Cargo.toml | head -1)" .device/$t && strip .device/$t; done
# then, there: tools/device_cuda_tests.sh .device/kernels .device/modules
# Prints the device, the CUDA toolkit, the date and each suite's results (also into $OUT).
set -uo pipefail
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -n 1
echo "date: $(date -u +%F)"
status=0
for bin in "$@"; do
  name=$(basename "$bin")
  echo "== $name: $bin --ignored cuda --test-threads=1"
  "$bin" --ignored cuda --test-threads=1 2>&1 | grep -vE '^(note:|stack backtrace:)' | tee "$out/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
