# Sourced by the device scripts: keeps cubecl's kernel caches between device calls, so that
# only the first call on a fresh GPU machine pays for NVRTC (minutes per process).
#   cache_restore: unpacks .device/cubecl-cache.tgz (carried) into target/
#   cache_save:    packs target/cuda (PTX from NVRTC), target/autotune (chosen kernels) and
#                  target/nv-cache (the driver's PTX -> SASS cache) into $OUT/cubecl-cache.tgz;
#                  here, copy it to .device/cubecl-cache.tgz for the next call.
# The caches are keyed by kernel (and the autotune one by device), so a stale one is harmless.
export CUDA_CACHE_PATH=$PWD/target/nv-cache CUDA_CACHE_MAXSIZE=1073741824
cache_restore() {
  mkdir -p target
  if [ -f .device/cubecl-cache.tgz ]; then
    tar -xzf .device/cubecl-cache.tgz -C target && echo "cubecl cache restored: $(du -sh target | cut -f1)"
  else
    echo "no cubecl cache carried"
  fi
}
cache_save() {
  local dirs=()
  for d in cuda autotune nv-cache; do [ -d target/$d ] && dirs+=($d); done
  [ ${#dirs[@]} -gt 0 ] && tar -czf "${OUT:-/tmp}/cubecl-cache.tgz" -C target "${dirs[@]}" &&
    echo "cubecl cache saved: $(du -sh "${OUT:-/tmp}/cubecl-cache.tgz" | cut -f1) (${dirs[*]})"
}
