#!/usr/bin/env python3
"""Build small NVFP4 (compressed-tensors `nvfp4-pack-quantized`) fixtures.

Usage:  python3 tools/make_ct_fixture.py OUT_DIR

For each of two tiny random Hugging Face models (Llama with an untied lm_head,
Qwen2 with a tied one) this script

  1. draws deterministic bf16 weights (fixed seed, drawn on the CPU so the bits
     do not depend on the device) with hand-placed special 16-blocks: an
     all-zero block (one element -0.0), a block whose fp8 block scale is
     subnormal, a block whose scale underflows to 0 in fp8 (replaced by 0.125),
     and a block whose scaled values land exactly on every e2m1 rounding tie;
  2. saves it with `save_pretrained` to OUT_DIR/<name>/bf16/;
  3. reloads it and quantizes every Linear except lm_head with the NVFP4A16
     preset of the real compressed-tensors library, doing what llm-compressor
     (QuantizationModifier(targets="Linear", scheme="NVFP4A16",
     ignore=["lm_head"]) + data-free oneshot + save_pretrained) does.  The one
     llm-compressor step that is not in compressed-tensors -- the memoryless
     min/max weight observer and the q/k/v and gate/up global-scale fusion -- is
     re-implemented here (see `calibrate_like_llmcompressor`); the arithmetic in
     it is done by compressed-tensors' own `generate_gparam` and
     `calculate_qparams`;
  4. compresses with compressed-tensors' ModelCompressor (format
     nvfp4-pack-quantized) and saves to OUT_DIR/<name>/nvfp4/ the way
     llm-compressor's save wrapper does (model.safetensors + config.json with
     quantization_config);
  5. verifies: decompresses every packed weight through compressed-tensors
     (NVFP4PackedCompressor.decompress), prints the relative error against the
     bf16 original, checks the untouched tensors are bit-identical, checks the
     library output byte for byte against an independent numpy re-implementation
     of the written spec (tools/compressed_tensors_nvfp4.md), and, on a GPU
     machine, against a second library run on the CPU.

OUT_DIR/versions.json records the library versions; OUT_DIR/<name>/report.json
the per-tensor checks.  Exit status is non-zero if a check fails.

If compressed_tensors / pydantic / loguru cannot be imported, the script
installs the wheels in <repo>/.whl into /tmp/site and re-executes itself with
PYTHONPATH pointing there.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = os.environ.get("CT_FIXTURE_SITE", "/tmp/site")


def _ensure_wheels() -> None:
    missing = [
        m
        for m in ("compressed_tensors", "pydantic", "loguru")
        if importlib.util.find_spec(m) is None
    ]
    if not missing:
        return
    if os.environ.get("CT_FIXTURE_REEXEC"):
        sys.exit(f"still missing after installing wheels: {missing}")
    wheels = sorted(str(p) for p in (REPO / ".whl").glob("*.whl"))
    if not wheels:
        sys.exit(f"missing {missing} and no wheels found in {REPO / '.whl'}")
    print(f"[setup] installing {len(wheels)} wheels into {SITE}", flush=True)
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE, *wheels]
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = SITE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CT_FIXTURE_REEXEC"] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


if __name__ == "__main__":
    _ensure_wheels()

import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
from importlib import metadata as importlib_metadata  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

SEED = 20240611
GROUP = 16
FP8_MAX = 448.0
FP4_MAX = 6.0
# llm-compressor 0.14.0.1 (observers/helpers.py FUSED_LAYER_NAMES)
FUSED_GROUPS = [
    ("gate_proj", "up_proj"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
]
EMULATED_LLMCOMPRESSOR = "0.14.0.1"


# --------------------------------------------------------------------------
# 1. deterministic tiny models
# --------------------------------------------------------------------------

def model_specs():
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    return [
        ("llama_untied", "llama", dict(common, tie_word_embeddings=False)),
        ("qwen2_tied", "qwen2", dict(common, tie_word_embeddings=True)),
    ]


def build_model(kind: str, cfg: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if kind == "llama":
        config, cls = LlamaConfig(**cfg), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(**cfg), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.bfloat16).eval()

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float32)

    new = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.05 * randn(*shape)
        elif name.endswith(".bias"):
            w = 0.02 * randn(*shape)
        elif len(shape) == 2 and (".layers." in name):
            rows, cols = shape
            w = 0.05 * randn(rows, cols)
            # per-16-block magnitude spread (log-uniform in [1/8, 2])
            spread = torch.exp2(rand(rows, cols // GROUP) * 4.0 - 3.0)
            w = (w.view(rows, cols // GROUP, GROUP) * spread.unsqueeze(-1)).view(rows, cols)
            # a few outliers
            mask = rand(rows, cols) < 0.004
            w = torch.where(mask, w * (4.0 + 8.0 * rand(rows, cols)), w)
        else:  # embeddings / lm_head
            w = 0.05 * randn(*shape)
        new[name] = w
    place_special_blocks(new, kind, randn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name].to(torch.bfloat16))
    return model


def place_special_blocks(w: dict, kind: str, randn) -> None:
    """Hand-placed blocks that exercise the corner cases of the format."""
    p = "model.layers.{}.{}.weight"

    # (a) all-zero 16-block, with one -0.0 element
    dn = w[p.format(0, "mlp.down_proj")]
    dn[3, 32:48] = 0.0
    dn[3, 40] = -0.0

    # (b) subnormal fp8 block scale and (c) block scale underflowing to 0
    o = w[p.format(0, "self_attn.o_proj")]
    a = float(o.abs().max())

    def unit_block():
        b = randn(GROUP)
        return b / b.abs().max()

    o[5, 16:32] = unit_block() * (1.2e-5 * a)  # s ~ 448*1.2e-5 ~ 5e-3: subnormal
    o[6, 0:16] = unit_block() * (5e-7 * a)  # s ~ 2e-4 -> rounds to 0 -> 0.125

    # (d) exact e2m1 rounding ties.  Force the gate/up fused amax to 1.3125 so
    # that the global scale becomes exactly 2048 (see the spec), then a block
    # with amax 6/32 gets block scale 64 and x/(s/g) = 32*x exactly.
    li = 1
    gate, up = w[p.format(li, "mlp.gate_proj")], w[p.format(li, "mlp.up_proj")]
    gate.clamp_(-1.25, 1.25)
    up.clamp_(-1.25, 1.25)
    gate[0, 0] = 1.3125
    ties = torch.tensor(
        [6.0, -6.0, 0.25, -0.25, 0.75, -0.75, 1.25, -1.25,
         1.75, -1.75, 2.5, -2.5, 3.5, -3.5, 5.0, -5.0]) / 32.0
    up[0, 0:16] = ties
    up[1, 0:16] = torch.tensor(
        [6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5,
         -1.0, -1.5, -2.0, -3.0, -4.0, 0.125, -0.125, 0.0]) / 32.0


# --------------------------------------------------------------------------
# 2. quantize with compressed-tensors, the llm-compressor way
# --------------------------------------------------------------------------

def nvfp4a16_config():
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        preset_name_to_scheme,
    )

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    # llm-compressor's QuantizationMixin._apply_observer_overrides assigns the
    # default weight observer by attribute, which marks it as user-set, so it
    # is serialized into config.json.
    scheme.weights.observer = "memoryless_minmax"
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        kv_cache_scheme=None,
        quantization_status=QuantizationStatus.INITIALIZED,
        ignore=["lm_head"],
    )


def calibrate_like_llmcompressor(model) -> None:
    """Weight-only data-free calibration as llm-compressor 0.14.0.1 does it.

    Observer "memoryless_minmax": per-16-group min and max of the weight, in the
    weight's dtype.  Fused layers (q/k/v, gate/up, ...) share one global scale,
    computed from the largest |w| over all members (which equals taking the
    smallest of their individual global scales).  The scale/zero-point/global-
    scale arithmetic itself is compressed-tensors' own code.
    """
    from compressed_tensors.quantization import QuantizationStatus, QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from compressed_tensors.utils import update_offload_parameter

    quantized = {
        name: m for name, m in model.named_modules()
        if getattr(m, "quantization_scheme", None) is not None
        and m.quantization_scheme.weights is not None
    }
    stats = {}
    for name, m in quantized.items():
        m.quantization_status = QuantizationStatus.CALIBRATION
        args = m.quantization_scheme.weights
        obs = m.weight.detach().unflatten(-1, (-1, args.group_size)).unsqueeze(0)
        stats[name] = (torch.amin(obs, dim=(0, -1)), torch.amax(obs, dim=(0, -1)))

    # fusion groups: every module of a group shares the group's stats
    partners = {name: [name] for name in quantized}
    for parent_name, parent in model.named_modules():
        for names in FUSED_GROUPS:
            if not all(hasattr(parent, n) for n in names):
                continue
            full = [f"{parent_name}.{n}" if parent_name else n for n in names]
            full = [n for n in full if n in quantized]
            if not full:
                continue
            for n in full:
                partners[n] = full

    for name, m in quantized.items():
        args = m.quantization_scheme.weights
        global_scale = None
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:
            group = partners[name]
            absmax = stats[group[0]][1].max()
            for n in group:
                absmax = torch.max(absmax, -stats[n][0].min())
                absmax = torch.max(absmax, stats[n][1].max())
            global_scale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        min_vals, max_vals = stats[name]
        scale, zero_point = calculate_qparams(
            min_vals=min_vals, max_vals=max_vals, quantization_args=args,
            global_scale=global_scale,
        )
        update_offload_parameter(m, "weight_scale", scale)
        if hasattr(m, "weight_zero_point"):
            update_offload_parameter(m, "weight_zero_point", zero_point)
        if global_scale is not None:
            update_offload_parameter(m, "weight_global_scale", global_scale)

    for m in quantized.values():  # end of calibration: freeze
        m.quantization_status = QuantizationStatus.FROZEN


def quantize_and_save(bf16_dir: Path, out_dir, device: str):
    """Load bf16_dir, quantize on `device`, compress.  Save to out_dir if given.

    Returns the compressed state dict (cpu tensors) and the config.json dict.
    """
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        apply_quantization_config,
        disable_quantization,
        enable_quantization,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.bfloat16)
    model = model.to(device).eval()

    apply_quantization_config(model, nvfp4a16_config())
    model.apply(disable_quantization)
    calibrate_like_llmcompressor(model)
    model.apply(enable_quantization)

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=None)
    compressor.compress_model(model, skip_compressed=True)

    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    if out_dir is None:
        return sd, None

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), max_shard_size="20GB")
    resave_original_config(model, bf16_dir, out_dir)
    compressor.update_config(str(out_dir))
    with open(out_dir / "config.json") as f:
        return sd, json.load(f)


def resave_original_config(model, bf16_dir: Path, out_dir: Path) -> None:
    """llm-compressor rewrites config.json from the source model's config.json,
    patching only tie_word_embeddings and the dtype key, sorted, indent 2."""
    with open(bf16_dir / "config.json") as f:
        tgt = json.load(f)
    src = model.config.to_dict()
    for keys in (["tie_word_embeddings"], ["torch_dtype", "dtype"]):
        src_key = next((k for k in keys if k in src), None)
        tgt_key = next((k for k in keys if k in tgt), None)
        if src_key is not None and tgt_key is not None:
            tgt[tgt_key] = src[src_key]
    with open(out_dir / "config.json", "w") as f:
        json.dump(tgt, f, indent=2, sort_keys=True)


# --------------------------------------------------------------------------
# 3. independent numpy re-implementation of the spec (no torch casts)
# --------------------------------------------------------------------------

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def fp8_e4m3fn_encode(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto e4m3fn for finite 0 <= v <= 448."""
    v = np.asarray(v, dtype=np.float64)
    assert np.all(v >= 0) and np.all(v <= FP8_MAX)
    out = np.zeros(v.shape, dtype=np.uint8)
    sub = v < 2.0 ** -6
    out[sub] = np.rint(v[sub] * 2.0 ** 9).astype(np.uint8)  # 8 -> 0x08 = 2^-6
    mant, exp = np.frexp(v[~sub])  # v = mant * 2^exp, mant in [0.5, 1)
    e = exp.astype(np.int64) - 1
    m = np.rint((mant * 2.0 - 1.0) * 8.0).astype(np.int64)
    carry = m == 8
    e[carry] += 1
    m[carry] = 0
    out[~sub] = (((e + 7) << 3) | m).astype(np.uint8)
    return out


def fp8_e4m3fn_decode(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    return (s * mag).astype(np.float32)


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def e2m1_code(y: np.ndarray) -> np.ndarray:
    """y: f32, already clamped to [-6, 6].  Ties go to the even code."""
    a = np.abs(y)
    mag = np.zeros(y.shape, dtype=np.uint8)
    # (upper bound of the range, inclusive?) -> code
    mag[(a > 0.25) & (a < 0.75)] = 1
    mag[(a >= 0.75) & (a <= 1.25)] = 2
    mag[(a > 1.25) & (a < 1.75)] = 3
    mag[(a >= 1.75) & (a <= 2.5)] = 4
    mag[(a > 2.5) & (a < 3.5)] = 5
    mag[(a >= 3.5) & (a <= 5.0)] = 6
    mag[a > 5.0] = 7
    sign = (y < 0).astype(np.uint8)  # -0.0 is not < 0: gets the + code
    return mag | (sign << 3)


def ref_global_scale(absmax_bf16: np.float32) -> np.float32:
    a = np.float32(max(absmax_bf16, np.float32(2.0 ** -126)))
    recip = round_bf16(np.array([np.float32(1.0) / a], dtype=np.float32))
    with np.errstate(over="ignore"):
        g = round_bf16(recip * np.float32(FP8_MAX * FP4_MAX))[0]
    if not np.isfinite(g):
        g = np.float32(1.0)
    return np.float32(g)


def ref_quantize(w: np.ndarray, g: np.float32):
    """w: f32 (exact bf16 values) [rows, cols].  Returns (packed u8, scale fp8 bits)."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // GROUP, GROUP)
    amax = np.abs(blocks).max(axis=-1).astype(np.float32)
    t = round_bf16(amax / np.float32(6.0))
    p = (g * t).astype(np.float32)
    p = np.clip(p, -FP8_MAX, FP8_MAX)
    sbits = fp8_e4m3fn_encode(p)
    sbits[sbits == 0] = 0x20  # 0.125
    s = fp8_e4m3fn_decode(sbits)
    d = (s / g).astype(np.float32)
    y = (blocks / d[..., None]).astype(np.float32)
    y = np.clip(y, np.float32(-6.0), np.float32(6.0))
    codes = e2m1_code(y).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sbits


def naive_quantize(w: np.ndarray, absmax: np.float32):
    """The formula as first written down (g in full f32, no bf16 steps)."""
    rows, cols = w.shape
    g = np.float32(np.float32(FP8_MAX * FP4_MAX) / np.float32(absmax))
    blocks = w.reshape(rows, cols // GROUP, GROUP)
    amax = np.abs(blocks).max(axis=-1).astype(np.float32)
    p = np.clip((g * amax / np.float32(6.0)).astype(np.float32), -FP8_MAX, FP8_MAX)
    sbits = fp8_e4m3fn_encode(p)
    sbits[sbits == 0] = 0x20
    d = (fp8_e4m3fn_decode(sbits) / g).astype(np.float32)
    y = np.clip((blocks / d[..., None]).astype(np.float32), -6.0, 6.0)
    codes = e2m1_code(y.astype(np.float32)).reshape(rows, cols)
    return g, (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), sbits


def ref_dequantize(packed: np.ndarray, sbits: np.ndarray, g: np.float32) -> np.ndarray:
    """What compressed-tensors' decompression computes (result bf16 bits)."""
    rows = packed.shape[0]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, -1)
    vals = E2M1[codes & 7] * np.where(codes & 8, np.float32(-1), np.float32(1))
    d = (fp8_e4m3fn_decode(sbits) / g).astype(np.float32)
    out = (vals.reshape(rows, -1, GROUP) * d[..., None]).astype(np.float32)
    return f32_to_bf16_bits(out.reshape(rows, -1))


# --------------------------------------------------------------------------
# 4. checks
# --------------------------------------------------------------------------

def u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def bf16_to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def verify(name: str, bf16_dir: Path, nvfp4_dir: Path, cfg: dict, report: dict) -> bool:
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from safetensors.torch import load_file

    ok = True
    orig = load_file(str(bf16_dir / "model.safetensors"))
    comp = load_file(str(nvfp4_dir / "model.safetensors"))
    with safe_open(str(nvfp4_dir / "model.safetensors"), "pt") as f:
        report["safetensors_metadata"] = f.metadata()

    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])
    scheme = qcfg.config_groups["group_0"]

    prefixes = sorted(k[: -len(".weight_packed")] for k in comp if k.endswith(".weight_packed"))
    report["quantized_modules"] = prefixes
    expected_names = set()
    for pre in prefixes:
        expected_names |= {f"{pre}.weight_packed", f"{pre}.weight_scale", f"{pre}.weight_global_scale"}

    # untouched tensors must be bit-identical
    for k, v in orig.items():
        if k.endswith(".weight") and k[: -len(".weight")] in prefixes:
            continue
        expected_names.add(k)
        if k not in comp or comp[k].dtype != v.dtype or not np.array_equal(u8(comp[k]), u8(v)):
            print(f"  FAIL untouched tensor {k} differs or missing")
            ok = False
    if set(comp) != expected_names:
        print(f"  FAIL tensor name set: extra={sorted(set(comp) - expected_names)} "
              f"missing={sorted(expected_names - set(comp))}")
        ok = False

    # fused groups, from names
    def fused_key(pre):
        parent, leaf = pre.rsplit(".", 1)
        for grp in FUSED_GROUPS:
            if leaf in grp:
                return parent, grp
        return pre, (leaf,)

    absmax = {}
    for pre in prefixes:
        key = fused_key(pre)
        a = float(orig[pre + ".weight"].float().abs().max())
        absmax[key] = max(absmax.get(key, 0.0), a)

    per = {}
    totals = dict(zero_scale_replaced=0, subnormal_scales=0, tie_values=0,
                  naive_scale_mismatch=0, naive_packed_mismatch=0, naive_global_mismatch=0)
    for pre in prefixes:
        W = orig[pre + ".weight"]
        packed, scale, gs = comp[pre + ".weight_packed"], comp[pre + ".weight_scale"], comp[pre + ".weight_global_scale"]
        rows, cols = W.shape
        entry = {
            "weight_packed": [str(packed.dtype), list(packed.shape)],
            "weight_scale": [str(scale.dtype), list(scale.shape)],
            "weight_global_scale": [str(gs.dtype), list(gs.shape)],
            "global_scale": float(gs[0]),
        }
        shapes_ok = (packed.dtype == torch.uint8 and list(packed.shape) == [rows, cols // 2]
                     and scale.dtype == torch.float8_e4m3fn and list(scale.shape) == [rows, cols // GROUP]
                     and gs.dtype == torch.float32 and list(gs.shape) == [1])
        if not shapes_ok:
            print(f"  FAIL dtype/shape {pre}: {entry}")
            ok = False

        # (a) library decompression
        sd = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}
        deq = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        Wf, Df = W.float(), deq.float()
        rel = float((Df - Wf).norm() / Wf.norm())
        entry["decompressed_dtype"] = str(deq.dtype)
        entry["rel_err"] = rel
        if not rel < 0.25:
            print(f"  FAIL rel err {pre}: {rel}")
            ok = False

        # (b) independent reference of the spec
        w_np = bf16_to_np(W)
        key = fused_key(pre)
        g_ref = ref_global_scale(np.float32(absmax[key]))
        packed_ref, sbits_ref = ref_quantize(w_np, g_ref)
        g_lib = np.float32(gs.numpy()[0])
        entry["ref_global_scale_equal"] = bool(g_ref.view(np.uint32) == g_lib.view(np.uint32))
        entry["ref_scale_equal"] = bool(np.array_equal(sbits_ref, u8(scale)))
        entry["ref_packed_equal"] = bool(np.array_equal(packed_ref, u8(packed)))
        deq_ref = ref_dequantize(u8(packed), u8(scale), g_lib)
        entry["ref_dequant_equal"] = bool(np.array_equal(deq_ref, u8(deq.to(torch.bfloat16)).view(np.uint16)))
        if not all(entry[k] for k in ("ref_global_scale_equal", "ref_scale_equal",
                                       "ref_packed_equal", "ref_dequant_equal")):
            print(f"  FAIL spec reference mismatch {pre}: g_ref={g_ref!r} g_lib={g_lib!r} "
                  f"scale_diff={int((sbits_ref != u8(scale)).sum())} "
                  f"packed_diff={int((packed_ref != u8(packed)).sum())}")
            ok = False

        # statistics about the corner cases
        sb = u8(scale)
        blocks = w_np.reshape(rows, cols // GROUP, GROUP)
        amax_b = np.abs(blocks).max(-1)
        entry["zero_scale_replaced"] = int(((sb == 0x20) & (amax_b * g_lib * 8 < 0.25 * 6)).sum())
        entry["subnormal_scales"] = int((((sb >> 3) & 0xF) == 0).sum())
        y = blocks / (fp8_e4m3fn_decode(sb) / g_lib)[..., None]
        entry["tie_values"] = int(np.isin(np.abs(y.astype(np.float32)), np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).sum())
        # (c) how far the naive all-f32 formula is from the library
        g_n, packed_n, sbits_n = naive_quantize(w_np, np.float32(absmax[key]))
        entry["naive_global_scale"] = float(g_n)
        entry["naive_scale_mismatch"] = int((sbits_n != sb).sum())
        entry["naive_packed_mismatch"] = int((packed_n != u8(packed)).sum())
        totals["naive_global_mismatch"] += int(g_n.view(np.uint32) != g_lib.view(np.uint32))
        for k in ("zero_scale_replaced", "subnormal_scales", "tie_values",
                  "naive_scale_mismatch", "naive_packed_mismatch"):
            totals[k] += entry[k]
        per[pre] = entry
        print(f"  {pre:40s} packed {tuple(packed.shape)} scale {tuple(scale.shape)} "
              f"g={float(gs[0]):.6g} rel_err={rel:.4f} spec_ref={'ok' if entry['ref_packed_equal'] and entry['ref_scale_equal'] and entry['ref_global_scale_equal'] else 'MISMATCH'}")

    # q/k/v and gate/up must share one global scale
    shared = {}
    for pre in prefixes:
        shared.setdefault(fused_key(pre), set()).add(float(comp[pre + ".weight_global_scale"][0]))
    fused_ok = all(len(v) == 1 for v in shared.values())
    if not fused_ok:
        print(f"  FAIL fused global scales differ: {shared}")
        ok = False
    report["fused_global_scales_shared"] = fused_ok
    report["tensors"] = per
    report["totals"] = totals
    print(f"  corner cases: {totals}")
    if totals["zero_scale_replaced"] == 0 or totals["subnormal_scales"] == 0 or totals["tie_values"] == 0:
        print("  WARNING: a corner case was not exercised")
    return ok


def try_transformers_load(nvfp4_dir: Path, bf16_dir: Path, report: dict) -> None:
    """Optional: load through transformers' compressed-tensors integration."""
    try:
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        ref = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.bfloat16).eval()
        qm = AutoModelForCausalLM.from_pretrained(
            str(nvfp4_dir), dtype=torch.bfloat16,
            quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        ids = torch.arange(1, 33).unsqueeze(0)
        with torch.no_grad():
            a = ref(ids).logits.float().flatten()
            b = qm(ids).logits.float().flatten()
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        report["transformers_load"] = {"ok": True, "logits_cosine_vs_bf16": cos}
        print(f"  transformers load (dequantize=True): ok, logits cosine vs bf16 = {cos:.5f}")
    except Exception as e:  # informative only
        report["transformers_load"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        print(f"  transformers load: failed (informative only): {type(e).__name__}: {str(e)[:200]}")


def compress_backend(device: str) -> str:
    from compressed_tensors.utils import triton as ct_triton

    if device.startswith("cuda") and ct_triton.HAS_TRITON and not os.environ.get("CT_ENFORCE_EAGER"):
        return "triton (quantize_and_pack_fp4 kernel)"
    return "torch eager (quantize + pack_fp4_to_uint8)"


def versions(device: str) -> dict:
    def ver(dist):
        try:
            return importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            return None

    import compressed_tensors
    from compressed_tensors.utils import triton as ct_triton

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "compressed_tensors": compressed_tensors.__version__,
        "compressed_tensors_file": compressed_tensors.__file__,
        "compressed_tensors_triton_available": bool(ct_triton.HAS_TRITON),
        "CT_ENFORCE_EAGER": os.environ.get("CT_ENFORCE_EAGER"),
        "emulated_llmcompressor": EMULATED_LLMCOMPRESSOR + " (not installed; observer + fusion step re-implemented)",
        "seed": SEED,
    }
    for dist in ("transformers", "safetensors", "pydantic", "pydantic-core", "loguru",
                 "accelerate", "numpy", "triton", "huggingface-hub", "typing-extensions"):
        v[dist] = ver(dist)
    return v


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vers = versions(device)
    print(json.dumps(vers, indent=2))
    with open(out / "versions.json", "w") as f:
        json.dump(vers, f, indent=2)

    all_ok = True
    for i, (name, kind, cfg) in enumerate(model_specs()):
        print(f"== {name}")
        bf16_dir, nvfp4_dir = out / name / "bf16", out / name / "nvfp4"
        model = build_model(kind, cfg, SEED + i)
        model.save_pretrained(str(bf16_dir))
        del model

        report = {"model": name, "kind": kind, "device": device,
                  "compress_backend": compress_backend(device)}
        try:
            sd_dev, config = quantize_and_save(bf16_dir, nvfp4_dir, device)
            used = device
        except Exception as e:
            if device == "cpu":
                raise
            # e.g. Triton cannot build its launcher: fall back to the eager
            # torch path on the CPU (bit-identical where both ran)
            print(f"  WARNING: run on {device} failed ({type(e).__name__}: {str(e)[:300]}); "
                  "using the CPU run instead")
            report["device_run_error"] = f"{type(e).__name__}: {e}"[:1000]
            shutil.rmtree(nvfp4_dir, ignore_errors=True)
            sd_dev, config = quantize_and_save(bf16_dir, nvfp4_dir, "cpu")
            used = report["device"] = "cpu"
            report["compress_backend"] = compress_backend("cpu")
        ok = verify(name, bf16_dir, nvfp4_dir, config, report)

        if used != "cpu":  # the same library run on the CPU (eager torch path)
            sd_cpu, _ = quantize_and_save(bf16_dir, None, "cpu")
            same = sorted(sd_cpu) == sorted(sd_dev) and all(
                sd_cpu[k].dtype == sd_dev[k].dtype and np.array_equal(u8(sd_cpu[k]), u8(sd_dev[k]))
                for k in sd_cpu)
            report["cpu_run_identical_to_device_run"] = same
            print(f"  library on cpu == library on {device}: {same}")
            ok = ok and same

        try_transformers_load(nvfp4_dir, bf16_dir, report)
        report["ok"] = ok
        with open(out / name / "report.json", "w") as f:
            json.dump(report, f, indent=2)
        print(f"  {'OK' if ok else 'FAILED'}: {name}")
        all_ok = all_ok and ok

    print("ALL OK" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
