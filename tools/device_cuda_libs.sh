# Sourced by the device scripts: cudarc loads libcublas (the dequantize + cuBLAS strategy),
# libnccl (data-parallel training) and libcupti (finding cubecl's stream for cuBLAS) at run time
# by their plain names. The image has them as pip
# packages under torch (nvidia-cublas, nvidia-nccl) and, for cuBLAS, in the CUDA toolkit; this
# links them into /tmp/cuda-libs and puts that (and their own folders, for their dependencies)
# on LD_LIBRARY_PATH. Prints where each came from.
mkdir -p /tmp/cuda-libs
for lib in cublas nccl cupti; do
  found=$(python3 - "$lib" <<'PY' 2>/dev/null
import glob, os, sys, importlib
lib = sys.argv[1]
roots = []
for mod in ("nvidia", "nvidia.cu13", f"nvidia.{lib}"):
    try:
        roots += list(importlib.import_module(mod).__path__)
    except Exception:
        pass
hits = []
for r in roots:
    hits += glob.glob(os.path.join(r, "**", f"lib{lib}.so*"), recursive=True)
hits += glob.glob(f"/usr/local/cuda*/lib64/lib{lib}.so*") + glob.glob(f"/usr/local/cuda*/targets/*/lib/lib{lib}.so*")
hits += glob.glob(f"/usr/local/cuda*/extras/CUPTI/lib64/lib{lib}.so*")
hits = [h for h in hits if os.path.isfile(h)]
print(sorted(hits, key=len)[0] if hits else "")
PY
)
  if [ -n "$found" ]; then
    ln -sf "$found" /tmp/cuda-libs/lib$lib.so
    export LD_LIBRARY_PATH=/tmp/cuda-libs:$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "lib$lib: $found"
  else
    echo "lib$lib: not found (its strategy is off)"
  fi
done
