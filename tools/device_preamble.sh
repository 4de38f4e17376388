# Sourced first by the device scripts that run the carried release `qerl` (.device/qerl.tar.gz,
# built with --features cuda), so that each call starts the same way: results under $OUT, the
# kernel caches (tools/device_cache.sh), the CUDA libraries' report in $OUT/cuda-libs.txt,
# `qerl` unpacked to /tmp/qerl, and the card, driver and start time in $OUT/device.txt.
# Sets `-uo pipefail` in the caller (not -e: a failed step is reported and the next one runs).
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source tools/device_cache.sh
source tools/device_cuda_libs.sh > "$OUT/cuda-libs.txt"
# QERL_TGZ: another build's tarball (a baseline binary carried beside the new one).
tar -xzf "${QERL_TGZ:-.device/qerl.tar.gz}" -C /tmp
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
