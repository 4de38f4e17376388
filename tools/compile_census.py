#!/usr/bin/env python3
"""Where the first step's kernel compilation goes (issue 14), from cubecl's compilation log.

    compile_census.py LOG [--nvrtc] [--jit] [--sample N] [--workers W] [--json OUT]

LOG: a process's stderr with cubecl's compilation logger at level "full" (`stderr = true`),
each line prefixed by seconds since the start and a tab (tools/device_compile_census.sh makes
it). Each `[START_KERNEL_COMPILATION]` block is one kernel the process compiled (name, id,
CUDA source); the time from one block to the next is what the process spent on that kernel
(NVRTC, the driver's PTX -> SASS, and whatever ran before the next compilation).

With --nvrtc the sources are compiled again here, with cubecl 0.10's NVRTC options
(`--gpu-architecture=sm_90a`, the CUDA and CCCL include paths, `-lineinfo`), on W processes at
once (each compilation timed alone), and a sample of N serially with variants (no -lineinfo,
no `#include <cuda_runtime.h>`). With --jit each PTX is loaded on the GPU with the driver's
cache off (`CUDA_CACHE_DISABLE=1`), timing PTX -> SASS. Prints tables; --json keeps the rows.
"""
import argparse
import collections
import ctypes
import glob
import json
import os
import random
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def parse(path):
    kernels, events, cur = [], [], None
    for line in open(path, errors="replace"):
        t, sep, text = line.partition("\t")
        if not sep:
            continue
        try:
            t = float(t)
        except ValueError:
            continue
        text = text.rstrip("\n")
        if text.startswith("[START_KERNEL_COMPILATION]"):
            cur = {"t": t, "name": None, "id": [], "src": [], "mode": "head"}
        elif cur is not None:
            if text.startswith("[END_KERNEL_COMPILATION]"):
                if cur["src"] and cur["src"][-1].startswith("```"):
                    cur["src"].pop()
                cur["src"] = "\n".join(cur["src"]) + "\n"
                kernels.append(cur)
                cur = None
            elif cur["mode"] == "head":
                if text.startswith("name: "):
                    cur["name"] = text[6:]
                elif text.startswith("source:"):
                    cur["mode"] = "fence"
                else:
                    cur["id"].append(text)
            elif cur["mode"] == "fence":
                cur["mode"] = "src"
            else:
                cur["src"].append(text)
        else:
            events.append((t, text))
    end = events[-1][0] if events else (kernels[-1]["t"] if kernels else 0.0)
    for i, k in enumerate(kernels):
        nxt = kernels[i + 1]["t"] if i + 1 < len(kernels) else end
        k["gap"] = max(0.0, nxt - k["t"])
        k["short"] = short_name(k)
        del k["mode"]
    return kernels, events


def short_name(k):
    name = k["name"] or ""
    if not name:
        for line in k["id"]:
            m = re.search(r"([A-Za-z_][\w:]*(?:Kernel|kernel)\w*)", line)
            if m:
                name = m.group(1)
                break
    name = name.split("<")[0]
    return name.split("::")[-1] if name else "?"


LIB = None
OPTS = None


def find_nvrtc():
    cands = []
    for root in ("/usr/local/cuda", "/opt/cuda"):
        cands += glob.glob(f"{root}/lib64/libnvrtc.so*") + glob.glob(f"{root}/targets/*/lib/libnvrtc.so*")
    cands = [c for c in cands if "builtins" not in c and "alt" not in c]
    return sorted(cands, key=len)[0] if cands else "libnvrtc.so"


def options(lineinfo=True):
    root = os.environ.get("CUDA_PATH", "/usr/local/cuda")
    inc = os.path.join(root, "include")
    opts = ["--gpu-architecture=sm_90a", f"--include-path={inc}"]
    if lineinfo:
        opts.append("-lineinfo")
    if os.path.exists(os.path.join(inc, "cccl")):
        opts.append(f"--include-path={os.path.join(inc, 'cccl')}")
    return opts


def compile_src(args):
    src, opts = args
    lib = ctypes.CDLL(LIB)
    prog = ctypes.c_void_p()
    t0 = time.perf_counter()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), None, 0, None, None)
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    t1 = time.perf_counter()
    ptx = b""
    if rc == 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return t1 - t0, rc, ptx


def jit_times(ptxs):
    os.environ["CUDA_CACHE_DISABLE"] = "1"
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    cu.cuCtxSetCurrent(ctx)
    out = []
    for ptx in ptxs:
        if not ptx:
            out.append(None)
            continue
        mod = ctypes.c_void_p()
        t0 = time.perf_counter()
        rc = cu.cuModuleLoadData(ctypes.byref(mod), ptx)
        t1 = time.perf_counter()
        out.append(t1 - t0 if rc == 0 else None)
        if rc == 0:
            cu.cuModuleUnload(mod)
    return out


def main():
    global LIB
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--nvrtc", action="store_true")
    ap.add_argument("--jit", action="store_true")
    ap.add_argument("--sample", type=int, default=30)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json")
    a = ap.parse_args()
    kernels, events = parse(a.log)
    total = sum(k["gap"] for k in kernels)
    first = kernels[0]["t"] if kernels else 0.0
    end = events[-1][0] if events else 0.0
    print(f"kernels compiled: {len(kernels)}; process {end:.1f} s, first compilation at {first:.1f} s, "
          f"time from each compilation to the next: {total:.1f} s in all")
    srcs = [k["src"] for k in kernels]
    print(f"distinct sources: {len(set(srcs))}; source bytes: {sum(map(len, srcs)) / 1e6:.1f} MB")
    incl = collections.Counter(l for s in srcs for l in s.splitlines() if l.startswith("#include"))
    for line, n in incl.most_common():
        print(f"  {n:4d} x {line}")

    if a.nvrtc:
        LIB = find_nvrtc()
        print(f"nvrtc: {LIB}; options {options()}")
        t0 = time.perf_counter()
        with ProcessPoolExecutor(a.workers) as pool:
            res = list(pool.map(compile_src, [(s, options()) for s in srcs], chunksize=1))
        wall = time.perf_counter() - t0
        for k, (t, rc, ptx) in zip(kernels, res):
            k["nvrtc"] = t
            k["nvrtc_rc"] = rc
            k["ptx"] = ptx
        fails = sum(1 for k in kernels if k["nvrtc_rc"] != 0)
        print(f"NVRTC, {a.workers} processes: wall {wall:.1f} s, sum of compilations "
              f"{sum(k['nvrtc'] for k in kernels):.1f} s, failures {fails}")
        random.seed(1)
        sample = random.sample(range(len(kernels)), min(a.sample, len(kernels)))
        rows = {"serial": [], "no-lineinfo": [], "no-cuda_runtime.h": []}
        for i in sample:
            s = srcs[i]
            rows["serial"].append(compile_src((s, options()))[0])
            rows["no-lineinfo"].append(compile_src((s, options(lineinfo=False)))[0])
            t, rc, _ = compile_src((s.replace("#include <cuda_runtime.h>\n", ""), options()))
            rows["no-cuda_runtime.h"].append(t if rc == 0 else float("nan"))
        par = sum(kernels[i]["nvrtc"] for i in sample)
        print(f"sample of {len(sample)}: in parallel {par:.1f} s; " + "; ".join(
            f"{n} {sum(v):.1f} s" for n, v in rows.items()))
        empty = compile_src(("extern \"C\" __global__ void k() {}\n", options()))[0]
        hdr = compile_src(("#include <cuda_runtime.h>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
                           "extern \"C\" __global__ void k() {}\n", options()))[0]
        print(f"an empty kernel: {empty:.3f} s; with cuda_runtime.h, cuda_bf16.h, cuda_fp16.h: {hdr:.3f} s")
    if a.jit and a.nvrtc:
        jt = jit_times([k["ptx"] for k in kernels])
        for k, t in zip(kernels, jt):
            k["jit"] = t
        print(f"PTX -> SASS (cuModuleLoadData, driver cache off): sum {sum(t for t in jt if t):.1f} s")

    by = collections.OrderedDict()
    for k in kernels:
        r = by.setdefault(k["short"], {"n": 0, "gap": 0.0, "nvrtc": 0.0, "jit": 0.0, "bytes": 0})
        r["n"] += 1
        r["gap"] += k["gap"]
        r["nvrtc"] += k.get("nvrtc") or 0.0
        r["jit"] += k.get("jit") or 0.0
        r["bytes"] += len(k["src"])
    print("\n| kernel | compiled | s to the next | NVRTC s | PTX->SASS s | source kB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in sorted(by.items(), key=lambda kv: -kv[1]["gap"]):
        print(f"| {name} | {r['n']} | {r['gap']:.1f} | {r['nvrtc']:.1f} | {r['jit']:.1f} | {r['bytes'] / 1e3:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: (v[:12] if k == "id" else v) for k, v in kk.items() if k not in ("src", "ptx")}
                       for kk in kernels], f)


if __name__ == "__main__":
    main()
