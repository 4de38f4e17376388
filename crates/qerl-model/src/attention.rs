//! Grouped-query self-attention with HF rotate-half RoPE and a preallocated KV cache.

use burn::module::Module;
use burn::tensor::{activation::softmax, DType, Tensor};
use qerl_nn::{Nvfp4Linear, QerlBackend};

use crate::rope::apply_rotary;

/// What every layer of one forward pass shares: RoPE tables, the attention bias and whether the
/// LoRA adapters are applied.
pub(crate) struct Step<B: QerlBackend> {
    /// `[batch, 1, seq, head_dim]`, the backend's float type.
    pub cos: Tensor<B, 4>,
    pub sin: Tensor<B, 4>,
    /// `[batch, 1, 1, seq, keys]`, f32: 0 for visible keys, a large negative number otherwise
    /// (`keys` is the cache's capacity when there is a cache).
    pub bias: Tensor<B, 5>,
    /// Column of the cache the first new token is written to (0 without a cache).
    pub offset: usize,
    pub lora: bool,
}

/// One layer's cached keys and values, `[batch, kv_heads, capacity, head_dim]` each.
#[derive(Clone, Debug)]
pub struct LayerCache<B: QerlBackend> {
    pub(crate) k: Tensor<B, 4>,
    pub(crate) v: Tensor<B, 4>,
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
            k: Tensor::zeros(shape, device),
            v: Tensor::zeros(shape, device),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.k.dims()[2]
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
        let q = apply_rotary(
            heads(linear(&self.q_proj, x.clone(), step.lora), h),
            &step.cos,
            &step.sin,
        );
        let k = apply_rotary(
            heads(linear(&self.k_proj, x.clone(), step.lora), kv),
            &step.cos,
            &step.sin,
        );
        let v = heads(linear(&self.v_proj, x, step.lora), kv);

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
                c.k = c.k.clone().slice_assign(cols.clone(), k);
                c.v = c.v.clone().slice_assign(cols, v);
                (c.k.clone(), c.v.clone())
            }
        };
        let keys = k.dims()[2];
        let group = h / kv;
        let dtype = q.dtype();
        // [b, h, s, d] -> [b, kv, group * s, d]: the queries of one kv head side by side.
        let q = q.reshape([b, kv, group * s, d]);
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar((d as f64).powf(-0.5));
        let scores = scores.reshape([b, kv, group, s, keys]).cast(DType::F32) + step.bias.clone();
        let probs = softmax(scores, 4)
            .cast(dtype)
            .reshape([b, kv, group * s, keys]);
        let out = probs
            .matmul(v)
            .reshape([b, h, s, d])
            .swap_dims(1, 2)
            .reshape([b, s, h * d]);
        linear(&self.o_proj, out, step.lora)
    }
}
