//! The decoder: embeddings, `num_hidden_layers` x (RMSNorm, attention, RMSNorm, SwiGLU MLP),
//! final RMSNorm, lm_head (or the tied embedding matrix). One struct serves Qwen2 and Llama;
//! they differ only in which linears have biases (see [`ModelConfig::linears`]).

use burn::module::{Module, Param};
use burn::tensor::{Int, Tensor, TensorData};
use qerl_nn::{silu_mul, NoisyRmsNorm, Nvfp4Linear, QerlBackend};

use crate::attention::{attention_bias, Attention, LayerCache, Masking, Step};
use crate::batch::TokenBatch;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::rope::Rope;

/// `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: QerlBackend> {
    pub gate_proj: Nvfp4Linear<B>,
    pub up_proj: Nvfp4Linear<B>,
    pub down_proj: Nvfp4Linear<B>,
}

impl<B: QerlBackend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 3>, lora: bool) -> Tensor<B, 3> {
        if lora {
            let g = self.gate_proj.forward(x.clone());
            self.down_proj.forward(silu_mul(g, self.up_proj.forward(x)))
        } else {
            let g = self.gate_proj.forward_without_lora(x.clone());
            let h = silu_mul(g, self.up_proj.forward_without_lora(x));
            self.down_proj.forward_without_lora(h)
        }
    }
}

/// Pre-norm residual block: `h = x + attn(norm1(x))`, `out = h + mlp(norm2(h))`.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: QerlBackend> {
    pub input_layernorm: NoisyRmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: NoisyRmsNorm<B>,
    pub mlp: Mlp<B>,
}

impl<B: QerlBackend> DecoderLayer<B> {
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        step: &Step<B>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let h = x.clone()
            + self
                .self_attn
                .forward(self.input_layernorm.forward(x), step, cache);
        h.clone()
            + self
                .mlp
                .forward(self.post_attention_layernorm.forward(h), step.lora)
    }
}

/// A causal language model (`Qwen2ForCausalLM` or `LlamaForCausalLM`).
///
/// The embeddings and lm_head are dense and frozen; every decoder linear is an
/// [`Nvfp4Linear`] (NVFP4, another 4-bit format, or dense, with optional LoRA) and every norm a
/// [`NoisyRmsNorm`]. Build one with [`crate::load`].
#[derive(Module, Debug)]
pub struct CausalLm<B: QerlBackend> {
    /// `[vocab, hidden]`.
    pub embed_tokens: Param<Tensor<B, 2>>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: NoisyRmsNorm<B>,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    #[module(skip)]
    pub config: ModelConfig,
    #[module(skip)]
    rope: Rope,
}

/// Keys and values of every layer for a batch being decoded, plus the host-side state that
/// goes with them: which cache columns hold real tokens and each row's next RoPE position.
#[derive(Clone, Debug)]
pub struct KvCache<B: QerlBackend> {
    layers: Vec<LayerCache<B>>,
    /// `[batch, capacity]`, row-major.
    key_mask: Vec<bool>,
    next_position: Vec<usize>,
    len: usize,
    batch: usize,
}

impl<B: QerlBackend> KvCache<B> {
    /// Columns filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::capacity)
    }

    pub fn batch(&self) -> usize {
        self.batch
    }
}

impl<B: QerlBackend> CausalLm<B> {
    pub(crate) fn from_parts(
        embed_tokens: Tensor<B, 2>,
        layers: Vec<DecoderLayer<B>>,
        norm: NoisyRmsNorm<B>,
        lm_head: Option<Tensor<B, 2>>,
        config: ModelConfig,
    ) -> Self {
        let frozen = |t| Param::from_tensor(t).set_require_grad(false);
        CausalLm {
            embed_tokens: frozen(embed_tokens),
            layers,
            norm,
            lm_head: lm_head.map(frozen),
            rope: Rope::new(&config),
            config,
        }
    }

    /// The decoder linear named like its checkpoint module, e.g.
    /// `model.layers.3.self_attn.q_proj`.
    pub fn linear_mut(&mut self, module: &str) -> Option<&mut Nvfp4Linear<B>> {
        let (i, suffix) = module.strip_prefix("model.layers.")?.split_once('.')?;
        let layer = self.layers.get_mut(i.parse::<usize>().ok()?)?;
        Some(match suffix {
            "self_attn.q_proj" => &mut layer.self_attn.q_proj,
            "self_attn.k_proj" => &mut layer.self_attn.k_proj,
            "self_attn.v_proj" => &mut layer.self_attn.v_proj,
            "self_attn.o_proj" => &mut layer.self_attn.o_proj,
            "mlp.gate_proj" => &mut layer.mlp.gate_proj,
            "mlp.up_proj" => &mut layer.mlp.up_proj,
            "mlp.down_proj" => &mut layer.mlp.down_proj,
            _ => return None,
        })
    }

    /// Every RMSNorm (two per layer, then the final one), for setting AQN noise.
    pub fn norms_mut(&mut self) -> Vec<&mut NoisyRmsNorm<B>> {
        let mut out = Vec::with_capacity(2 * self.layers.len() + 1);
        for layer in &mut self.layers {
            out.push(&mut layer.input_layernorm);
            out.push(&mut layer.post_attention_layernorm);
        }
        out.push(&mut self.norm);
        out
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn device(&self) -> B::Device {
        self.embed_tokens.device()
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(ModelError::Input(format!(
                "token id {t} is outside the model's vocabulary (vocab_size {vocab} in `{}`)",
                self.config.path.display()
            ))),
            None => Ok(()),
        }
    }

    /// `ids [batch, seq] -> [batch, seq, hidden]`.
    pub(crate) fn embed(&self, ids: &[u32], batch: usize, seq: usize) -> Tensor<B, 3> {
        let device = self.device();
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [batch * seq]), &device);
        let hidden = self.config.hidden_size;
        self.embed_tokens
            .val()
            .select(0, ids)
            .reshape([batch, seq, hidden])
    }

    /// The shared inputs of one pass: `seq` new tokens per row written at column `offset`,
    /// attending to `keys` columns (`key_mask`, `[batch, keys]`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        &self,
        positions: &[usize],
        key_mask: &[bool],
        batch: usize,
        seq: usize,
        keys: usize,
        offset: usize,
        lora: bool,
    ) -> Step<B> {
        let device = self.device();
        let (cos, sin) = self.rope.tables(positions, batch, seq, &device);
        let masking = match crate::attention::fused_ranges(key_mask, batch, seq, keys, offset) {
            Some(ranges) => Masking::Fused(ranges),
            None => Masking::Bias(attention_bias(key_mask, batch, seq, keys, offset, &device)),
        };
        Step {
            cos,
            sin,
            masking,
            offset,
            lora,
        }
    }

    /// Final hidden states `[batch, seq, hidden]` (after the last norm).
    fn run(
        &self,
        x: Tensor<B, 3>,
        step: &Step<B>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let mut x = x;
        for (i, layer) in self.layers.iter().enumerate() {
            let c = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(x, step, c);
        }
        self.norm.forward(x)
    }

    /// `hidden [.., hidden] -> logits [.., vocab]` with lm_head or the tied embeddings.
    pub fn logits<const D: usize>(&self, hidden: Tensor<B, D>) -> Tensor<B, D> {
        let w = match &self.lm_head {
            Some(w) => w.val(),
            None => self.embed_tokens.val(),
        };
        let mut dims = hidden.dims();
        let rows = dims[..D - 1].iter().product::<usize>();
        let flat: Tensor<B, 2> = hidden.reshape([rows, self.config.hidden_size]);
        dims[D - 1] = self.config.vocab_size;
        flat.matmul(w.transpose()).reshape(dims)
    }

    /// Final hidden states `[batch, len, hidden]` of a padded batch, LoRA applied or not.
    pub fn hidden_states(&self, batch: &TokenBatch, lora: bool) -> Result<Tensor<B, 3>> {
        self.check_ids(&batch.ids)?;
        let (b, s) = (batch.batch, batch.len);
        let step = self.step(&batch.positions(), &batch.mask, b, s, s, 0, lora);
        Ok(self.run(self.embed(&batch.ids, batch.batch, batch.len), &step, None))
    }

    /// Logits `[batch, len, vocab]` of every position of a padded batch (the training and
    /// scoring pass; no cache). Positions of padding hold meaningless values.
    pub fn forward(&self, batch: &TokenBatch) -> Result<Tensor<B, 3>> {
        Ok(self.logits(self.hidden_states(batch, true)?))
    }

    /// [`forward`](Self::forward) with every LoRA adapter disabled: the frozen base model (the
    /// reference policy of a KL penalty).
    pub fn forward_base(&self, batch: &TokenBatch) -> Result<Tensor<B, 3>> {
        Ok(self.logits(self.hidden_states(batch, false)?))
    }

    /// An empty cache for `batch` sequences of up to `capacity` tokens (prompt + new tokens).
    pub fn new_cache(&self, batch: usize, capacity: usize) -> KvCache<B> {
        let c = &self.config;
        let device = self.device();
        KvCache {
            layers: (0..c.num_hidden_layers)
                .map(|_| {
                    LayerCache::new(batch, c.num_key_value_heads, capacity, c.head_dim, &device)
                })
                .collect(),
            key_mask: vec![false; batch * capacity],
            next_position: vec![0; batch],
            len: 0,
            batch,
        }
    }

    /// Runs a left-padded prompt batch into an empty `cache`; returns the logits of the last
    /// column, `[batch, vocab]`, the distribution of each sequence's first new token.
    pub fn prefill(&self, batch: &TokenBatch, cache: &mut KvCache<B>) -> Result<Tensor<B, 2>> {
        self.check_ids(&batch.ids)?;
        if cache.batch != batch.batch || !cache.is_empty() || batch.len > cache.capacity() {
            return Err(ModelError::Input(format!(
                "prefill of {} x {} tokens into a cache of {} x {} holding {} columns",
                batch.batch,
                batch.len,
                cache.batch,
                cache.capacity(),
                cache.len
            )));
        }
        let cap = cache.capacity();
        for (row, mask) in batch.mask.chunks_exact(batch.len).enumerate() {
            cache.key_mask[row * cap..row * cap + batch.len].copy_from_slice(mask);
        }
        let positions = batch.positions();
        cache.next_position = batch.lengths();
        cache.len = batch.len;
        let step = self.step(
            &positions,
            &cache.key_mask,
            batch.batch,
            batch.len,
            cap,
            0,
            true,
        );
        let x = self.embed(&batch.ids, batch.batch, batch.len);
        let hidden = self.run(x, &step, Some(cache));
        let [b, s, h] = hidden.dims();
        Ok(self.logits(hidden.slice([0..b, s - 1..s, 0..h]).reshape([b, h])))
    }

    /// Feeds one new token per sequence (`ids`, `[batch]`); returns the next logits
    /// `[batch, vocab]`.
    pub fn decode(&self, ids: &[u32], cache: &mut KvCache<B>) -> Result<Tensor<B, 2>> {
        self.check_ids(ids)?;
        if ids.len() != cache.batch || cache.len >= cache.capacity() {
            return Err(ModelError::Input(format!(
                "decode of {} tokens into a cache of batch {} with {}/{} columns used",
                ids.len(),
                cache.batch,
                cache.len,
                cache.capacity()
            )));
        }
        let cap = cache.capacity();
        for row in 0..cache.batch {
            cache.key_mask[row * cap + cache.len] = true;
        }
        let positions = cache.next_position.clone();
        let offset = cache.len;
        cache.len += 1;
        for p in &mut cache.next_position {
            *p += 1;
        }
        let step = self.step(
            &positions,
            &cache.key_mask,
            cache.batch,
            1,
            cap,
            offset,
            true,
        );
        let x = self.embed(ids, cache.batch, 1);
        let hidden = self.run(x, &step, Some(cache));
        let [b, _, h] = hidden.dims();
        Ok(self.logits(hidden.reshape([b, h])))
    }
}
