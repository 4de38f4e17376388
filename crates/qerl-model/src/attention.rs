//! Grouped-query self-attention with HF rotate-half RoPE and a preallocated KV cache.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{activation::softmax, Bool, DType, Tensor, TensorData};
use qerl_nn::{Nvfp4Linear, QerlBackend};

use crate::batch::MASKED;
use crate::rope::apply_rotary;

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
