#!/usr/bin/env python3
"""Baselines and the kernel table, on the GPU machine, in the same run as qerl-kernel-bench.

    python3 benches/device_table.py --qerl qerl.json [--prev old.json] [--out table.md] [--models ...] [--m ...]

Measures, with CUDA events (median of several batches, inputs rotated so repeated runs do not
measure the cache): the device-to-device copy bandwidth (bytes read + written), the bf16 matmul
peak (8192^3 through cuBLAS), and torch bf16 `x @ w.T` (cuBLAS) on every shape qerl-kernel-bench
timed; then prints one markdown table per model with qerl's rows beside cuBLAS's, and where
present the split-K, decode and previous-run (`--prev`, an earlier qerl.json) comparisons.
"""
import argparse
import json
import statistics
import sys

import torch

SHAPES = {
    "qwen2.5-7b": [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)],
    "qwen2.5-32b": [("qkv", 7168, 5120), ("o", 5120, 5120), ("gate_up", 55296, 5120), ("down", 5120, 27648)],
}


def time_ms(fn, iters=20, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_bandwidth():
    n = 1 << 30  # 1 GiB of bytes, 2 GiB moved per copy
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    ms = time_ms(lambda i=0: dst.copy_(src), iters=10)
    return 2 * n / (ms * 1e-3) / 1e12


def matmul_peak():
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda i=0: a @ b, iters=10)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def cublas(m, n, k):
    # Rotate over enough weight copies to exceed the 50 MB L2 for small shapes.
    copies = max(1, min(8, (256 << 20) // (2 * n * k) + 1))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda i=0: x @ ws[i % copies].t())
    del ws
    return ms * 1e3


def cublas_dx(m, n, k):
    """The backward product through the same weight: dX[m, k] = dY[m, n] @ W[n, k]."""
    copies = max(1, min(8, (256 << 20) // (2 * n * k) + 1))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda i=0: dy @ ws[i % copies])
    del ws
    return ms * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--qerl", required=True)
    p.add_argument("--out")
    p.add_argument("--prev", help="qerl.json of an earlier run, shown beside this one")
    p.add_argument("--models", default="qwen2.5-7b,qwen2.5-32b")
    p.add_argument("--m", default="1,4,16,64,256,1024,4096")
    a = p.parse_args()
    rows = json.load(open(a.qerl))
    ms_list = [int(v) for v in a.m.split(",")]
    dev = torch.cuda.get_device_name()
    lines = [f"device: {dev}; torch {torch.__version__}"]
    bw, peak = copy_bandwidth(), matmul_peak()
    lines.append(f"copy bandwidth (read + write): {bw:.2f} TB/s; cuBLAS bf16 8192^3: {peak:.0f} TFLOP/s")
    qerl = {(r["model"], r["layer"], r["kernel"], r["format"], r["m"]): r for r in rows}
    prev = {}
    if a.prev:
        prev = {(r["model"], r["layer"], r["kernel"], r["format"], r["m"]): r for r in json.load(open(a.prev))}
    cub = {}
    for model in a.models.split(","):
        lines.append("")
        lines.append(f"### {model}")
        lines.append("")
        lines.append("| layer | M | cuBLAS bf16 us | TFLOP/s | qerl nvfp4 us | TB/s | TFLOP/s | vs cuBLAS | mxfp4 us | nf4 us | dX nvfp4 us | dX vs cuBLAS |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for layer, n, k in SHAPES[model]:
            for m in ms_list:
                us = cublas(m, n, k)
                cub[(model, layer, m)] = us
                tf = 2 * m * n * k / (us * 1e-6) / 1e12
                q = qerl.get((model, layer, "matmul", "nvfp4", m))
                mx = qerl.get((model, layer, "matmul", "mxfp4", m))
                nf = qerl.get((model, layer, "matmul", "nf4", m))
                dx = qerl.get((model, layer, "dx", "nvfp4", m))
                f = lambda r, key="us", fmt="{:.1f}": fmt.format(r[key]) if r else "-"
                ratio = f"{us / q['us']:.2f}x" if q else "-"
                dx_ratio = f"{us / dx['us']:.2f}x" if dx else "-"
                lines.append(
                    f"| {layer} | {m} | {us:.1f} | {tf:.1f} | {f(q)} | {f(q, 'tb_s', '{:.2f}')} | "
                    f"{f(q, 'tflop_s', '{:.1f}')} | {ratio} | {f(mx)} | {f(nf)} | {f(dx)} | {dx_ratio} |"
                )
    lora = [r for r in rows if r["kernel"] in ("lora16", "lora32", "lora64")]
    if lora:
        lines.append("")
        lines.append("LoRA epilogue (lora_down + fused epilogue) over plain nvfp4 matmul:")
        lines.append("")
        lines.append("| model | layer | M | rank | us | plain us | overhead | previous overhead |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in lora:
            key = (r["model"], r["layer"], "matmul", "nvfp4", r["m"])
            plain = qerl.get(key)
            old, old_plain = prev.get((r["model"], r["layer"], r["kernel"], "nvfp4", r["m"])), prev.get(key)
            was = f"{100 * (old['us'] / old_plain['us'] - 1):.1f}%" if old and old_plain else "-"
            if plain:
                lines.append(
                    f"| {r['model']} | {r['layer']} | {r['m']} | {r['kernel'][4:]} | {r['us']:.1f} | "
                    f"{plain['us']:.1f} | {100 * (r['us'] / plain['us'] - 1):.1f}% | {was} |"
                )
    old = [r for r in rows if r["kernel"] in ("matmul_old", "dx_old")]
    if old:
        lines.append("")
        lines.append("Tiled kernel (tensor cores off) against the tensor-core path, same run, nvfp4:")
        lines.append("")
        lines.append("| model | layer | product | M | tiled us | new us | speed-up | new TFLOP/s |")
        lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in old:
            kind = r["kernel"][:-4]
            new = qerl.get((r["model"], r["layer"], kind, "nvfp4", r["m"]))
            if new:
                lines.append(
                    f"| {r['model']} | {r['layer']} | {kind} | {r['m']} | {r['us']:.1f} | {new['us']:.1f} | "
                    f"{r['us'] / new['us']:.1f}x | {new['tflop_s']:.1f} |"
                )
    nosplit = [r for r in rows if r["kernel"].endswith("_nosplit")]
    if nosplit:
        lines.append("")
        lines.append("Split-K against the same kernels with split-K off, same run, nvfp4 (LoRA: rank 16, lora_down + product):")
        lines.append("")
        lines.append("| model | layer | product | M | no split us | split-K us | speed-up | split-K vs cuBLAS |")
        lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in nosplit:
            kind = r["kernel"][: -len("_nosplit")]
            new = qerl.get((r["model"], r["layer"], kind, "nvfp4", r["m"]))
            cb = cub.get((r["model"], r["layer"], r["m"]))
            if new:
                vs = f"{cb / new['us']:.2f}x" if cb and kind != "lora16" else "-"
                lines.append(
                    f"| {r['model']} | {r['layer']} | {kind} | {r['m']} | {r['us']:.1f} | {new['us']:.1f} | "
                    f"{r['us'] / new['us']:.2f}x | {vs} |"
                )
    dec = [r for r in rows if r["kernel"] == "matmul" and r["format"] == "nvfp4" and r["m"] <= 16]
    if dec:
        lines.append("")
        lines.append(f"Decode kernel (M <= 16), nvfp4: bandwidth against the {bw:.2f} TB/s copy bandwidth (target 80%)"
                     + (", the previous run's kernel beside it" if prev else "")
                     + "; at M = 16 also the tensor-core path (split-K) of this run:")
        lines.append("")
        lines.append("| model | layer | M | us | TB/s | of copy | vs cuBLAS | previous us | previous TB/s | tensor-core us |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in dec:
            old = prev.get((r["model"], r["layer"], "matmul", "nvfp4", r["m"]))
            tc = qerl.get((r["model"], r["layer"], "matmul_tc", "nvfp4", r["m"]))
            cb = cub.get((r["model"], r["layer"], r["m"]))
            vs = f"{cb / r['us']:.2f}x" if cb else "-"
            lines.append(
                f"| {r['model']} | {r['layer']} | {r['m']} | {r['us']:.1f} | {r['tb_s']:.2f} | "
                f"{100 * r['tb_s'] / bw:.0f}% | {vs} | "
                f"{old['us'] if old else float('nan'):.1f} | {old['tb_s'] if old else float('nan'):.2f} | "
                f"{tc['us'] if tc else float('nan'):.1f} |"
            )
    strat = [r for r in rows if r["kernel"] == "matmul@tc"]
    if strat:
        lines.append("")
        lines.append("Strategies, nvfp4: the tensor-core kernel alone (tc), dequantize + cuBLAS alone (cublas), "
                     "the autotuner's pick (tuned); vs cuBLAS = cuBLAS bf16 time / tuned time (target >= 0.80 at "
                     "M >= 1024); LoRA = rank-16 LoRA product (lora_down + product) over the plain one, both tuned "
                     "(target <= 10% at M >= 256):")
        lines.append("")
        lines.append("| model | layer | M | cuBLAS bf16 us | matmul tc us | cublas us | tuned us | vs cuBLAS | "
                     "dX tc us | cublas us | tuned us | vs cuBLAS | LoRA tc us | cublas us | tuned us | LoRA overhead |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in strat:
            key = lambda kern: qerl.get((r["model"], r["layer"], kern, "nvfp4", r["m"]))
            f = lambda x: f"{x['us']:.1f}" if x else "-"
            cb = cub.get((r["model"], r["layer"], r["m"]))
            vs = lambda x: f"{cb / x['us']:.2f}" if x and cb else "-"
            mt, dt, lt = key("matmul"), key("dx"), key("lora16")
            over = f"{100 * (lt['us'] / mt['us'] - 1):.1f}%" if lt and mt else "-"
            lines.append(
                f"| {r['model']} | {r['layer']} | {r['m']} | {cb:.1f} | {f(r)} | {f(key('matmul@cublas'))} | {f(mt)} | {vs(mt)} | "
                f"{f(key('dx@tc'))} | {f(key('dx@cublas'))} | {f(dt)} | {vs(dt)} | "
                f"{f(key('lora16@tc'))} | {f(key('lora16@cublas'))} | {f(lt)} | {over} |"
                if cb else f"| {r['model']} | {r['layer']} | {r['m']} | - | {f(r)} | - | - | - | - | - | - | - | - | - | - | - |"
            )
    parts = [r for r in rows if r["kernel"] == "matmul@cublas"]
    if parts:
        lines.append("")
        lines.append("Update products on dequantize + cuBLAS, nvfp4 (target: >= 0.70 of cuBLAS bf16 at M >= 1024, "
                     "forward and dX), and the forward's parts: the decode alone and cuBLAS on the decoded weight "
                     "through qerl; cuBLAS bf16 = torch `x @ w.T` and `dy @ w`:")
        lines.append("")
        lines.append("| model | layer | M | cuBLAS us | qerl us | vs cuBLAS | decode us | dense GEMM us | "
                     "dX cuBLAS us | dX qerl us | vs cuBLAS |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in parts:
            key = lambda kern: qerl.get((r["model"], r["layer"], kern, "nvfp4", r["m"]))
            n, k, m = r["n"], r["k"], r["m"]
            fw = cub.get((r["model"], r["layer"], m)) or cublas(m, n, k)
            bw_ = cublas_dx(m, n, k)
            f = lambda x: f"{x['us']:.1f}" if x else "-"
            vs = lambda base, x: f"{base / x['us']:.2f}" if x else "-"
            dq = key("dx@cublas")
            lines.append(
                f"| {r['model']} | {r['layer']} | {m} | {fw:.1f} | {f(r)} | {vs(fw, r)} | "
                f"{f(key('dequant_rows'))} | {f(key('dense@cublas'))} | {bw_:.1f} | {f(dq)} | {vs(bw_, dq)} |"
            )
    if prev:
        lines.append("")
        lines.append("This run against the previous one (`--prev`), nvfp4, M > 16:")
        lines.append("")
        lines.append("| model | layer | product | M | previous us | now us | speed-up | now vs cuBLAS |")
        lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            if r["kernel"] in ("matmul", "dx") and r["format"] == "nvfp4" and r["m"] > 16:
                old = prev.get((r["model"], r["layer"], r["kernel"], "nvfp4", r["m"]))
                cb = cub.get((r["model"], r["layer"], r["m"]))
                if old:
                    vs = f"{cb / r['us']:.2f}x" if cb else "-"
                    lines.append(
                        f"| {r['model']} | {r['layer']} | {r['kernel']} | {r['m']} | {old['us']:.1f} | {r['us']:.1f} | "
                        f"{old['us'] / r['us']:.2f}x | {vs} |"
                    )
    norms = [r for r in rows if r["kernel"] == "rmsnorm"]
    if norms:
        lines.append("")
        lines.append("| model | noisy RMSNorm M | D | us | TB/s | of copy bandwidth |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in norms:
            lines.append(f"| {r['model']} | {r['m']} | {r['n']} | {r['us']:.1f} | {r['tb_s']:.2f} | {100 * r['tb_s'] / bw:.0f}% |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
