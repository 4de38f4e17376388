set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
source tools/device_cache.sh; source tools/device_cuda_libs.sh > $OUT/cuda-libs.txt
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee $OUT/device.txt
timeout -k 10 300 /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4,bf16 --batch 1,16,64,256 --prompt 256 --new-tokens 512 --json $OUT/qerl.jsonl 2>&1 | grep -v "^qwen" | tail -16
for c in 4 8; do echo "== QERL_TC_CUBES_PER_SM=$c"; QERL_TC_CUBES_PER_SM=$c timeout 100 /tmp/qerl bench rollout --shape qwen2.5-7b --precision nvfp4 --batch 16,64 --prompt 256 --new-tokens 128 --no-check 2>&1 | tail -2; done
timeout -k 10 100 /tmp/qerl bench rollout --shape qwen2.5-32b --precision nvfp4 --batch 1 --prompt 256 --new-tokens 128 --no-check 2>&1 | tail -1
timeout -k 10 170 python3 tools/hf_rollout_peer.py --shape 7b --batch 1,64 --prompt 256 --new 128 --budget 120 --json $OUT/hf.jsonl 2>&1 | grep -v Warning | tail -5
