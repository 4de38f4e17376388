#!/usr/bin/env bash
# Splits the SmolLM2-135M-Instruct GGUF (tools/fetch_smollm2.sh) into pieces small enough to carry
# to a GPU machine beside the qerl binary (a call carries at most 64 MiB; .device/qerl.tar.gz is
# ~15 MiB): xz -9e (98.4 MB -> 90.4 MB: 4-bit weights hardly compress; zstd -19 gives 89.9 MB but
# the GPU machine may lack zstd, while xz or Python's lzma is everywhere), then `split` into
# .device/smollm2.part-aa, -ab, ... of at most PIECE_MIB MiB (default 22: four pieces, since
# the working tree, ~23 MB, travels with every device call inside its 64 MiB).
# Also writes .device/smollm2.sha256: the GGUF's sha256 and each piece's, which
# tools/device_smollm2_table.sh checks after reassembling; and .device/smollm2-skel.tar.xz
# (0.5 MB: config, tokenizer and the safetensors header of the converted model,
# tools/smollm2_skeleton.py), with which a call that has only some of the pieces fills the
# kernel caches. The skeleton needs a qerl binary here: QERL (default: qerl on PATH, else
# target/release/qerl).
#   [QERL=path/to/qerl] tools/smollm2_pieces.sh [GGUF]
# Then carry .device/qerl.tar.gz, .device/smollm2.sha256 and the pieces, over one or more calls
# to the same warm machine (docs/results.md, "SmolLM2-135M-Instruct on one H100").
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=${1:-target/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
piece_mib=${PIECE_MIB:-22}
[ -s "$gguf" ] || { echo "no $gguf: run tools/fetch_smollm2.sh first" >&2; exit 1; }
mkdir -p .device
sum=$(sha256sum "$gguf" | cut -d' ' -f1)
if [ -s .device/smollm2.sha256 ] && grep -q "^$sum  gguf$" .device/smollm2.sha256 &&
  (cd .device && sha256sum --quiet -c <(grep ' smollm2\.part-' smollm2.sha256)) 2>/dev/null; then
  echo "pieces of $gguf already in .device (up to date):"
else
  rm -f .device/smollm2.part-* .device/smollm2.sha256
  xz -9e -T2 -c "$gguf" > .device/smollm2.gguf.xz.tmp
  split -b "${piece_mib}M" .device/smollm2.gguf.xz.tmp .device/smollm2.part-
  rm .device/smollm2.gguf.xz.tmp
  { echo "$sum  gguf"; (cd .device && sha256sum smollm2.part-*); } > .device/smollm2.sha256
  echo "wrote the pieces of $gguf:"
fi
if [ ! -s .device/smollm2-skel.tar.xz ]; then
  qerl=${QERL:-$(command -v qerl || echo target/release/qerl)}
  if [ -x "$qerl" ]; then
    tmp=$(mktemp -d)
    "$qerl" convert "$gguf" "$tmp/m" --dtype bf16 > /dev/null &&
      python3 tools/smollm2_skeleton.py pack "$tmp/m" .device/smollm2-skel.tar.xz
    rm -rf "$tmp"
  else
    echo "no qerl binary ($qerl): no .device/smollm2-skel.tar.xz (set QERL to make it)" >&2
  fi
fi
ls -l .device/smollm2.part-* .device/smollm2.sha256 .device/smollm2-skel.tar.xz
cat .device/smollm2.sha256
