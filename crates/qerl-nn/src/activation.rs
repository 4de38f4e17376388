//! [`silu_mul`]: the SwiGLU gate `silu(g) ⊙ u` of a Qwen2/Llama MLP as one op with its own
//! backward.
//!
//! burn's `silu(g) * u` is about ten element-wise kernels forward, several of them on f32
//! copies of the `[tokens, intermediate]` tensor (its `sigmoid` upcasts), and its autodiff keeps
//! those copies for the backward. On CubeCL backends this op is one kernel each way
//! (`qerl_kernels::silu_mul`), computing in f32 and rounding once; under `Autodiff<B>` it keeps
//! only `g` and `u`. With `s = σ(g)`: `dg = dh ⊙ u ⊙ s ⊙ (1 + g·(1 − s))`, `du = dh ⊙ g ⊙ s`.
//!
//! `QERL_SILU_MUL=burn` (read once) runs burn's ops instead, for A/B measurements.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::QerlBackend;

/// Whether `QERL_SILU_MUL=burn` asks for burn's unfused ops.
fn unfused() -> bool {
    static UNFUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNFUSED.get_or_init(|| std::env::var("QERL_SILU_MUL").is_ok_and(|v| v == "burn"))
}

/// `silu(gate) ⊙ up` for two tensors of one shape `[.., d]` -> `[.., d]`.
pub fn silu_mul<B: QerlBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    let dims = gate.dims();
    assert_eq!(dims, up.dims(), "silu_mul: gate and up shapes");
    if unfused() {
        return silu(gate) * up;
    }
    let d = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let (g, u) = (gate.reshape([rows, d]), up.reshape([rows, d]));
    let h = B::silu_mul(g.into_primitive().tensor(), u.into_primitive().tensor());
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(h)).reshape(dims)
}

fn f2<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// The default [`QerlBackend::silu_mul`]: burn's ops.
pub(crate) fn burn_forward<B: Backend>(g: FloatTensor<B>, u: FloatTensor<B>) -> FloatTensor<B> {
    (silu(f2::<B>(g)) * f2::<B>(u)).into_primitive().tensor()
}

/// The default [`QerlBackend::silu_mul_backward`]: burn's ops.
pub(crate) fn burn_backward<B: Backend>(
    g: FloatTensor<B>,
    u: FloatTensor<B>,
    dh: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (g, u, dh) = (f2::<B>(g), f2::<B>(u), f2::<B>(dh));
    let s = sigmoid(g.clone());
    let gs = g * s.clone();
    // dsilu = s + g·s·(1 − s) = s + gs − gs·s
    let dsilu = s.clone() + gs.clone() - gs.clone() * s;
    let dg = dh.clone() * u * dsilu;
    let du = dh * gs;
    (dg.into_primitive().tensor(), du.into_primitive().tensor())
}

#[derive(Debug)]
struct SiluMulBackward;

impl<B: QerlBackend> Backward<B, 2> for SiluMulBackward {
    /// `g` and `u`, the forward's inputs.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dh = grads.consume::<B>(&ops.node);
        let (g, u) = ops.state;
        let (dg, du) = B::silu_mul_backward(g, u, dh);
        let [pg, pu] = ops.parents;
        if let Some(node) = pg {
            grads.register::<B>(node.id, dg);
        }
        if let Some(node) = pu {
            grads.register::<B>(node.id, du);
        }
    }
}

/// The [`QerlBackend::silu_mul`] of `Autodiff<B, C>`: `B`'s forward, the backward above.
pub(crate) fn autodiff_silu_mul<B: QerlBackend, C: CheckpointStrategy>(
    g: FloatTensor<Autodiff<B, C>>,
    u: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    match SiluMulBackward
        .prepare::<C>([g.node.clone(), u.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let h = B::silu_mul(g.primitive.clone(), u.primitive.clone());
            prep.finish((g.primitive, u.primitive), h)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::silu_mul(g.primitive, u.primitive)),
    }
}
