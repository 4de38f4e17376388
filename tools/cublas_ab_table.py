#!/usr/bin/env python3
"""The update products (dequantize + cuBLAS) of several qerl-kernel-bench runs beside torch's
cuBLAS bf16, on the GPU machine, in the same call (issue 16, item 4).

    python3 tools/cublas_ab_table.py name=qerl.json [name=qerl.json ...]

Each JSON is one `qerl-kernel-bench --kernels strategies --strategies cublas` run (one variant:
environment knobs). Prints, per shape and M: torch's forward and dX (CUDA events, weights rotated
past the L2, benches/device_table.py), then per variant the product (`matmul@cublas`,
`dx@cublas`) with its ratio to torch, and its parts (`dequant_rows`, `dense@cublas`).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benches"))
from device_table import SHAPES, cublas, cublas_dx, copy_bandwidth  # noqa: E402


def main():
    runs = []
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        rows = json.load(open(path))
        runs.append((name, {(r["model"], r["layer"], r["kernel"], r["m"]): r["us"] for r in rows}))
    shapes = sorted({(k[0], k[1], k[3]) for _, q in runs for k in q}, key=lambda s: (s[0], [l for l, _, _ in SHAPES[s[0]]].index(s[1]), s[2]))
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; copy {copy_bandwidth():.2f} TB/s")
    head = "| model | layer | M | torch fwd us | torch dX us |"
    sep = "| --- | --- | ---: | ---: | ---: |"
    for name, _ in runs:
        head += f" {name} fwd us (ratio) | dX us (ratio) | decode us | dense us |"
        sep += " ---: | ---: | ---: | ---: |"
    print(head)
    print(sep)
    dims = {(m, l): (n, k) for m, ls in SHAPES.items() for l, n, k in ls}
    for model, layer, m in shapes:
        n, k = dims[(model, layer)]
        fwd, dx = cublas(m, n, k), cublas_dx(m, n, k)
        line = f"| {model[7:]} | {layer} | {m} | {fwd:.1f} | {dx:.1f} |"
        for _, q in runs:
            g = lambda kern: q.get((model, layer, kern, m))
            f = lambda v: f"{v:.1f}" if v else "-"
            r = lambda v, base: f"{v:.1f} ({base / v:.2f})" if v else "-"
            line += f" {r(g('matmul@cublas'), fwd)} | {r(g('dx@cublas'), dx)} | {f(g('dequant_rows'))} | {f(g('dense@cublas'))} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
