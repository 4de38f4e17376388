#!/usr/bin/env bash
# Fused attention on a CUDA GPU (issue 16 item 3): the kernels against the host f64 reference
# (bf16, f16, f32), then `qerl bench attention` (a check against the decomposed path, then
# forward and forward + backward time and the bytes held for the backward, fused against
# decomposed, at the Qwen2.5-7B training shape b 16, s 320, 28 heads, 4 kv heads, d 128).
# Built elsewhere (the GPU machine has no Rust):
#   cargo build --release -p qerl-train --features cuda            # -> target/release/qerl
#   cargo test -p qerl-kernels --features cuda --test attention --no-run
#   mkdir -p .device && cp "$(find target/debug/deps -name 'attention-*' -type f -executable \
#     -newer Cargo.toml | head -1)" .device/attention && strip .device/attention
# then, there: tools/device_attention_check.sh target/release/qerl [.device/attention]
# Extra arguments after the two paths go to `qerl bench attention` (e.g. --seq 1280 --batch 4).
# Output goes to stdout and $OUT/attention-check.log.
set -uo pipefail
qerl=${1:?usage: device_attention_check.sh QERL_BINARY [KERNEL_TEST_BINARY] [bench args...]}
shift
tests=""
if [ $# -gt 0 ] && [ -x "$1" ]; then tests=$1; shift; fi
out=${OUT:-/tmp}
log="$out/attention-check.log"
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "date: $(date -u +%F)"
  if [ -n "$tests" ]; then
    echo "== kernels against the f64 reference: $tests --ignored cuda"
    "$tests" --ignored cuda --test-threads=1 2>&1 | grep -vE '^(note:|stack backtrace:)' || status=1
  fi
  echo "== $qerl bench attention --device cuda --dtype bf16,f32 $*"
  "$qerl" bench attention --device cuda --dtype bf16,f32 "$@" 2>&1 || status=1
  # A longer context at the same token count (the 7B target's 256 + 1,024 tokens).
  echo "== $qerl bench attention --device cuda --dtype bf16 --batch 4 --seq 1280"
  "$qerl" bench attention --device cuda --dtype bf16 --batch 4 --seq 1280 --no-check 2>&1 || status=1
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
