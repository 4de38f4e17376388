#!/usr/bin/env bash
# One device call for the rollout engine (issue 15): the engine's correctness check on CUDA
# against the host reference, `qerl bench rollout` (NVFP4 and BF16, one process), then the
# transformers peer on a random model of the same shape, then the copy bandwidth.
# Carry .device (qerl.tar.gz: the release `qerl` built with --features cuda).
# Usage there: bash tools/device_rollout.sh [qerl bench args...]   (env: HF=0 skips the peer,
#   HF_ARGS, QERL_T / HF_T: time limits in seconds)
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
source tools/device_cuda_libs.sh > "$OUT/cuda-libs.txt"
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--shape qwen2.5-7b --precision nvfp4,bf16 --batch 1,16,64,256 --prompt 256 --new-tokens 512)
start=$SECONDS
timeout -k 10 "${QERL_T:-420}" /tmp/qerl bench rollout "${args[@]}" --json "$OUT/qerl.jsonl" 2>&1 | tee "$OUT/qerl.log"
echo "qerl bench: $((SECONDS - start)) s"
if [ "${HF:-1}" = 1 ]; then
  start=$SECONDS
  timeout -k 10 "${HF_T:-200}" python3 tools/hf_rollout_peer.py ${HF_ARGS:---shape 7b --batch 1,16,64,256 --prompt 256 --new 512 --budget 150} --json "$OUT/hf.jsonl" 2>&1 | grep -v Warning | tee "$OUT/hf.log"
  echo "hf peer: $((SECONDS - start)) s"
fi
