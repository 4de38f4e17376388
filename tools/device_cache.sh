# Sourced by the device scripts: cubecl's kernel caches live under target/ (cubecl.toml), and
# the driver's PTX -> SASS cache joins them there (CUDA_CACHE_PATH). A machine kept warm between
# device calls keeps target/, so only the first call on a fresh machine pays for NVRTC (~6 min
# per process there; seconds afterwards, measured 2026-11-22 on an H100).
#   cache_restore: unpacks .device/cubecl-cache.tgz (if carried) into target/
#   cache_save:    packs target/cuda (PTX), target/autotune and target/nv-cache into
#                  $OUT/cubecl-cache.tgz. After the tiny-math runs, the kernel suites and a 1.5B
#                  model it was 296 MB compressed: past what a device call brings back (16 MiB a
#                  file), so carrying it to a fresh machine works only for small sets of kernels.
# The PTX cache is keyed by kernel name, launch geometry and comptime arguments, not by the
# kernel's source: a machine kept warm across builds can serve a changed kernel body its old PTX
# (docs/cold-start.md). CLEAR_CACHE=1 empties it first.
if [ "${CLEAR_CACHE:-0}" = 1 ]; then rm -rf target/cuda target/nv-cache; fi
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
