#!/usr/bin/env bash
# The CUDA source, register count and SASS of kernels as cubecl compiles them for this GPU, for
# reading instruction counts offline (why a kernel is issue- or latency-bound).
# Runs a short rollout benchmark in a scratch folder whose cubecl.toml turns the compilation log
# on (full source) and keeps the kernel cache there (empty, so every kernel is compiled and
# logged), then compiles each kernel whose name matches PATTERN with nvcc for this GPU
# (`-Xptxas -v`: registers, spills) and disassembles it (cuobjdump -sass).
# There: bash tools/device_sass.sh QERL_BINARY   (writes NAME.{cu,sass,ptxas.txt} of each kernel
#   into $OUT/sass.tgz: a device call brings back only a few files, so one archive)
# Env: PATTERN (extended regex on kernel names, default gemv|gemm_mma), BATCHES (1,64),
#   PRECISION (nvfp4), ARCH (sm_90).
set -uo pipefail
qerl=$(realpath "${1:?usage: tools/device_sass.sh QERL_BINARY}")
out=/tmp/sass-out
rm -rf "$out" && mkdir -p "$out" /tmp/sass-run "${OUT:-/tmp/out}"
cat > /tmp/sass-run/cubecl.toml <<'TOML'
[compilation]
cache = "local"
[compilation.logger]
level = "full"
file = "/tmp/sass-run/compile.log"
TOML
start=$SECONDS
(cd /tmp/sass-run && timeout -k 5 "${SASS_T:-240}" "$qerl" bench rollout --shape qwen2.5-7b \
  --precision "${PRECISION:-nvfp4}" --batch "${BATCHES:-1,64}" --prompt 64 --new-tokens 4 \
  --no-check >/dev/null 2>&1)
echo "compile log: $(du -h /tmp/sass-run/compile.log 2>/dev/null | cut -f1), $((SECONDS - start)) s"
python3 - "$out" "${PATTERN:-gemv|gemm_mma}" <<'PY'
import re, sys
out, pattern = sys.argv[1], re.compile(sys.argv[2])
text = open("/tmp/sass-run/compile.log", errors="replace").read()
seen = {}
for block in text.split("[START_KERNEL_COMPILATION]")[1:]:
    name = re.search(r"\nname: (.*)", block)
    src = re.search(r"source:\n```[a-z]*\n(.*?)\n```\n\[END_KERNEL_COMPILATION\]", block, re.S)
    if not name or not src or not pattern.search(name.group(1)):
        continue
    base = re.sub(r"[^A-Za-z0-9_]+", "_", name.group(1))[:60]
    seen[base] = seen.get(base, 0) + 1
    path = f"{out}/{base}_{seen[base]}.cu"
    open(path, "w").write(src.group(1))
    print(path)
PY
for cu in "$out"/*.cu; do
  [ -f "$cu" ] || continue
  b=${cu%.cu}
  nvcc -cubin -arch="${ARCH:-sm_90}" -std=c++17 -Xptxas -v -o "$b.cubin" "$cu" > "$b.ptxas.txt" 2>&1 &&
    cuobjdump -sass "$b.cubin" > "$b.sass"
  echo "$(basename "$b"): $(grep -oE 'Used [0-9]+ registers.*' "$b.ptxas.txt" | head -2 | tr '\n' ' ')" \
    "$(grep -cE '^\s+/\*[0-9a-f]+\*/' "$b.sass" 2>/dev/null) SASS instructions"
  rm -f "$b.cubin"
done
tar -czf "${OUT:-/tmp/out}/sass.tgz" -C "$out" . && echo "wrote ${OUT:-/tmp/out}/sass.tgz"
