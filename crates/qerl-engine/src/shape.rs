//! The shape of a decoder the engine runs: what it needs of a model's config, and the
//! Qwen2.5 presets the rollout benchmark builds with random weights.

use crate::EngineError;

/// Sizes and constants of a Qwen2/Llama decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub name: String,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Biases on q/k/v (Qwen2), on o, on the MLP.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// The lm_head is the embedding matrix.
    pub tied_embeddings: bool,
    pub rms_eps: f32,
    /// RoPE frequencies, `head_dim / 2` of them.
    pub inv_freq: Vec<f32>,
    /// Longest context the model supports (positions of the RoPE tables).
    pub max_positions: usize,
}

impl ModelShape {
    /// A Qwen2.5 shape by name: `qwen2.5-0.5b`, `-1.5b`, `-7b`, `-14b`, `-32b`.
    pub fn preset(name: &str) -> Result<Self, EngineError> {
        // (hidden, intermediate, layers, q heads, kv heads, vocab, tied)
        let (hidden, intermediate, layers, q_heads, kv_heads, vocab, tied) = match name {
            "qwen2.5-0.5b" => (896, 4864, 24, 14, 2, 151_936, true),
            "qwen2.5-1.5b" => (1536, 8960, 28, 12, 2, 151_936, true),
            "qwen2.5-7b" => (3584, 18_944, 28, 28, 4, 152_064, false),
            "qwen2.5-14b" => (5120, 13_824, 48, 40, 8, 152_064, false),
            "qwen2.5-32b" => (5120, 27_648, 64, 40, 8, 152_064, false),
            other => {
                return Err(EngineError::Shape(format!(
                    "unknown shape `{other}`: one of qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, \
                     qwen2.5-14b, qwen2.5-32b"
                )))
            }
        };
        let head_dim = hidden / q_heads;
        let theta = 1_000_000f32;
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Ok(ModelShape {
            name: name.to_string(),
            vocab,
            hidden,
            intermediate,
            layers,
            q_heads,
            kv_heads,
            head_dim,
            qkv_bias: true,
            o_bias: false,
            mlp_bias: false,
            tied_embeddings: tied,
            rms_eps: 1e-6,
            inv_freq,
            max_positions: 32_768,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.q_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Checks what the kernels assume: heads divide, a head size that is a multiple of 8 and at most 256, every
    /// product's reduction a multiple of 32 (the 4-bit kernels read 32-element chunks).
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |what: String| Err(EngineError::Shape(format!("{}: {what}", self.name)));
        if self.q_heads == 0 || self.kv_heads == 0 || !self.q_heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} key-value heads",
                self.q_heads, self.kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(8) || self.head_dim > 256 {
            return bad(format!(
                "head size {} (must be a multiple of 8, at most 256)",
                self.head_dim
            ));
        }
        if self.inv_freq.len() != self.head_dim / 2 {
            return bad(format!(
                "{} RoPE frequencies for head size {}",
                self.inv_freq.len(),
                self.head_dim
            ));
        }
        for (what, k) in [
            ("hidden size", self.hidden),
            ("intermediate size", self.intermediate),
            ("q width", self.q_dim()),
        ] {
            if k == 0 || !k.is_multiple_of(32) {
                return bad(format!("{what} {k} is not a multiple of 32"));
            }
        }
        Ok(())
    }

    /// Frozen parameters of the decoder layers (the 4-bit part), lm_head and embedding aside.
    pub fn layer_params(&self) -> usize {
        let (h, i) = (self.hidden, self.intermediate);
        self.layers * (h * self.q_dim() * 2 + 2 * h * self.kv_dim() + 3 * h * i)
    }

    /// Bytes of KV cache per token (all layers, keys and values, `elem` bytes an element).
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        2 * self.layers * self.kv_dim() * elem
    }
}
