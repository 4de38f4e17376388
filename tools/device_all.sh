#!/usr/bin/env bash
# One device call that runs several GPU jobs side by side (NVRTC compiling is CPU-bound and
# per process, so parallel jobs share the wait) and keeps cubecl's kernel caches for the next
# call (tools/device_cache.sh). Stages, any of:
#   sft-sweep    tools/device_sft_sweep.sh (SFT_RUNS)
#   warm         two short demo runs (NVFP4 and BF16 LoRA) that only fill the kernel caches
#   tests        the CUDA test suites: .device/tests.tar.xz (kernels, modules, parity binaries)
#   model-check  tools/device_model_check.py (score / generate against transformers; carry .whl)
#   memory       tools/device_memory.sh
#   results      tools/device_results.sh (the tiny-math comparison of docs/results.md)
# Usage there (carry .device, and .whl for model-check): bash tools/device_all.sh STAGE...
# Every stage is given until DEADLINE seconds (default 540) so the caches and logs are saved in
# time; a stage's timeout stops its script, and each script bounds its own processes
# (`timeout -k`: qerl takes SIGTERM as Ctrl-C and finishes its step first).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p $OUT /tmp/logs
source tools/device_cache.sh
source tools/device_cuda_libs.sh > /tmp/logs/cuda-libs.txt; cat /tmp/logs/cuda-libs.txt
cache_restore
tar -xzf .device/qerl.tar.gz -C /tmp
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u +%FT%TZ; } | tee /tmp/logs/device.txt
deadline=${DEADLINE:-540}
left() { echo $((deadline - SECONDS)); }
for stage in "$@"; do
  case $stage in
    sft-sweep) OUT=/tmp/sweep-out timeout -k 15 $(left) bash tools/device_sft_sweep.sh > /tmp/logs/sft-sweep.log 2>&1 & ;;
    warm)
      for p in nvfp4 bf16; do
        extra=(); [ $p = bf16 ] && extra=(--set 'model.dir="models/tiny-math"' --set 'model.precision="bf16"')
        CUBECL_AUTOTUNE_LEVEL=minimal timeout -k 15 $(left) /tmp/qerl --set train.steps=3 --set rollout.batch_prompts=16 \
          --set eval.limit=64 --set "train.output_dir=\"/tmp/warm-$p\"" "${extra[@]}" > /tmp/logs/warm-$p.log 2>&1 &
        [ $p = nvfp4 ] && sleep 20  # the NVFP4 checkpoint is written by the first run
      done ;;
    tests)
      mkdir -p /work && { [ -e /work/main ] || ln -sfn "$PWD" /work/main; }
      tar -xJf .device/tests.tar.xz -C /tmp
      (cd /work/main && OUT=/tmp/logs timeout -k 15 $(left) bash tools/device_cuda_tests.sh /tmp/kernels:cuda_bf16 /tmp/kernels:cuda_f16 /tmp/kernels:cuda_f32 /tmp/modules /tmp/parity > /tmp/logs/tests.log 2>&1) & ;;
    model-check)
      (python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout -k 15 $(left) python3 tools/device_model_check.py /tmp/qerl cuda) > /tmp/logs/model-check.log 2>&1 & ;;
    memory) OUT=/tmp/logs timeout -k 15 $(left) bash tools/device_memory.sh > /tmp/logs/memory-run.log 2>&1 & ;;
    results) OUT=/tmp/results-out RUN_TIMEOUT=$(( $(left) - 20 )) bash tools/device_results.sh > /tmp/logs/results.log 2>&1 & ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
wait
cp /tmp/sweep-out/*.tgz $OUT/ 2>/dev/null
cp /tmp/results-out/results.tgz $OUT/ 2>/dev/null
cache_save
tar -czf $OUT/logs.tgz -C /tmp logs
for f in /tmp/logs/*.log; do echo "=== $(basename $f)"; tail -n 25 $f; done
ls -la $OUT
