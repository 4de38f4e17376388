#!/usr/bin/env python3
"""Independent reference values for qerl's GGUF importer (`qerl convert`).

Uses the `gguf` Python package (llama.cpp's gguf-py) as a dequantization oracle and numpy for
a Llama forward pass written here, in llama.cpp's own convention (weights as stored in the GGUF
file, RoPE rotating adjacent pairs), so that it shares nothing with qerl's Rust code: not the
dequantizers, not the name mapping, not the un-permutation of q/k rows (the Rust side puts rows
back in Hugging Face order and uses `rotate_half`; both must give the same logits).

    pip install gguf numpy

Subcommands:
  types-fixture OUT_DIR     random blocks of every type qerl reads -> dequant_types.gguf, and
                            gguf-py's dequantization of each -> dequant_types_ref.gguf (F32)
  compare GGUF HF_DIR       every tensor of HF_DIR/model.safetensors vs gguf-py's dequantization
                            of the GGUF (q/k rows re-permuted here the llama.cpp way); prints the
                            largest difference per ggml type, exits 1 on a mismatch
  logits GGUF --ids 1,2,3 --out REF.json [--top-k 10] [--text TEXT]
                            numpy forward pass of the (llama) model in GGUF on the token ids;
                            writes each position's top-k next-token log-probabilities
"""

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, GGML_QUANT_SIZES
from gguf.quants import dequantize

# Byte ranges of each type's f16 scale fields inside one block (random bytes there could be
# NaN or infinity; they get sane random halves instead).
F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def types_fixture(out_dir: Path) -> None:
    rng = np.random.default_rng(21)
    rows, cols = 3, 512
    out_dir.mkdir(parents=True, exist_ok=True)
    quant = GGUFWriter(str(out_dir / "dequant_types.gguf"), "qerl-test")
    ref = GGUFWriter(str(out_dir / "dequant_types_ref.gguf"), "qerl-test")
    for qtype in TYPES:
        name = qtype.name.lower()
        if qtype == Q.F32:
            raw = rng.standard_normal((rows, cols)).astype(np.float32)
            values = raw
            quant.add_tensor(name, raw)
        elif qtype == Q.F16:
            raw = rng.standard_normal((rows, cols)).astype(np.float16)
            values = raw.astype(np.float32)
            quant.add_tensor(name, raw)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
            if qtype == Q.BF16:
                # Random halves of sane f32 values (no NaN / inf bit patterns).
                f = rng.standard_normal((rows, cols)).astype(np.float32)
                raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
            for b in range(cols // block):
                for at in F16_FIELDS.get(qtype, []):
                    halves = (rng.standard_normal(rows) * 0.05).astype(np.float16)
                    raw[:, b * size + at : b * size + at + 2] = halves.view(np.uint8).reshape(rows, 2)
            values = dequantize(raw, qtype).astype(np.float32)
            quant.add_tensor(name, raw, raw_dtype=qtype)
        assert values.shape == (rows, cols), (qtype, values.shape)
        ref.add_tensor(name, np.ascontiguousarray(values))
    for w in (quant, ref):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    print(f"wrote {out_dir}/dequant_types.gguf and dequant_types_ref.gguf")


def read_safetensors(path: Path) -> dict:
    """name -> float32 array, from a safetensors file (f32 or bf16)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = np.frombuffer(data, dtype=np.uint8, count=end - start, offset=base + start)
        if info["dtype"] == "F32":
            arr = buf.view(np.float32)
        elif info["dtype"] == "BF16":
            arr = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{name}: dtype {info['dtype']} not handled")
        out[name] = arr.reshape(info["shape"])
    return out


def gguf_tensors(path: Path) -> dict:
    """GGUF name -> (ggml type, float32 array in torch order), dequantized by gguf-py."""
    reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = (t.tensor_type, values.reshape(shape))
    return out, reader


def field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def hf_to_gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # model.layers.N.<module...>.<param>
    layer, module, param = parts[2], ".".join(parts[3:-1]), parts[-1]
    modules = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
    return f"blk.{layer}.{modules[module]}.{param}"


def to_llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face row order -> llama.cpp's: within a head of d rows, row j*d/2 + i -> 2i + j."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(0, 2, 1, *range(3, w.ndim + 2)).reshape(w.shape)


def compare(gguf_path: Path, hf_dir: Path) -> int:
    tensors, reader = gguf_tensors(gguf_path)
    ours = read_safetensors(hf_dir / "model.safetensors")
    arch = field(reader, "general.architecture")
    heads = field(reader, f"{arch}.attention.head_count")
    kv_heads = field(reader, f"{arch}.attention.head_count_kv") or heads
    bf16 = json.loads((hf_dir / "config.json").read_text()).get("torch_dtype") == "bfloat16"
    worst: dict = {}
    bad = 0
    if set(map(hf_to_gguf_name, ours)) != set(tensors):
        print("tensor names differ:", sorted(set(map(hf_to_gguf_name, ours)) ^ set(tensors)))
        return 1
    for name, value in ours.items():
        qtype, want = tensors[hf_to_gguf_name(name)]
        got = value
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            got = to_llama_cpp_rows(got, heads if ".q_proj." in name else kv_heads)
        if bf16:
            want = (((want.view(np.uint32) + 0x7FFF + ((want.view(np.uint32) >> 16) & 1)) >> 16) << 16).view(np.float32)
        diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
        worst[qtype.name] = max(worst.get(qtype.name, 0.0), diff)
        if diff != 0.0:
            bad += 1
            print(f"MISMATCH {name}: max |diff| {diff:.3g}")
    for t, d in sorted(worst.items()):
        print(f"{t:>6}: max |ours - gguf-py| = {d:.3g}")
    print(f"{len(ours)} tensors compared, {bad} differ")
    return 1 if bad else 0


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_adjacent_pairs(x, theta, positions):
    """llama.cpp's normal RoPE: rotates the pairs (2i, 2i+1) of each head by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None] * freqs[None, :]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def logits(gguf_path: Path, ids: list, out: Path, top_k: int, text: str | None) -> None:
    tensors, reader = gguf_tensors(gguf_path)
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"the reference forward pass is for llama, not {arch}")
    w = {k: v[1].astype(np.float64) for k, v in tensors.items()}
    n_layers = field(reader, "llama.block_count")
    heads = field(reader, "llama.attention.head_count")
    kv_heads = field(reader, "llama.attention.head_count_kv") or heads
    eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon"))
    theta = float(field(reader, "llama.rope.freq_base") or 10000.0)
    x = w["token_embd.weight"][ids]  # [T, hidden]
    t = len(ids)
    d = x.shape[1] // heads
    pos = np.arange(t, dtype=np.float64)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for layer in range(n_layers):
        p = f"blk.{layer}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = (h @ w[p + "attn_q.weight"].T).reshape(t, heads, d)
        k = (h @ w[p + "attn_k.weight"].T).reshape(t, kv_heads, d)
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, kv_heads, d)
        q, k = rope_adjacent_pairs(q, theta, pos), rope_adjacent_pairs(k, theta, pos)
        rep = heads // kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", scores, v).reshape(t, heads * d)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    x = rms_norm(x, w["output_norm.weight"], eps)
    head = w.get("output.weight", w["token_embd.weight"])
    lg = x @ head.T
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    logprobs = lg - lse[:, None]
    positions = []
    for i in range(t):
        top = np.argsort(-logprobs[i])[:top_k]
        positions.append({"top": [[int(j), float(logprobs[i, j])] for j in top]})
    doc = {"gguf": gguf_path.name, "text": text, "ids": ids, "top_k": top_k, "positions": positions,
           "note": "numpy float64 forward pass on gguf-py's dequantization; tools/gguf_oracle.py"}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("types-fixture")
    a.add_argument("out_dir", type=Path)
    a = sub.add_parser("compare")
    a.add_argument("gguf", type=Path)
    a.add_argument("hf_dir", type=Path)
    a = sub.add_parser("logits")
    a.add_argument("gguf", type=Path)
    a.add_argument("--ids", required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--top-k", type=int, default=10)
    a.add_argument("--text", help="the text the ids encode (recorded, not tokenized here)")
    args = ap.parse_args()
    if args.cmd == "types-fixture":
        types_fixture(args.out_dir)
    elif args.cmd == "compare":
        return compare(args.gguf, args.hf_dir)
    else:
        logits(args.gguf, [int(i) for i in args.ids.split(",")], args.out, args.top_k, args.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
