//! [`rope_heads`]: rotary position embedding of a q or k product's output, with its heads moved
//! to the front for attention, as one op with its own backward.
//!
//! Hugging Face's "rotate half" convention: a head vector `x` of size `d`, `x1 = x[..d/2]`,
//! `x2 = x[d/2..]`, tables `c`, `s` of its token: `rope(x) = x ⊙ c + (−x2 ++ x1) ⊙ s`. The
//! backward is the transpose: `dx = dy ⊙ c + rotᵀ(dy ⊙ s)` with `rotᵀ(v) = (v2 ++ −v1)`.
//! On CubeCL backends each way is one kernel (`qerl_kernels::rope`) that also does the move
//! between `[tokens, heads·d]` and `[batch, heads, seq, d]`; burn's ops (the default, and
//! `QERL_ROPE=burn` for A/B measurements) take a slice, a negation, a concatenation, two
//! products, a sum and a copy.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
pub use qerl_kernels::rope::RopeShape;

use crate::backend::QerlBackend;

/// Whether `QERL_ROPE=burn` asks for burn's ops.
fn unfused() -> bool {
    static UNFUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNFUSED.get_or_init(|| std::env::var("QERL_ROPE").is_ok_and(|v| v == "burn"))
}

/// `x [batch, seq, heads·d]` (a product's output) -> `[batch, heads, seq, d]` with RoPE applied,
/// for the tables `cos`, `sin` `[batch, 1, seq, d]` (the float type of `x`).
pub fn rope_heads<B: QerlBackend>(
    x: Tensor<B, 3>,
    cos: &Tensor<B, 4>,
    sin: &Tensor<B, 4>,
    heads: usize,
) -> Tensor<B, 4> {
    let [batch, seq, width] = x.dims();
    let d = width / heads;
    assert_eq!(
        d * heads,
        width,
        "rope_heads: {width} columns for {heads} heads"
    );
    assert_eq!(
        cos.dims(),
        [batch, 1, seq, d],
        "rope_heads: cos table shape"
    );
    assert_eq!(
        sin.dims(),
        [batch, 1, seq, d],
        "rope_heads: sin table shape"
    );
    let shape = RopeShape {
        batch,
        seq,
        heads,
        head_dim: d,
    };
    let table = |t: &Tensor<B, 4>| {
        t.clone()
            .reshape([batch * seq, d])
            .into_primitive()
            .tensor()
    };
    let x = x.reshape([batch * seq, width]).into_primitive().tensor();
    let y = if unfused() {
        burn_forward::<B>(x, table(cos), table(sin), shape)
    } else {
        B::rope_heads(x, table(cos), table(sin), shape)
    };
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

fn f2<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// `t [.., d]` -> `(t[.., ..d/2], t[.., d/2..])`.
fn halves<B: Backend>(t: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, h, s, d] = t.dims();
    (
        t.clone().slice([0..b, 0..h, 0..s, 0..d / 2]),
        t.slice([0..b, 0..h, 0..s, d / 2..d]),
    )
}

/// The tables `[tokens, d]` as `[batch, 1, seq, d]`.
fn tables4<B: Backend>(t: FloatTensor<B>, shape: RopeShape) -> Tensor<B, 4> {
    f2::<B>(t).reshape([shape.batch, 1, shape.seq, shape.head_dim])
}

/// The default [`QerlBackend::rope_heads`]: burn's ops.
pub(crate) fn burn_forward<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    shape: RopeShape,
) -> FloatTensor<B> {
    let [batch, heads, seq, d] = shape.head_major();
    let x = f2::<B>(x).reshape([batch, seq, heads, d]).swap_dims(1, 2);
    let (x1, x2) = halves(x.clone());
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let y = x * tables4::<B>(cos, shape) + rotated * tables4::<B>(sin, shape);
    y.into_primitive().tensor()
}

/// The default [`QerlBackend::rope_heads_backward`]: burn's ops.
pub(crate) fn burn_backward<B: Backend>(
    dy: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    shape: RopeShape,
) -> FloatTensor<B> {
    let dy = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(dy));
    let (v1, v2) = halves(dy.clone() * tables4::<B>(sin, shape));
    let dx = dy * tables4::<B>(cos, shape) + Tensor::cat(vec![v2, v1.neg()], 3);
    dx.swap_dims(1, 2)
        .reshape(shape.token_major())
        .into_primitive()
        .tensor()
}

#[derive(Debug)]
struct RopeBackward;

impl<B: QerlBackend> Backward<B, 1> for RopeBackward {
    /// The tables and the shape.
    type State = (FloatTensor<B>, FloatTensor<B>, RopeShape);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let (cos, sin, shape) = ops.state;
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::rope_heads_backward(dy, cos, sin, shape));
        }
    }
}

/// The [`QerlBackend::rope_heads`] of `Autodiff<B, C>`: parent `x` (the tables are constants).
pub(crate) fn autodiff_rope<B: QerlBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<Autodiff<B, C>>,
    sin: FloatTensor<Autodiff<B, C>>,
    shape: RopeShape,
) -> FloatTensor<Autodiff<B, C>> {
    let (cos, sin) = (cos.primitive, sin.primitive);
    match RopeBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::rope_heads(x.primitive, cos.clone(), sin.clone(), shape);
            prep.finish((cos, sin, shape), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::rope_heads(x.primitive, cos, sin, shape)),
    }
}
