//! Causal self-attention with per-row key ranges (padding) and grouped-query heads as one
//! fused op: the `[seq, seq]` scores and weights exist neither in the forward nor, under
//! autodiff, in what the backward keeps.
//!
//! For queries `q [b, h, s, d]`, keys and values `k`, `v [b, kv, s, d]` (query head `h` reads
//! kv head `h / (heads / kv)`) and per-row visible keys `[start, end)`: query `i` of row `r`
//! sees key `j` when `start_r <= j < end_r` and `j <= i`, and
//!
//! ```text
//! out = P·V      P = exp(S − lse) on visible entries, 0 elsewhere    S = scale·Q·Kᵀ
//! ```
//!
//! with `lse [b, h, s]` (f32) the log-sum-exp of each query's visible scores. The backward
//! recomputes `P` from `lse` (`D = rowsum(dO ⊙ out)`, `dS = P ⊙ (dO·Vᵀ − D)`, `dQ = scale·dS·K`,
//! `dK = scale·dSᵀ·Q`, `dV = Pᵀ·dO`), keeping only `q`, `k`, `v`, `out` and `lse`. A query
//! that sees no key (left padding) gets a zero output and zero gradients.
//!
//! CubeCL backends run the kernels of `qerl_kernels::attention`; the default below (the CPU
//! backend) is the same computation with burn ops in f32.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use crate::backend::QerlBackend;

/// Each row's visible keys `[start, end)`.
pub type KeyRanges = Vec<(usize, usize)>;

/// `out [b, h, s, d]` of causal attention over `q [b, h, s, d]`, `k`, `v [b, kv, s, d]` with
/// `ranges[r]` the visible keys of batch row `r` and `scale` multiplying `q·kᵀ` (see the module
/// docs). Under `Autodiff<B>` the gradient reaches `q`, `k` and `v` through the fused backward.
pub fn causal_attention<B: QerlBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    ranges: &[(usize, usize)],
    scale: f32,
) -> Tensor<B, 4> {
    let [b, h, s, d] = q.dims();
    let [bk, kv, sk, dk] = k.dims();
    assert!(
        bk == b && sk == s && dk == d && v.dims() == k.dims(),
        "causal_attention: q {:?}, k {:?}, v {:?}",
        q.dims(),
        k.dims(),
        v.dims()
    );
    assert!(
        kv > 0 && h % kv == 0,
        "causal_attention: {h} heads over {kv} kv heads"
    );
    assert_eq!(
        ranges.len(),
        b,
        "causal_attention: {} key ranges for {b} rows",
        ranges.len()
    );
    Tensor::from_primitive(TensorPrimitive::Float(B::causal_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        ranges,
        scale,
    )))
}

/// Each row's key range if its mask `[batch, keys]` (row-major) is one run of visible keys
/// within the first `seq` columns (right or left padding of a batch starting at column 0);
/// `None` otherwise (holes, or visible keys past `seq`).
pub fn key_ranges(key_mask: &[bool], batch: usize, keys: usize, seq: usize) -> Option<KeyRanges> {
    assert_eq!(
        key_mask.len(),
        batch * keys,
        "key_ranges: mask of {batch} x {keys}"
    );
    key_mask
        .chunks_exact(keys.max(1))
        .map(|row| {
            let start = row.iter().position(|&m| m).unwrap_or(0);
            let end = row.iter().rposition(|&m| m).map_or(start, |e| e + 1);
            let contiguous = row[start..end].iter().all(|&m| m);
            (contiguous && end <= seq).then_some((start, end))
        })
        .collect()
}

fn t4<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn t3<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// `[ranges.len(), s, s]` row-major: `visible` where query `i` of row `r` sees key `j`
/// (`start_r <= j < end_r` and `j <= i`, see the module docs), `hidden` elsewhere. Public so
/// that an unfused attention (a benchmark's baseline) masks exactly as the fused one does.
pub fn causal_mask(ranges: &[(usize, usize)], s: usize, visible: f32, hidden: f32) -> Vec<f32> {
    let mut mask = vec![hidden; ranges.len() * s * s];
    for (r, &(start, end)) in ranges.iter().enumerate() {
        for i in 0..s {
            for j in start..end.min(i + 1) {
                mask[(r * s + i) * s + j] = visible;
            }
        }
    }
    mask
}

/// `(bias, visible)` `[b, 1, 1, s, s]` f32: 0 / `-1e30` and 1 / 0 per (query, key).
fn masks<B: Backend>(
    ranges: &[(usize, usize)],
    s: usize,
    device: &B::Device,
) -> (Tensor<B, 5>, Tensor<B, 5>) {
    let b = ranges.len();
    let vis = causal_mask(ranges, s, 1.0, 0.0);
    let vis =
        Tensor::<B, 5>::from_data(TensorData::new(vis, [b, 1, 1, s, s]), (device, DType::F32));
    let bias = (vis.clone() - 1.0).mul_scalar(1.0e30);
    (bias, vis)
}

/// `P [b, kv, g, s, s]` (f32) and, when `lse` is not given, the log-sum-exps `[b, kv, g, s, 1]`.
fn weights<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    ranges: &[(usize, usize)],
    scale: f32,
    lse: Option<Tensor<B, 5>>,
) -> (Tensor<B, 5>, Tensor<B, 5>) {
    let [b, h, s, d] = q.dims();
    let kv = k.dims()[1];
    let g = h / kv;
    let (bias, vis) = masks::<B>(ranges, s, &q.device());
    let scores = q
        .cast(DType::F32)
        .reshape([b, kv, g * s, d])
        .matmul(k.cast(DType::F32).swap_dims(2, 3))
        .mul_scalar(scale)
        .reshape([b, kv, g, s, s])
        + bias;
    let lse = lse.unwrap_or_else(|| {
        let max = scores.clone().max_dim(4);
        max.clone() + (scores.clone() - max).exp().sum_dim(4).log()
    });
    ((scores - lse.clone()).exp() * vis, lse)
}

/// The default [`QerlBackend::attention_forward`]: burn ops in f32, `(out, lse [b, h, s])`.
pub(crate) fn forward_prim<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    ranges: &[(usize, usize)],
    scale: f32,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = (t4::<B>(q), t4::<B>(k), t4::<B>(v));
    let [b, h, s, d] = q.dims();
    let kv = k.dims()[1];
    let dtype = q.dtype();
    let (p, lse) = weights(q, k, ranges, scale, None);
    let out = p
        .reshape([b, kv, h / kv * s, s])
        .matmul(v.cast(DType::F32))
        .reshape([b, h, s, d])
        .cast(dtype);
    (
        out.into_primitive().tensor(),
        lse.reshape([b, h, s]).into_primitive().tensor(),
    )
}

/// The default [`QerlBackend::attention_backward`]: `(dq, dk, dv)` with burn ops in f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_prim<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
    ranges: &[(usize, usize)],
    scale: f32,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (q, k, v) = (t4::<B>(q), t4::<B>(k), t4::<B>(v));
    let (out, d_out, lse) = (t4::<B>(out), t4::<B>(d_out), t3::<B>(lse));
    let [b, h, s, d] = q.dims();
    let kv = k.dims()[1];
    let g = h / kv;
    let dtype = q.dtype();
    let f = |t: Tensor<B, 4>| t.cast(DType::F32);
    let lse = lse.reshape([b, kv, g, s, 1]);
    let (p, _) = weights(q.clone(), k.clone(), ranges, scale, Some(lse));
    let d_out = f(d_out);
    let dvec = (d_out.clone() * f(out))
        .sum_dim(3)
        .reshape([b, kv, g, s, 1]);
    let d_out = d_out.reshape([b, kv, g * s, d]);
    let dp = d_out
        .clone()
        .matmul(f(v).swap_dims(2, 3))
        .reshape([b, kv, g, s, s]);
    let ds = (p.clone() * (dp - dvec)).reshape([b, kv, g * s, s]);
    let p = p.reshape([b, kv, g * s, s]);
    let dq = ds
        .clone()
        .matmul(f(k))
        .mul_scalar(scale)
        .reshape([b, h, s, d]);
    let dk = ds
        .swap_dims(2, 3)
        .matmul(f(q).reshape([b, kv, g * s, d]))
        .mul_scalar(scale);
    let dv = p.swap_dims(2, 3).matmul(d_out);
    let prim = |t: Tensor<B, 4>| t.cast(dtype).into_primitive().tensor();
    (prim(dq), prim(dk), prim(dv))
}

/// What the backward keeps: the inputs (alive anyway as the projections' outputs), the output
/// and the log-sum-exps.
#[derive(Clone, Debug)]
struct AttentionState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    ranges: KeyRanges,
    scale: f32,
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: QerlBackend> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let (dq, dk, dv) =
            B::attention_backward(s.q, s.k, s.v, s.out, s.lse, d_out, &s.ranges, s.scale);
        let [pq, pk, pv] = ops.parents;
        for (node, grad) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The [`QerlBackend::causal_attention`] of `Autodiff<B, C>`: `B`'s fused forward, and its
/// fused backward recorded with parents `q`, `k`, `v`.
pub(crate) fn autodiff_attention<B: QerlBackend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    ranges: &[(usize, usize)],
    scale: f32,
) -> FloatTensor<Autodiff<B, C>> {
    match AttentionBackward
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, lse) = B::attention_forward(
                q.primitive.clone(),
                k.primitive.clone(),
                v.primitive.clone(),
                ranges,
                scale,
            );
            let state = AttentionState::<B> {
                q: q.primitive,
                k: k.primitive,
                v: v.primitive,
                out: out.clone(),
                lse,
                ranges: ranges.to_vec(),
                scale,
            };
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep
            .finish(B::attention_forward(q.primitive, k.primitive, v.primitive, ranges, scale).0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ranges_of_right_left_and_holed_masks() {
        let (t, f) = (true, false);
        assert_eq!(
            key_ranges(&[t, t, f, f, f, t, t, t], 2, 4, 4),
            Some(vec![(0, 2), (1, 4)])
        );
        assert_eq!(key_ranges(&[t, f, t, f], 1, 4, 4), None);
        // a cache wider than the prompt: visible keys within the prompt's columns only
        assert_eq!(key_ranges(&[f, t, f, f], 1, 4, 2), Some(vec![(1, 2)]));
        assert_eq!(key_ranges(&[f, t, t, f], 1, 4, 2), None);
    }

    #[test]
    fn causal_mask_is_causal_within_each_rows_key_range() {
        // row 0 sees keys 0..2, row 1 (left padded) keys 1..3
        let m = causal_mask(&[(0, 2), (1, 3)], 3, 1.0, 0.0);
        #[rustfmt::skip]
        let want = [
            1.0, 0.0, 0.0,
            1.0, 1.0, 0.0,
            1.0, 1.0, 0.0,
            //
            0.0, 0.0, 0.0,
            0.0, 1.0, 0.0,
            0.0, 1.0, 1.0,
        ];
        assert_eq!(m, want);
    }
}
