//! [`QerlBackend`] for `Autodiff<B>`: custom backward passes.
//!
//! * `qlinear`: parents `x` and, with LoRA, `A` and `B`. The frozen weight (and bias) is state,
//!   never a parent, so it gets no gradient. With `G = dY`, `T = x·Aᵀ`, `s` the LoRA scale:
//!   `dx = G·deq(W) + s·(G·B)·A` (the first term through the transposed 4-bit kernel),
//!   `dA = s·(G·B)ᵀ·x`, `dB = s·Gᵀ·T`.
//! * `dense_matmul` (`C = α·op(A)·op(B)`): parents `A` and `B`, whose gradients are dense
//!   products again (cuBLAS on CUDA, so a BF16 model's frozen products are not autotuned).
//! * `noisy_rms_norm`: parents `x` and `w`; the noise is a constant.
//! * `causal_attention`: parents `q`, `k`, `v`; the backward recomputes the attention weights
//!   from the kept log-sum-exps ([`crate::attention`]).
//! * `lm_head_log_probs`: parents `hidden` and the output projection; chunked, the backward
//!   recomputes each chunk's logits ([`crate::lm_head`]).
//! * `silu_mul`: parents `g` and `u`, kept for the backward ([`crate::activation`]).
//! * `rope_heads`: parent `x`; the tables are constants ([`crate::rope`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use qerl_format::QuantizedWeight;

use crate::backend::{LoraPrims, QerlBackend};
use crate::NnError;

type Inner<B> = FloatTensor<B>;

fn t2<B: QerlBackend>(p: Inner<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn prim<B: QerlBackend>(t: Tensor<B, 2>) -> Inner<B> {
    t.into_primitive().tensor()
}

#[derive(Debug)]
struct QLinearBackward;

impl<B: QerlBackend> Backward<B, 1> for QLinearBackward {
    type State = B::QWeight;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(x)] = ops.parents {
            grads.register::<B>(x.id, B::qlinear_dx(grad, &ops.state));
        }
    }
}

#[derive(Debug)]
struct QLinearLoraBackward;

/// What the LoRA backward needs: the weight, `x`, `A`, `B`, the scale.
#[derive(Clone, Debug)]
struct LoraState<B: QerlBackend> {
    weight: B::QWeight,
    x: Inner<B>,
    a: Inner<B>,
    b: Inner<B>,
    scale: f32,
}

impl<B: QerlBackend> Backward<B, 3> for QLinearLoraBackward {
    type State = LoraState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        let LoraState {
            weight,
            x,
            a,
            b,
            scale,
        } = ops.state;
        let [px, pa, pb] = ops.parents;
        let want = [px.is_some(), pa.is_some(), pb.is_some()];
        let lora = LoraPrims { a, b, scale };
        let [dx_lora, da, db] = B::lora_backward(g.clone(), x, lora, want);
        if let (Some(node), Some(dx_lora)) = (px, dx_lora) {
            let dx = t2::<B>(B::qlinear_dx(g, &weight)) + t2::<B>(dx_lora);
            grads.register::<B>(node.id, prim(dx));
        }
        if let (Some(node), Some(da)) = (pa, da) {
            grads.register::<B>(node.id, da);
        }
        if let (Some(node), Some(db)) = (pb, db) {
            grads.register::<B>(node.id, db);
        }
    }
}

#[derive(Debug)]
struct DenseMatmulBackward;

/// `C = α·op(A)·op(B)`: the operands (as stored) and how they are read.
#[derive(Clone, Debug)]
struct DenseState<B: QerlBackend> {
    a: Inner<B>,
    a_t: bool,
    b: Inner<B>,
    b_t: bool,
    alpha: f32,
}

impl<B: QerlBackend> Backward<B, 2> for DenseMatmulBackward {
    type State = DenseState<B>;

    /// With `G = dC [m, n]`: `d op(A) = α·G·op(B)ᵀ` and `d op(B) = α·op(A)ᵀ·G`, each transposed
    /// back where the operand is stored transposed.
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        let DenseState {
            a,
            a_t,
            b,
            b_t,
            alpha,
        } = ops.state;
        let [pa, pb] = ops.parents;
        if let Some(node) = pa {
            let da = if a_t {
                B::dense_matmul(b.clone(), b_t, g.clone(), true, alpha) // op(B)·Gᵀ [k, m]
            } else {
                B::dense_matmul(g.clone(), false, b, !b_t, alpha) // G·op(B)ᵀ [m, k]
            };
            grads.register::<B>(node.id, da);
        }
        if let Some(node) = pb {
            let db = if b_t {
                B::dense_matmul(g, true, a, a_t, alpha) // Gᵀ·op(A) [n, k]
            } else {
                B::dense_matmul(a, !a_t, g, false, alpha) // op(A)ᵀ·G [k, n]
            };
            grads.register::<B>(node.id, db);
        }
    }
}

#[derive(Debug)]
struct NormBackward;

#[derive(Clone, Debug)]
struct NormState<B: QerlBackend> {
    x: Inner<B>,
    w: Inner<B>,
    z: Option<Inner<B>>,
    rstd: Inner<B>,
}

impl<B: QerlBackend> Backward<B, 2> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let NormState { x, w, z, rstd } = ops.state;
        let (dx, dw) = B::noisy_rms_norm_backward(dy, x, w, z, rstd);
        let [px, pw] = ops.parents;
        if let Some(node) = px {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = pw {
            grads.register::<B>(node.id, dw);
        }
    }
}

type Ad<B, C> = Autodiff<B, C>;

impl<B: QerlBackend, C: CheckpointStrategy> QerlBackend for Ad<B, C> {
    type QWeight = B::QWeight;

    fn memory_usage(device: &Self::Device) -> Option<(u64, u64)> {
        B::memory_usage(device)
    }

    fn qweight_upload(
        name: &str,
        weight: &QuantizedWeight,
        device: &Self::Device,
    ) -> Result<B::QWeight, NnError> {
        B::qweight_upload(name, weight, device)
    }

    fn float_upload(
        name: &str,
        data: TensorData,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, NnError> {
        Ok(<Self as AutodiffBackend>::from_inner(B::float_upload(
            name, data, device,
        )?))
    }

    fn qweight_dequantize(weight: &B::QWeight, device: &Self::Device) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::qweight_dequantize(weight, device))
    }

    fn qlinear(
        x: FloatTensor<Self>,
        weight: &B::QWeight,
        bias: Option<FloatTensor<Self>>,
        lora: Option<LoraPrims<Self>>,
    ) -> FloatTensor<Self> {
        let bias = bias.map(|b| b.primitive);
        match lora {
            None => match QLinearBackward
                .prepare::<C>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let y = B::qlinear(x.primitive, weight, bias, None);
                    prep.finish(weight.clone(), y)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(B::qlinear(x.primitive, weight, bias, None))
                }
            },
            Some(l) => {
                let scale = l.scale;
                let run = |x: Inner<B>, a: Inner<B>, b: Inner<B>| {
                    B::qlinear(x, weight, bias.clone(), Some(LoraPrims { a, b, scale }))
                };
                match QLinearLoraBackward
                    .prepare::<C>([x.node.clone(), l.a.node.clone(), l.b.node.clone()])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => {
                        let state = LoraState::<B> {
                            weight: weight.clone(),
                            x: x.primitive.clone(),
                            a: l.a.primitive.clone(),
                            b: l.b.primitive.clone(),
                            scale: l.scale,
                        };
                        prep.finish(state, run(x.primitive, l.a.primitive, l.b.primitive))
                    }
                    OpsKind::UnTracked(prep) => {
                        prep.finish(run(x.primitive, l.a.primitive, l.b.primitive))
                    }
                }
            }
        }
    }

    fn dense_matmul(
        a: FloatTensor<Self>,
        a_t: bool,
        b: FloatTensor<Self>,
        b_t: bool,
        alpha: f32,
    ) -> FloatTensor<Self> {
        match DenseMatmulBackward
            .prepare::<C>([a.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = DenseState::<B> {
                    a: a.primitive.clone(),
                    a_t,
                    b: b.primitive.clone(),
                    b_t,
                    alpha,
                };
                prep.finish(
                    state,
                    B::dense_matmul(a.primitive, a_t, b.primitive, b_t, alpha),
                )
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::dense_matmul(a.primitive, a_t, b.primitive, b_t, alpha))
            }
        }
    }

    fn qlinear_dx(dy: FloatTensor<Self>, weight: &B::QWeight) -> FloatTensor<Self> {
        // Only reached when differentiating twice; the product itself is not tracked.
        <Self as AutodiffBackend>::from_inner(B::qlinear_dx(dy.primitive, weight))
    }

    fn noisy_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        z: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let z = z.map(|z| z.primitive);
        let prep = NormBackward
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful();
        let (y, rstd) = B::noisy_rms_norm(x.primitive.clone(), w.primitive.clone(), z.clone(), eps);
        let rstd_out = <Self as AutodiffBackend>::from_inner(rstd.clone());
        let y = match prep {
            OpsKind::Tracked(prep) => {
                let state = NormState::<B> {
                    x: x.primitive,
                    w: w.primitive,
                    z,
                    rstd,
                };
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        (y, rstd_out)
    }

    fn lm_head_log_probs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: crate::LogProbOptions,
    ) -> FloatTensor<Self> {
        crate::lm_head::autodiff_log_probs::<B, C>(hidden, weight, targets, opts)
    }

    fn rope_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: crate::RopeShape,
    ) -> FloatTensor<Self> {
        crate::rope::autodiff_rope::<B, C>(x, cos, sin, shape)
    }

    fn silu_mul(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::activation::autodiff_silu_mul::<B, C>(g, u)
    }

    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        ranges: &[(usize, usize)],
        scale: f32,
    ) -> FloatTensor<Self> {
        crate::attention::autodiff_attention::<B, C>(q, k, v, ranges, scale)
    }

    fn noisy_rms_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        z: Option<FloatTensor<Self>>,
        rstd: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw) = B::noisy_rms_norm_backward(
            dy.primitive,
            x.primitive,
            w.primitive,
            z.map(|z| z.primitive),
            rstd.primitive,
        );
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }
}
