#!/usr/bin/env bash
# One device call for the kernel speed work (issue 6): the CUDA kernel suite, then the kernel
# bench beside torch/cuBLAS, printing the tables last. Binaries are built here and carried:
#   export CARGO_TARGET_DIR=/tmp/tgt-k
#   cargo test -p qerl-kernels --features cuda --no-run
#   cargo build --release -p qerl-bench --features cuda
#   mkdir -p .device-k && cp <target>/debug/deps/kernels-<hash> .device-k/kernels
#   cp <target>/release/qerl-kernel-bench .device-k/ && strip .device-k/*
#   tar czf .device-k.tgz -C .device-k . (or carry .device-k as is)
# there: tools/device_kernel_bench.sh [extra qerl-kernel-bench args]
set -uo pipefail
out=${OUT:-/tmp}
dir=.device-k
if [ -f $dir/bins.tgz ]; then tar xzf $dir/bins.tgz -C $dir; fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
echo "date: $(date -u +%F)"
echo "== kernel suite: $dir/kernels --ignored cuda --test-threads=1"
timeout 200 $dir/kernels --ignored cuda --test-threads=1 2>&1 | grep -vE '^(note:|stack backtrace:)' > "$out/tests.log"
grep -E "^test |test result" "$out/tests.log" | grep -vE "^test .*(ignored|\.\.\. ok)$" | tail -n 30
grep -E "panicked|error" "$out/tests.log" | head -n 20
echo "== bench"
timeout 330 $dir/qerl-kernel-bench --iters 10 --repeats 3 --max-ms 100 --json "$out/qerl.json" "$@" > "$out/bench.log" 2>&1
tail -n 3 "$out/bench.log"
python3 benches/device_table.py --qerl "$out/qerl.json" --out "$out/table.md" > /dev/null 2>"$out/table.err" || cat "$out/table.err"
cat "$out/table.md"
