//! `config.json` and `generation_config.json` of a Qwen2 or Llama checkpoint.
//!
//! Read keys (transformers 4 and 5 layouts):
//! `architectures` (or `model_type`), `vocab_size`, `hidden_size`, `intermediate_size`,
//! `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (default: the head count),
//! `head_dim` (default `hidden_size / num_attention_heads`), `rms_norm_eps`, `rope_theta` at the
//! top level or inside `rope_parameters` (transformers 5) / `rope_scaling`, the RoPE type
//! (`default`, `linear`, `llama3`), `max_position_embeddings`, `tie_word_embeddings`,
//! `attention_bias` and `mlp_bias` (Llama), `hidden_act` (must be `silu`),
//! `use_sliding_window` (Qwen2; must be false), `bos_token_id`, `eos_token_id` (an integer or a
//! list), `pad_token_id`.
//!
//! Errors name the file and the key.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{config_err, read_json, Result};

/// The decoder families qerl runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen2ForCausalLM`: biases on q, k and v, none on o or the MLP.
    Qwen2,
    /// `LlamaForCausalLM` (also SmolLM): biases only if `attention_bias` / `mlp_bias`.
    Llama,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
        }
    }
}

/// How RoPE frequencies are rescaled (`rope_parameters.rope_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `default`: `inv_freq[i] = theta^(-2i/head_dim)`.
    None,
    /// `linear`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `llama3`: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Upper bounds on the sizes a `config.json` may give, checked before anything is allocated
/// from them. They lie far above every released model of these architectures (a 405B Llama:
/// hidden 16384, intermediate 53248, 126 layers, 128 heads, vocabulary 128256, context 131072),
/// so a damaged or hostile file (`num_hidden_layers = 1000000000`) is refused with the field
/// named instead of ending in the allocator.
/// (`num_key_value_heads` divides `num_attention_heads`, so its limit follows.)
pub const SIZE_LIMITS: [(&str, usize); 7] = [
    ("vocab_size", 1 << 22),
    ("hidden_size", 1 << 17),
    ("intermediate_size", 1 << 19),
    ("num_hidden_layers", 1 << 10),
    ("num_attention_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("max_position_embeddings", 1 << 24),
];

/// A decoder's hyper-parameters, as read from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The file this was read from (for error messages).
    pub path: PathBuf,
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// Bias on o.
    pub o_bias: bool,
    /// Biases on gate, up and down.
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    /// Tokens that end a sequence (empty if the config names none).
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

/// Typed access to the keys of one JSON object, with errors naming the file and key.
pub(crate) struct Keys<'a> {
    pub path: &'a Path,
    pub obj: &'a Map<String, Value>,
    /// Prefix for nested objects, e.g. `rope_parameters.`.
    pub prefix: &'a str,
}

impl<'a> Keys<'a> {
    pub fn new(path: &'a Path, value: &'a Value) -> Result<Self> {
        let obj = value
            .as_object()
            .ok_or_else(|| config_err(path, "(root)", "is not a JSON object"))?;
        Ok(Keys {
            path,
            obj,
            prefix: "",
        })
    }

    fn err(&self, key: &str, why: impl Into<String>) -> crate::ModelError {
        config_err(self.path, format!("{}{key}", self.prefix), why)
    }

    /// The value of `key`, `None` if absent or `null`.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.err(key, format!("is {v}, not a non-negative integer"))),
        }
    }

    /// A required positive integer.
    pub fn positive(&self, key: &str) -> Result<usize> {
        match self.usize_opt(key)? {
            None => Err(self.err(key, "is missing")),
            Some(0) => Err(self.err(key, "is 0")),
            Some(n) => Ok(n),
        }
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("is {v}, not a number"))),
        }
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("is {v}, not true or false"))),
        }
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("is {v}, not a string"))),
        }
    }

    /// Token ids: an integer, a list of integers, or absent.
    pub fn token_ids(&self, key: &str) -> Result<Option<Vec<u32>>> {
        let bad = |v: &Value| self.err(key, format!("is {v}, not a token id or a list of them"));
        let id = |v: &Value| {
            v.as_u64()
                .filter(|&n| n <= u32::MAX as u64)
                .map(|n| n as u32)
        };
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| id(v).ok_or_else(|| bad(v)))
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => id(v).map(|n| Some(vec![n])).ok_or_else(|| bad(v)),
        }
    }

    /// A nested object, `None` if absent.
    pub fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_object()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("is {v}, not a JSON object"))),
        }
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let value = read_json(&path)?;
        Self::from_json(&value, &path)
    }

    /// Parses a `config.json` already read from `path`.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let k = Keys::new(path, value)?;
        let arch = architecture(&k)?;
        if let Some(act) = k.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(k.err(
                    "hidden_act",
                    format!("is `{act}`; only `silu` is supported"),
                ));
            }
        }
        if arch == Architecture::Qwen2 && k.bool_opt("use_sliding_window")? == Some(true) {
            return Err(k.err(
                "use_sliding_window",
                "is true; sliding-window attention is not supported",
            ));
        }
        let hidden_size = k.positive("hidden_size")?;
        let num_attention_heads = k.positive("num_attention_heads")?;
        let num_key_value_heads = match k.usize_opt("num_key_value_heads")? {
            None => num_attention_heads,
            Some(0) => return Err(k.err("num_key_value_heads", "is 0")),
            Some(n) => n,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(k.err(
                "num_key_value_heads",
                format!("is {num_key_value_heads}, which does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = match k.usize_opt("head_dim")? {
            Some(0) => return Err(k.err("head_dim", "is 0")),
            Some(d) => d,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(k.err(
                    "num_attention_heads",
                    format!("is {num_attention_heads}, which does not divide hidden_size {hidden_size} (and there is no head_dim)"),
                ))
            }
        };
        if head_dim % 2 != 0 {
            return Err(k.err(
                "head_dim",
                format!("is {head_dim}; RoPE needs an even head size"),
            ));
        }
        let (rope_theta, rope_scaling) = rope(&k)?;
        let (qkv_bias, o_bias, mlp_bias) = match arch {
            Architecture::Qwen2 => (true, false, false),
            Architecture::Llama => {
                let attn = k.bool_opt("attention_bias")?.unwrap_or(false);
                (attn, attn, k.bool_opt("mlp_bias")?.unwrap_or(false))
            }
        };
        let rms_norm_eps = k.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0 && rms_norm_eps.is_finite()) {
            return Err(k.err(
                "rms_norm_eps",
                format!("is {rms_norm_eps}, not a positive number"),
            ));
        }
        let config = ModelConfig {
            path: path.to_path_buf(),
            arch,
            vocab_size: k.positive("vocab_size")?,
            hidden_size,
            intermediate_size: k.positive("intermediate_size")?,
            num_hidden_layers: k.positive("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: k.usize_opt("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: k.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            bos_token_id: k
                .token_ids("bos_token_id")?
                .and_then(|v| v.first().copied()),
            eos_token_ids: k.token_ids("eos_token_id")?.unwrap_or_default(),
            pad_token_id: k
                .token_ids("pad_token_id")?
                .and_then(|v| v.first().copied()),
        };
        for (key, limit) in SIZE_LIMITS {
            let value = config.size(key);
            if value > limit {
                return Err(k.err(
                    key,
                    format!(
                        "is {value}, more than qerl accepts ({limit}; the largest released \
                         models are far below): is this config.json damaged?"
                    ),
                ));
            }
        }
        Ok(config)
    }

    /// The size field `key` of [`SIZE_LIMITS`].
    fn size(&self, key: &str) -> usize {
        match key {
            "vocab_size" => self.vocab_size,
            "hidden_size" => self.hidden_size,
            "intermediate_size" => self.intermediate_size,
            "num_hidden_layers" => self.num_hidden_layers,
            "num_attention_heads" => self.num_attention_heads,
            "head_dim" => self.head_dim,
            "max_position_embeddings" => self.max_position_embeddings,
            other => unreachable!("{other} is not a size of ModelConfig"),
        }
    }

    /// Output width of q_proj: `num_attention_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Output width of k_proj and v_proj: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Every decoder linear as (module suffix, d_output, d_input, has bias), in the HF layout.
    pub fn linears(&self) -> [(&'static str, usize, usize, bool); 7] {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        [
            ("self_attn.q_proj", self.q_dim(), h, self.qkv_bias),
            ("self_attn.k_proj", self.kv_dim(), h, self.qkv_bias),
            ("self_attn.v_proj", self.kv_dim(), h, self.qkv_bias),
            ("self_attn.o_proj", h, self.q_dim(), self.o_bias),
            ("mlp.gate_proj", i, h, self.mlp_bias),
            ("mlp.up_proj", i, h, self.mlp_bias),
            ("mlp.down_proj", h, i, self.mlp_bias),
        ]
    }
}

fn architecture(k: &Keys) -> Result<Architecture> {
    let supported = "qerl supports Qwen2ForCausalLM and LlamaForCausalLM";
    if let Some(archs) = k.get("architectures") {
        let first = archs
            .as_array()
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| k.err("architectures", format!("is {archs}, not a list of names")))?;
        return match first {
            "Qwen2ForCausalLM" => Ok(Architecture::Qwen2),
            "LlamaForCausalLM" => Ok(Architecture::Llama),
            other => Err(k.err("architectures", format!("names `{other}`; {supported}"))),
        };
    }
    match k.str_opt("model_type")? {
        Some("qwen2") => Ok(Architecture::Qwen2),
        Some("llama") => Ok(Architecture::Llama),
        Some(other) => Err(k.err("model_type", format!("is `{other}`; {supported}"))),
        None => Err(k.err("architectures", "is missing (and so is model_type)")),
    }
}

/// `rope_theta` and the scaling, from `rope_parameters` / `rope_scaling` or the top level.
fn rope(k: &Keys) -> Result<(f64, RopeScaling)> {
    let (nested_key, nested) = match k.object("rope_parameters")? {
        Some(obj) => ("rope_parameters", Some(obj)),
        None => ("rope_scaling", k.object("rope_scaling")?),
    };
    let prefix = format!("{nested_key}.");
    let n = nested.map(|obj| Keys {
        path: k.path,
        obj,
        prefix: &prefix,
    });
    let theta = match n
        .as_ref()
        .map(|n| n.f64_opt("rope_theta"))
        .transpose()?
        .flatten()
    {
        Some(t) => t,
        None => k.f64_opt("rope_theta")?.unwrap_or(10000.0),
    };
    if !(theta > 1.0 && theta.is_finite()) {
        return Err(k.err("rope_theta", format!("is {theta}, not a number above 1")));
    }
    let Some(n) = n else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = match n.str_opt("rope_type")? {
        Some(t) => t,
        None => n.str_opt("type")?.unwrap_or("default"),
    };
    let factor = |n: &Keys| -> Result<f64> {
        match n.f64_opt("factor")? {
            Some(f) if f > 0.0 => Ok(f),
            Some(f) => Err(n.err("factor", format!("is {f}, not positive"))),
            None => Err(n.err("factor", "is missing")),
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: factor(&n)?,
        },
        "llama3" => {
            let need = |key: &str| -> Result<f64> {
                n.f64_opt(key)?.ok_or_else(|| n.err(key, "is missing"))
            };
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if high <= low {
                return Err(n.err(
                    "high_freq_factor",
                    format!("is {high}, not above low_freq_factor {low}"),
                ));
            }
            RopeScaling::Llama3 {
                factor: factor(&n)?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: need("original_max_position_embeddings")?,
            }
        }
        other => {
            return Err(n.err(
                "rope_type",
                format!("is `{other}`; supported: default, linear, llama3"),
            ))
        }
    };
    Ok((theta, scaling))
}

/// Sampling defaults and stop tokens of `generation_config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub eos_token_ids: Option<Vec<u32>>,
    pub pad_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json`; all `None` if there is no such file.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let value = read_json(&path)?;
        let k = Keys::new(&path, &value)?;
        Ok(GenerationDefaults {
            eos_token_ids: k.token_ids("eos_token_id")?,
            pad_token_id: k
                .token_ids("pad_token_id")?
                .and_then(|v| v.first().copied()),
            do_sample: k.bool_opt("do_sample")?,
            temperature: k.f64_opt("temperature")?,
            top_p: k.f64_opt("top_p")?,
            top_k: k.usize_opt("top_k")?,
        })
    }
}

/// The stop tokens of a model directory: `generation_config.json`'s `eos_token_id` if it has
/// one, else `config.json`'s.
pub fn eos_token_ids(config: &ModelConfig, defaults: &GenerationDefaults) -> Vec<u32> {
    defaults
        .eos_token_ids
        .clone()
        .unwrap_or_else(|| config.eos_token_ids.clone())
}
