#!/usr/bin/env bash
# Runs the CUDA instantiations of the test suites on a GPU machine, from test binaries built
# elsewhere (the GPU machine has no Rust):
#   cargo test --workspace --features qerl-train/cuda --test kernels --test modules --no-run
#   mkdir -p .device && for t in kernels modules; do
#     cp "$(find target/debug/deps -name "$t-*" -type f -executable -newer Cargo.toml | head -1)" .device/$t && strip .device/$t; done
# then, there: tools/device_cuda_tests.sh .device/kernels .device/modules
# An argument BIN:FILTER runs only the tests whose names contain FILTER (default `cuda`). The
# binaries run side by side (each spends most of its time in NVRTC, one CPU core).
# Prints the device, the CUDA toolkit, the date and each suite's results (also into $OUT).
set -uo pipefail
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -n 1
echo "date: $(date -u +%F)"
status=0
pids=()
for arg in "$@"; do
  bin=${arg%%:*}; filter=cuda; [ "$arg" != "$bin" ] && filter=${arg#*:}
  name=$(basename "$bin")-$filter
  "$bin" --ignored "$filter" --test-threads=1 > "$out/$name.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do wait "${pids[$i]}" || status=1; done
for arg in "$@"; do
  bin=${arg%%:*}; filter=cuda; [ "$arg" != "$bin" ] && filter=${arg#*:}
  name=$(basename "$bin")-$filter
  echo "== $name: $bin --ignored $filter --test-threads=1"
  grep -vE '^(note:|stack backtrace:)' "$out/$name.log"
done
exit $status
