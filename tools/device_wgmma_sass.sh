#!/usr/bin/env bash
# One device call: what ptxas makes of the warpgroup product (crates/qerl-kernels/src/gemm_mma/
# warpgroup.cu) as the 7B batch-64 decode compiles it, per variant (VARIANTS, "name:ENV=v,..."):
# registers, spills and any C7515 warning (`wgmma` serialised), from tools/device_sass.sh with
# nvcc for sm_90a; then (AB) the rollout at batch 64 under AB_VARIANTS, alternating, wall time.
# Carry .device/qerl.tar.gz. There: bash tools/device_wgmma_sass.sh
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cuda_libs.sh > /dev/null
mkdir -p /tmp/qm && tar -xzf .device/qerl.tar.gz -C /tmp/qm
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in ${VARIANTS:-base: sync2:QERL_WGMMA_SYNC=2}; do
  name=${v%%:*}; IFS=, read -ra ev <<< "${v#*:}"
  rm -rf /tmp/sass-run
  echo "== $name (${v#*:})"
  env "${ev[@]}" OUT="$OUT/$name" PATTERN=wgmma ARCH=sm_90a BATCHES=64 \
    bash tools/device_sass.sh /tmp/qm/qerl 2>&1 | grep -v "^/tmp"
  mkdir -p "/tmp/s-$name" && tar -xzf "$OUT/$name/sass.tgz" -C "/tmp/s-$name"
  for f in /tmp/s-$name/*.ptxas.txt; do
    echo "-- $(basename "$f"): $(grep -cE 'WGMMA|wgmma' "${f%.ptxas.txt}.sass") wgmma-named SASS lines"
    grep -vE "^\s*$|Compiling entry|Function properties" "$f" | cut -c1-220 | head -8
  done
done
for i in 1 2 3; do
  for v in ${AB_VARIANTS:-base: lt44:QERL_LORA_DOWN_TILE=4x4}; do
    name=${v%%:*}; IFS=, read -ra ev <<< "${v#*:}"
    r=$(env "${ev[@]}" timeout -k 5 60 /tmp/qm/qerl bench rollout --shape qwen2.5-7b \
      --precision nvfp4 --batch 64 --prompt 256 --new-tokens 128 --no-check 2>/dev/null |
      grep "| qwen" | awk -F'|' '{print $6, $8}')
    echo "ab $i $name: ms/step, decode tokens/s = $r"
  done
done
