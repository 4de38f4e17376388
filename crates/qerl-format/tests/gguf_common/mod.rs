//! A GGUF writer for tests (from the specification's layout) and a tiny synthetic Llama model
//! with a byte-level BPE vocabulary, written with it.
#![allow(dead_code)]

use half::{bf16, f16};

/// Builds a GGUF image in memory.
pub struct GgufBuilder {
    pub version: u32,
    pub alignment: u64,
    kv: Vec<u8>,
    kv_count: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Default for GgufBuilder {
    fn default() -> Self {
        GgufBuilder {
            version: 3,
            alignment: 32,
            kv: Vec::new(),
            kv_count: 0,
            tensors: Vec::new(),
        }
    }
}

impl GgufBuilder {
    fn key(&mut self, key: &str, ty: u32) -> &mut Vec<u8> {
        self.kv_count += 1;
        string(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        &mut self.kv
    }

    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.key(key, 4).extend(v.to_le_bytes());
        self
    }

    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.key(key, 6).extend(v.to_le_bytes());
        self
    }

    pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.key(key, 7).push(v as u8);
        self
    }

    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        let out = self.key(key, 8);
        string(out, v);
        self
    }

    pub fn strings(&mut self, key: &str, items: &[String]) -> &mut Self {
        let out = self.key(key, 9);
        out.extend(8u32.to_le_bytes());
        out.extend((items.len() as u64).to_le_bytes());
        for s in items {
            string(out, s);
        }
        self
    }

    pub fn i32s(&mut self, key: &str, items: &[i32]) -> &mut Self {
        let out = self.key(key, 9);
        out.extend(5u32.to_le_bytes());
        out.extend((items.len() as u64).to_le_bytes());
        for v in items {
            out.extend(v.to_le_bytes());
        }
        self
    }

    /// A tensor with ggml dims (innermost first), type code and raw data.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
        }
        let pad = |out: &mut Vec<u8>| {
            let to = (out.len() as u64).next_multiple_of(self.alignment) as usize;
            out.resize(to, 0);
        };
        pad(&mut out);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            pad(&mut out);
        }
        out
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
        .collect()
}

/// Q8_0 blocks of `values` (a multiple of 32): scale absmax / 127 as f16, codes rounded.
pub fn q8_0_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0);
        out.extend(d.to_le_bytes());
        let inv = if d.to_f32() > 0.0 {
            1.0 / d.to_f32()
        } else {
            0.0
        };
        out.extend(
            block
                .iter()
                .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    out
}

/// Q4_1 blocks of `values` (a multiple of 32): min and (max - min) / 15 as f16.
pub fn q4_1_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in values.chunks(32) {
        let min = block.iter().fold(f32::MAX, |m, &v| m.min(v));
        let max = block.iter().fold(f32::MIN, |m, &v| m.max(v));
        let d = f16::from_f32((max - min) / 15.0);
        let m = f16::from_f32(min);
        out.extend(d.to_le_bytes());
        out.extend(m.to_le_bytes());
        let inv = if d.to_f32() > 0.0 {
            1.0 / d.to_f32()
        } else {
            0.0
        };
        let code = |v: f32| ((v - m.to_f32()) * inv).round().clamp(0.0, 15.0) as u8;
        for j in 0..16 {
            out.push(code(block[j]) | (code(block[j + 16]) << 4));
        }
    }
    out
}

/// GPT-2's byte -> printable character map of byte-level BPE.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// Dimensions of the tiny model.
pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 16;
pub const INTER: usize = 96;
pub const LAYERS: usize = 2;

/// The tiny model's vocabulary: 3 control tokens, the 256 byte characters, and the products of
/// `MERGES`.
pub fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![3; 3];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(1);
    }
    let g = byte_char(b' ');
    let merges: Vec<String> = vec![
        "h e".into(),
        "l l".into(),
        "he ll".into(),
        format!("{g} w"),
        "o r".into(),
    ];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types, merges)
}

/// Deterministic pseudo-random values in [-scale, scale).
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// llama.cpp's RoPE row permutation of a `[heads * d, cols]` matrix (HF rows -> GGUF rows).
pub fn permute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let d = w.len() / cols / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..d / 2 {
                let src = (h * d + j * d / 2 + i) * cols;
                let dst = (h * d + 2 * i + j) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// The tiny Llama GGUF, and layer 0's q and k weights in Hugging Face row order (stored
/// permuted, as F32, so the un-permutation can be checked exactly).
pub fn tiny_llama() -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    tiny_model("llama")
}

/// The tiny model as `llama` (SmolLM pre-tokenizer, q/k rows permuted, no biases) or `qwen2`
/// (Qwen2 pre-tokenizer, rows as they are, q/k/v biases).
pub fn tiny_model(arch: &str) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let (tokens, types, merges) = vocab();
    let vocab_size = tokens.len();
    let qwen = arch == "qwen2";
    let key = |k: &str| format!("{arch}.{k}");
    let mut b = GgufBuilder::default();
    b.str("general.architecture", arch)
        .str("general.name", "tiny")
        .u32(&key("block_count"), LAYERS as u32)
        .u32(&key("context_length"), 256)
        .u32(&key("embedding_length"), HIDDEN as u32)
        .u32(&key("feed_forward_length"), INTER as u32)
        .u32(&key("attention.head_count"), HEADS as u32)
        .u32(&key("attention.head_count_kv"), KV_HEADS as u32)
        .f32(&key("rope.freq_base"), 10000.0)
        .f32(&key("attention.layer_norm_rms_epsilon"), 1e-5)
        .u32(&key("rope.dimension_count"), HEAD_DIM as u32)
        .u32(&key("vocab_size"), vocab_size as u32)
        .str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", if qwen { "qwen2" } else { "smollm" })
        .strings("tokenizer.ggml.tokens", &tokens)
        .i32s("tokenizer.ggml.token_type", &types)
        .strings("tokenizer.ggml.merges", &merges)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .u32("tokenizer.ggml.padding_token_id", 2)
        .bool("tokenizer.ggml.add_bos_token", false)
        .str(
            "tokenizer.chat_template",
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}",
        );
    let (h, q, kv) = (
        HIDDEN as u64,
        (HEADS * HEAD_DIM) as u64,
        (KV_HEADS * HEAD_DIM) as u64,
    );
    let n = |a: u64, b: u64| (a * b) as usize;
    b.tensor(
        "token_embd.weight",
        &[h, vocab_size as u64],
        8,
        q8_0_bytes(&values(1, n(h, vocab_size as u64), 0.5)),
    );
    b.tensor("output_norm.weight", &[h], 0, f32_bytes(&vec![1.0; HIDDEN]));
    let q0 = values(10, n(q, h), 0.3);
    let k0 = values(11, n(kv, h), 0.3);
    for l in 0..LAYERS {
        let p = format!("blk.{l}.");
        let s = 100 * (l as u64 + 1);
        b.tensor(
            &format!("{p}attn_norm.weight"),
            &[h],
            0,
            f32_bytes(&vec![1.0; HIDDEN]),
        );
        b.tensor(
            &format!("{p}ffn_norm.weight"),
            &[h],
            0,
            f32_bytes(&vec![1.0; HIDDEN]),
        );
        if qwen {
            for (m, rows) in [("q", q), ("k", kv), ("v", kv)] {
                let bias = values(s + 7, rows as usize, 0.1);
                b.tensor(&format!("{p}attn_{m}.bias"), &[rows], 0, f32_bytes(&bias));
            }
        }
        if l == 0 {
            let (qp, kp) = if qwen {
                (q0.clone(), k0.clone())
            } else {
                (
                    permute_rows(&q0, HEADS, HIDDEN),
                    permute_rows(&k0, KV_HEADS, HIDDEN),
                )
            };
            b.tensor(&format!("{p}attn_q.weight"), &[h, q], 0, f32_bytes(&qp));
            b.tensor(&format!("{p}attn_k.weight"), &[h, kv], 0, f32_bytes(&kp));
        } else {
            b.tensor(
                &format!("{p}attn_q.weight"),
                &[h, q],
                3,
                q4_1_bytes(&values(s, n(h, q), 0.3)),
            );
            b.tensor(
                &format!("{p}attn_k.weight"),
                &[h, kv],
                8,
                q8_0_bytes(&values(s + 1, n(h, kv), 0.3)),
            );
        }
        b.tensor(
            &format!("{p}attn_v.weight"),
            &[h, kv],
            1,
            f16_bytes(&values(s + 2, n(h, kv), 0.3)),
        );
        b.tensor(
            &format!("{p}attn_output.weight"),
            &[q, h],
            30,
            bf16_bytes(&values(s + 3, n(q, h), 0.3)),
        );
        b.tensor(
            &format!("{p}ffn_gate.weight"),
            &[h, INTER as u64],
            3,
            q4_1_bytes(&values(s + 4, n(h, INTER as u64), 0.3)),
        );
        b.tensor(
            &format!("{p}ffn_up.weight"),
            &[h, INTER as u64],
            8,
            q8_0_bytes(&values(s + 5, n(h, INTER as u64), 0.3)),
        );
        b.tensor(
            &format!("{p}ffn_down.weight"),
            &[INTER as u64, h],
            3,
            q4_1_bytes(&values(s + 6, n(INTER as u64, h), 0.3)),
        );
    }
    (b.build(), q0, k0)
}
