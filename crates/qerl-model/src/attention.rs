//! Grouped-query self-attention with HF rotate-half RoPE and a preallocated KV cache.
//!
//! A pass that starts at position 0 with keys masked by one run per row (the training forward
//! and a prefill, right or left padded) runs the fused kernel ([`qerl_nn::causal_attention`]):
//! no `[batch, kv, group, seq, seq]` scores or probabilities, in the forward or kept for the
//! backward. Other passes (decode steps over the cache) and every pass under
//! `QERL_ATTENTION=decomposed` ([`set_attention_path`]) build the scores with matmuls and an
//! f32 bias: the reference the fused path is tested against.

use std::sync::atomic::{AtomicU8, Ordering};

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{activation::softmax, Bool, DType, Tensor, TensorData};
use qerl_nn::{causal_attention, key_ranges, rope_heads, KeyRanges, Nvfp4Linear, QerlBackend};

use crate::batch::MASKED;

/// The attention bias `[batch, 1, 1, seq, keys]` (f32) built on the device from the key mask
/// (`[batch, keys]`, host): query `i` sits at column `offset + i` and sees key `j` when
/// `j <= offset + i` and `key_mask[j]`; [`MASKED`] elsewhere. Only the key mask travels to the
/// device. Equals [`crate::batch::attention_bias`].
pub(crate) fn attention_bias<B: Backend>(
    key_mask: &[bool],
    batch: usize,
    seq: usize,
    keys: usize,
    offset: usize,
    device: &B::Device,
) -> Tensor<B, 5> {
    let shape = [batch, seq, keys];
    let future = Tensor::<B, 2, Bool>::tril_mask([seq, keys], offset as i64, device);
    let future = future.unsqueeze_dim::<3>(0).expand(shape);
    let real =
        Tensor::<B, 2, Bool>::from_data(TensorData::new(key_mask.to_vec(), [batch, keys]), device);
    let padding = real.bool_not().unsqueeze_dim::<3>(1).expand(shape);
    Tensor::<B, 3>::zeros(shape, (device, DType::F32))
        .mask_fill(future.bool_or(padding), MASKED)
        .reshape([batch, 1, 1, seq, keys])
}

/// How attention is computed where the fused kernel applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// The fused op (flash-attention style kernels on CubeCL backends).
    Fused,
    /// Scores and probabilities with matmuls and an f32 bias (the reference).
    Decomposed,
}

/// 0: not chosen yet (read `QERL_ATTENTION`), 1: fused, 2: decomposed.
static ATTENTION_PATH: AtomicU8 = AtomicU8::new(0);

/// The path in use: [`set_attention_path`]'s, else `QERL_ATTENTION` (`fused`, the default, or
/// `decomposed`), read once.
pub fn attention_path() -> AttentionPath {
    match ATTENTION_PATH.load(Ordering::Relaxed) {
        1 => AttentionPath::Fused,
        2 => AttentionPath::Decomposed,
        _ => {
            let path = match std::env::var("QERL_ATTENTION").as_deref() {
                Ok("decomposed") => AttentionPath::Decomposed,
                Ok("fused") | Err(_) => AttentionPath::Fused,
                Ok(other) => {
                    eprintln!("warning: QERL_ATTENTION={other} is neither fused nor decomposed; using fused");
                    AttentionPath::Fused
                }
            };
            set_attention_path(path);
            path
        }
    }
}

/// Chooses the attention path for the rest of the process (tests compare the two).
pub fn set_attention_path(path: AttentionPath) {
    let code = match path {
        AttentionPath::Fused => 1,
        AttentionPath::Decomposed => 2,
    };
    ATTENTION_PATH.store(code, Ordering::Relaxed);
}

/// Each row's visible keys when the fused path applies to `seq` new tokens written at column
/// `offset` over a key mask `[batch, keys]`: from position 0, one run of keys per row within the
/// new tokens, and the fused path chosen.
pub(crate) fn fused_ranges(
    key_mask: &[bool],
    batch: usize,
    seq: usize,
    keys: usize,
    offset: usize,
) -> Option<KeyRanges> {
    if offset != 0 || attention_path() != AttentionPath::Fused {
        return None;
    }
    key_ranges(key_mask, batch, keys, seq)
}

/// What every layer of one forward pass shares: RoPE tables, how attention is masked and
/// whether the LoRA adapters are applied.
pub(crate) struct Step<B: QerlBackend> {
    /// `[batch, 1, seq, head_dim]`, the backend's float type.
    pub cos: Tensor<B, 4>,
    pub sin: Tensor<B, 4>,
    pub masking: Masking<B>,
    /// Column of the cache the first new token is written to (0 without a cache).
    pub offset: usize,
    pub lora: bool,
}

/// How a pass masks attention.
pub(crate) enum Masking<B: QerlBackend> {
    /// Each row's visible keys `[start, end)` among the new tokens, for the fused attention
    /// ([`fused_ranges`]).
    Fused(KeyRanges),
    /// `[batch, 1, 1, seq, keys]`, f32: 0 for visible keys, a large negative number otherwise
    /// (`keys` is the cache's capacity when there is a cache), for the decomposed attention.
    /// Only built here: at 8 sequences of 8,192 tokens it would be 2.1 GB.
    Bias(Tensor<B, 5>),
}

/// One layer's cached keys and values, `[batch, kv_heads, capacity, head_dim]` each (held in
/// an `Option` only so that a step can move them out and write them in place).
#[derive(Clone, Debug)]
pub struct LayerCache<B: QerlBackend> {
    k: Option<Tensor<B, 4>>,
    v: Option<Tensor<B, 4>>,
    capacity: usize,
}

impl<B: QerlBackend> LayerCache<B> {
    pub(crate) fn new(
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        head_dim: usize,
        device: &B::Device,
    ) -> Self {
        let shape = [batch, kv_heads, capacity, head_dim];
        LayerCache {
            k: Some(Tensor::zeros(shape, device)),
            v: Some(Tensor::zeros(shape, device)),
            capacity,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

/// `softmax(q·kᵀ / sqrt(head_dim) + bias) · v` with `num_attention_heads` query heads sharing
/// `num_key_value_heads` key/value heads (query head `h` reads kv head `h / group`, as
/// transformers' `repeat_kv` orders them).
#[derive(Module, Debug)]
pub struct Attention<B: QerlBackend> {
    pub q_proj: Nvfp4Linear<B>,
    pub k_proj: Nvfp4Linear<B>,
    pub v_proj: Nvfp4Linear<B>,
    pub o_proj: Nvfp4Linear<B>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

fn linear<B: QerlBackend>(layer: &Nvfp4Linear<B>, x: Tensor<B, 3>, lora: bool) -> Tensor<B, 3> {
    if lora {
        layer.forward(x)
    } else {
        layer.forward_without_lora(x)
    }
}

impl<B: QerlBackend> Attention<B> {
    /// `x [batch, seq, hidden] -> [batch, seq, hidden]`. With a cache, the new keys and values
    /// are written at columns `offset..offset + seq` and the queries attend to every column of
    /// the cache, the bias masking the ones not filled yet: the shapes of a decode step do not
    /// change from step to step, so the kernels are compiled and autotuned once.
    pub(crate) fn forward(
        &self,
        x: Tensor<B, 3>,
        step: &Step<B>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let heads = |t: Tensor<B, 3>, n: usize| t.reshape([b, s, n, d]).swap_dims(1, 2);
        let q = rope_heads(
            linear(&self.q_proj, x.clone(), step.lora),
            &step.cos,
            &step.sin,
            h,
        );
        let k = rope_heads(
            linear(&self.k_proj, x.clone(), step.lora),
            &step.cos,
            &step.sin,
            kv,
        );
        let v = heads(linear(&self.v_proj, x, step.lora), kv);

        // The new keys and values (the fused path attends to these only: with a cache, the
        // columns past them are masked anyway).
        let (k_new, v_new) = (k.clone(), v.clone());
        let (k, v) = match cache {
            None => (k, v),
            Some(c) => {
                let end = step.offset + s;
                assert!(
                    end <= c.capacity(),
                    "KV cache full: {end} > {}",
                    c.capacity()
                );
                let cols = [0..b, 0..kv, step.offset..end, 0..d];
                // Moved out, so that `slice_assign` can write in place (a second reference to
                // the cache would make it copy the whole tensor every step).
                let k =
                    c.k.take()
                        .expect("cache keys")
                        .slice_assign(cols.clone(), k);
                let v = c.v.take().expect("cache values").slice_assign(cols, v);
                c.k = Some(k.clone());
                c.v = Some(v.clone());
                (k, v)
            }
        };
        let scale = (d as f64).powf(-0.5);
        let out = match &step.masking {
            Masking::Fused(ranges) => causal_attention(q, k_new, v_new, ranges, scale as f32),
            Masking::Bias(bias) => decomposed(q, k, v, bias, scale),
        };
        let out = out.swap_dims(1, 2).reshape([b, s, h * d]);
        linear(&self.o_proj, out, step.lora)
    }
}

/// `softmax(q·kᵀ·scale + bias)·v` with matmuls: `q [b, h, s, d]`, `k`, `v [b, kv, keys, d]`,
/// `bias [b, 1, 1, s, keys]` (f32) -> `[b, h, s, d]`. Scores and probabilities
/// `[b, kv, h / kv, s, keys]` exist in f32 and in the float type.
fn decomposed<B: QerlBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    bias: &Tensor<B, 5>,
    scale: f64,
) -> Tensor<B, 4> {
    let [b, h, s, d] = q.dims();
    let [_, kv, keys, _] = k.dims();
    let group = h / kv;
    let dtype = q.dtype();
    // [b, h, s, d] -> [b, kv, group * s, d]: the queries of one kv head side by side.
    let q = q.reshape([b, kv, group * s, d]);
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let scores = scores.reshape([b, kv, group, s, keys]).cast(DType::F32) + bias.clone();
    let probs = softmax(scores, 4)
        .cast(dtype)
        .reshape([b, kv, group * s, keys]);
    probs.matmul(v).reshape([b, h, s, d])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn device_bias_equals_host_bias() {
        let dev = Default::default();
        let mut rng = crate::sampling::Rng::new(3);
        for (batch, seq, keys, offset) in [(2, 3, 3, 0), (3, 1, 8, 5), (2, 4, 10, 2), (1, 5, 5, 0)]
        {
            let mask: Vec<bool> = (0..batch * keys).map(|_| rng.next_open01() < 0.7).collect();
            let host = crate::batch::attention_bias(&mask, batch, seq, keys, offset);
            let device: Vec<f32> = attention_bias::<NdArray>(&mask, batch, seq, keys, offset, &dev)
                .into_data()
                .iter::<f32>()
                .collect();
            assert_eq!(device, host, "{batch} {seq} {keys} {offset}");
        }
    }
}
