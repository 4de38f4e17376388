#!/usr/bin/env python3
"""A model directory of SmolLM2-135M-Instruct's exact shape with made-up weights, for filling the
kernel caches on a GPU machine before the real weights have arrived (tools/device_smollm2_table.sh,
stage `warm`). Standard library only.

  smollm2_skeleton.py pack CONVERTED_DIR OUT.tar.xz   # here: config, tokenizer, safetensors header
  smollm2_skeleton.py make SKELETON.tar.xz OUT_DIR    # there: the same files + model.safetensors

`make` writes every tensor of the header with bf16 values spread evenly over [-0.05, 0.05)
(a repeated pattern): finite, the right names, shapes and dtypes, so loading, quantizing (NVFP4,
MXFP4, NF4) and a training step launch the kernels the real model will.
"""
import io
import json
import os
import struct
import sys
import tarfile

FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"]


def pack(src, dst):
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = f.read(n)
    with tarfile.open(dst, "w:xz") as tar:
        for name in FILES:
            p = os.path.join(src, name)
            if os.path.exists(p):
                tar.add(p, arcname=name)
        info = tarfile.TarInfo("safetensors_header.json")
        info.size = len(header)
        tar.addfile(info, io.BytesIO(header))


def pattern(nbytes):
    vals = []
    for k in range(32768):
        x = (k / 32768.0 - 0.5) * 0.1
        bits = struct.unpack("<I", struct.pack("<f", x))[0] >> 16
        vals.append(struct.pack("<H", bits))
    block = b"".join(vals)  # 64 KiB
    return (block * (nbytes // len(block) + 1))[:nbytes]


def make(src, dst):
    os.makedirs(dst, exist_ok=True)
    with tarfile.open(src, "r:xz") as tar:
        for m in tar.getmembers():
            data = tar.extractfile(m).read()
            if m.name == "safetensors_header.json":
                header = data
            else:
                with open(os.path.join(dst, os.path.basename(m.name)), "wb") as f:
                    f.write(data)
    meta = json.loads(header)
    end = max(v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__")
    chunk = pattern(1 << 24)
    tmp = os.path.join(dst, "model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        left = end
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
    os.replace(tmp, os.path.join(dst, "model.safetensors"))
    print(f"wrote {dst}: {len(meta) - 1} tensors, {end / 1e6:.1f} MB of made-up bf16 weights")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "make"):
        sys.exit(__doc__)
    (pack if sys.argv[1] == "pack" else make)(sys.argv[2], sys.argv[3])
