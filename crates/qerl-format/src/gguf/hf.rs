//! From llama.cpp's names and metadata to Hugging Face's: the `config.json` of a Llama or Qwen2
//! model and the name of every tensor.
//!
//! | GGUF | Hugging Face |
//! | --- | --- |
//! | `token_embd.weight` | `model.embed_tokens.weight` |
//! | `output_norm.weight` | `model.norm.weight` |
//! | `output.weight` (absent when tied) | `lm_head.weight` |
//! | `blk.N.attn_norm.weight` | `model.layers.N.input_layernorm.weight` |
//! | `blk.N.ffn_norm.weight` | `model.layers.N.post_attention_layernorm.weight` |
//! | `blk.N.attn_{q,k,v}.{weight,bias}` | `model.layers.N.self_attn.{q,k,v}_proj.*` |
//! | `blk.N.attn_output.{weight,bias}` | `model.layers.N.self_attn.o_proj.*` |
//! | `blk.N.ffn_{gate,up,down}.{weight,bias}` | `model.layers.N.mlp.{gate,up,down}_proj.*` |
//!
//! llama.cpp's converter permutes the rows of a Llama model's q and k projections so that its
//! RoPE, which rotates adjacent pairs `(2i, 2i+1)`, gives what Hugging Face's `rotate_half`
//! (pairs `(i, i + d/2)`) gives on the original rows: within each head of `d` rows, original
//! row `j*d/2 + i` (`j` in 0..2) is stored at row `2i + j`. [`unpermute_rope_rows`] puts them
//! back. Qwen2 uses the `rotate_half` pairing in llama.cpp too and is stored unpermuted.

use serde_json::{json, Map, Value};

use super::error::{GgufError, Result};
use super::metadata::Metadata;
use super::reader::GgufFile;

/// The architectures the importer maps (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Qwen2,
}

impl GgufArch {
    pub fn key_prefix(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Qwen2 => "qwen2",
        }
    }

    pub fn hf_class(self) -> &'static str {
        match self {
            GgufArch::Llama => "LlamaForCausalLM",
            GgufArch::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// The hyper-parameters read from the metadata (and the embedding's shape).
#[derive(Clone, Debug, PartialEq)]
pub struct HfHyper {
    pub arch: GgufArch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `rope_scaling` of `config.json` (`null` or a linear scaling).
    pub rope_scaling: Value,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
}

/// Reads `general.architecture`.
pub fn architecture(meta: &Metadata) -> Result<GgufArch> {
    match meta.str_opt("general.architecture")? {
        Some("llama") => Ok(GgufArch::Llama),
        Some("qwen2") => Ok(GgufArch::Qwen2),
        Some(other) => Err(meta.err(
            "general.architecture",
            format!("is `{other}`; qerl converts `llama` and `qwen2`"),
        )),
        None => Err(meta.err("general.architecture", "is missing")),
    }
}

fn tensor_err(file: &GgufFile, tensor: &str, why: impl Into<String>) -> GgufError {
    GgufError::Tensor {
        path: file.path().to_path_buf(),
        tensor: tensor.to_string(),
        why: why.into(),
    }
}

/// The hyper-parameters of `file`, cross-checked with the embedding's shape.
pub fn hyper(file: &GgufFile) -> Result<HfHyper> {
    let meta = &file.metadata;
    let arch = architecture(meta)?;
    let key = |k: &str| format!("{}.{k}", arch.key_prefix());
    let hidden_size = meta.positive(&key("embedding_length"))?;
    let num_attention_heads = meta.positive(&key("attention.head_count"))?;
    let num_key_value_heads = meta
        .usize_opt(&key("attention.head_count_kv"))?
        .unwrap_or(num_attention_heads);
    if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
        return Err(meta.err(
            &key("attention.head_count_kv"),
            format!("is {num_key_value_heads}, which does not divide the head count {num_attention_heads}"),
        ));
    }
    let head_dim = match meta.usize_opt(&key("attention.key_length"))? {
        Some(d) => d,
        None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
        None => {
            return Err(meta.err(
                &key("attention.head_count"),
                format!(
                "is {num_attention_heads}, which does not divide embedding_length {hidden_size}"
            ),
            ))
        }
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(meta.err(
            &key("attention.key_length"),
            format!("gives a head size of {head_dim}, not a positive even number"),
        ));
    }
    if let Some(rot) = meta.usize_opt(&key("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(meta.err(
                &key("rope.dimension_count"),
                format!("is {rot}, not the head size {head_dim}: partial rotary embeddings are not supported"),
            ));
        }
    }
    let embed = file
        .tensor("token_embd.weight")
        .ok_or_else(|| tensor_err(file, "token_embd.weight", "is missing"))?;
    let [width, rows] = embed.dims[..] else {
        return Err(tensor_err(
            file,
            "token_embd.weight",
            format!("has dims {:?}, not 2", embed.dims),
        ));
    };
    if width != hidden_size as u64 {
        return Err(tensor_err(
            file,
            "token_embd.weight",
            format!("is {width} wide, but embedding_length is {hidden_size}"),
        ));
    }
    let vocab_size = rows as usize;
    if let Some(v) = meta.usize_opt(&key("vocab_size"))? {
        if v != vocab_size {
            return Err(meta.err(
                &key("vocab_size"),
                format!("is {v}, but token_embd.weight has {vocab_size} rows"),
            ));
        }
    }
    let rms_norm_eps = meta
        .f64_opt(&key("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-6);
    if !(rms_norm_eps > 0.0 && rms_norm_eps.is_finite()) {
        return Err(meta.err(
            &key("attention.layer_norm_rms_epsilon"),
            format!("is {rms_norm_eps}, not a positive number"),
        ));
    }
    let rope_theta = meta.f64_opt(&key("rope.freq_base"))?.unwrap_or(10000.0);
    if !(rope_theta > 1.0 && rope_theta.is_finite()) {
        return Err(meta.err(
            &key("rope.freq_base"),
            format!("is {rope_theta}, not a number above 1"),
        ));
    }
    let rope_scaling = rope_scaling(meta, &key("rope.scaling.type"), &key("rope.scaling.factor"))?;
    if file.tensor("rope_freqs.weight").is_some() {
        return Err(tensor_err(
            file,
            "rope_freqs.weight",
            "holds per-frequency RoPE factors (Llama 3.1 scaling), which cannot be expressed as a config.json rope_scaling here; not supported",
        ));
    }
    Ok(HfHyper {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: meta.positive(&key("feed_forward_length"))?,
        num_hidden_layers: meta.positive(&key("block_count"))?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        max_position_embeddings: meta.usize_opt(&key("context_length"))?.unwrap_or(4096),
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        attention_bias: file.tensor("blk.0.attn_q.bias").is_some(),
    })
}

fn rope_scaling(meta: &Metadata, type_key: &str, factor_key: &str) -> Result<Value> {
    match meta.str_opt(type_key)? {
        None | Some("none") => Ok(Value::Null),
        Some("linear") => match meta.f64_opt(factor_key)? {
            Some(f) if f > 0.0 && f.is_finite() => Ok(json!({"rope_type": "linear", "factor": f})),
            Some(f) => Err(meta.err(factor_key, format!("is {f}, not a positive number"))),
            None => Err(meta.err(factor_key, "is missing (the scaling type is linear)")),
        },
        Some(other) => Err(meta.err(
            type_key,
            format!("is `{other}`; only none and linear are supported"),
        )),
    }
}

/// The Hugging Face name of a GGUF tensor, `None` if the importer has no place for it.
pub fn hf_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, param) = rest.rsplit_once('.')?;
    if !matches!(param, "weight" | "bias") {
        return None;
    }
    let hf_module = match module {
        "attn_norm" if param == "weight" => "input_layernorm",
        "ffn_norm" if param == "weight" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_module}.{param}"))
}

/// Every Hugging Face tensor the model needs, with its torch shape.
pub fn expected_tensors(h: &HfHyper) -> Vec<(String, Vec<usize>)> {
    let (hid, inter) = (h.hidden_size, h.intermediate_size);
    let (q, kv) = (
        h.num_attention_heads * h.head_dim,
        h.num_key_value_heads * h.head_dim,
    );
    let mut out = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![h.vocab_size, hid],
        ),
        ("model.norm.weight".to_string(), vec![hid]),
    ];
    if !h.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![h.vocab_size, hid]));
    }
    for l in 0..h.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![hid]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![hid]));
        for (m, rows, cols) in [("q", q, hid), ("k", kv, hid), ("v", kv, hid)] {
            out.push((format!("{p}.self_attn.{m}_proj.weight"), vec![rows, cols]));
            if h.attention_bias {
                out.push((format!("{p}.self_attn.{m}_proj.bias"), vec![rows]));
            }
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![hid, q]));
        if h.attention_bias && h.arch == GgufArch::Llama {
            out.push((format!("{p}.self_attn.o_proj.bias"), vec![hid]));
        }
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, hid]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![inter, hid]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![hid, inter]));
    }
    out
}

/// How many heads a tensor's rows must be un-permuted over (`None`: keep the rows as stored).
pub fn rope_heads(h: &HfHyper, hf_name: &str) -> Option<usize> {
    if h.arch != GgufArch::Llama {
        return None;
    }
    if hf_name.contains(".self_attn.q_proj.") {
        Some(h.num_attention_heads)
    } else if hf_name.contains(".self_attn.k_proj.") {
        Some(h.num_key_value_heads)
    } else {
        None
    }
}

/// Undoes llama.cpp's RoPE row permutation of a q or k weight (`[heads * d, cols]`, row-major)
/// or bias (`cols = 1`): row `2i + j` of each head goes back to row `j*d/2 + i`.
pub fn unpermute_rope_rows(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = values.len() / cols;
    let d = rows / heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let from = (h * d + 2 * i + j) * cols;
                let to = (h * d + j * d / 2 + i) * cols;
                out[to..to + cols].copy_from_slice(&values[from..from + cols]);
            }
        }
    }
    out
}

/// `config.json` as transformers would write it for this model.
pub fn config_json(h: &HfHyper, tokens: &super::tokenizer::SpecialIds, torch_dtype: &str) -> Value {
    let mut c = Map::new();
    c.insert("architectures".into(), json!([h.arch.hf_class()]));
    c.insert("attention_dropout".into(), json!(0.0));
    if h.arch == GgufArch::Llama {
        c.insert("attention_bias".into(), json!(h.attention_bias));
        c.insert("mlp_bias".into(), json!(false));
        c.insert("pretraining_tp".into(), json!(1));
    }
    let id = |v: Option<u32>| v.map_or(Value::Null, |v| json!(v));
    c.insert("bos_token_id".into(), id(tokens.bos));
    c.insert("eos_token_id".into(), id(tokens.eos));
    if let Some(pad) = tokens.pad {
        c.insert("pad_token_id".into(), json!(pad));
    }
    c.insert("head_dim".into(), json!(h.head_dim));
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("hidden_size".into(), json!(h.hidden_size));
    c.insert("initializer_range".into(), json!(0.02));
    c.insert("intermediate_size".into(), json!(h.intermediate_size));
    c.insert(
        "max_position_embeddings".into(),
        json!(h.max_position_embeddings),
    );
    c.insert("model_type".into(), json!(h.arch.key_prefix()));
    c.insert("num_attention_heads".into(), json!(h.num_attention_heads));
    c.insert("num_hidden_layers".into(), json!(h.num_hidden_layers));
    c.insert("num_key_value_heads".into(), json!(h.num_key_value_heads));
    c.insert("rms_norm_eps".into(), json!(h.rms_norm_eps));
    c.insert("rope_scaling".into(), h.rope_scaling.clone());
    c.insert("rope_theta".into(), json!(h.rope_theta));
    if h.arch == GgufArch::Qwen2 {
        c.insert("use_sliding_window".into(), json!(false));
        c.insert("sliding_window".into(), Value::Null);
        c.insert("max_window_layers".into(), json!(h.num_hidden_layers));
    }
    c.insert("tie_word_embeddings".into(), json!(h.tie_word_embeddings));
    c.insert("torch_dtype".into(), json!(torch_dtype));
    c.insert("use_cache".into(), json!(true));
    c.insert("vocab_size".into(), json!(h.vocab_size));
    Value::Object(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_of_a_layer() {
        assert_eq!(
            hf_name("blk.12.attn_output.weight").unwrap(),
            "model.layers.12.self_attn.o_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.attn_q.bias").unwrap(),
            "model.layers.0.self_attn.q_proj.bias"
        );
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight").unwrap(),
            "model.layers.3.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert!(hf_name("blk.x.attn_q.weight").is_none());
        assert!(hf_name("blk.0.attn_norm.bias").is_none());
        assert!(hf_name("rope_freqs.weight").is_none());
    }

    /// llama.cpp's permutation: `w.reshape(heads, 2, d/2, cols).swapaxes(1, 2)`; undoing it
    /// must give back the original rows.
    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        let (heads, d, cols) = (3, 8, 2);
        let original: Vec<f32> = (0..heads * d * cols).map(|x| x as f32).collect();
        let mut permuted = vec![0f32; original.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..d / 2 {
                    let src = (h * d + j * d / 2 + i) * cols;
                    let dst = (h * d + i * 2 + j) * cols;
                    permuted[dst..dst + cols].copy_from_slice(&original[src..src + cols]);
                }
            }
        }
        assert_ne!(permuted, original);
        assert_eq!(unpermute_rope_rows(&permuted, heads, cols), original);
    }
}
