//! The backend extension the modules run on.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use qerl_format::QuantizedWeight;

use crate::NnError;

/// The LoRA branch of a linear, as backend primitives: `A [r, K]`, `B [N, r]`, `scale = α / r`.
pub struct LoraPrims<B: Backend> {
    pub a: FloatTensor<B>,
    pub b: FloatTensor<B>,
    pub scale: f32,
}

/// A frozen 4-bit weight held by a backend, `[n, k]` = `[out_features, in_features]`.
pub trait QuantWeight: Clone + std::fmt::Debug + Send + Sync + 'static {
    fn dims(&self) -> [usize; 2];
}

/// Kernels the qerl modules need from a backend. Shapes are 2-D: callers flatten leading dims.
pub trait QerlBackend: Backend {
    /// The weight as this backend stores it (device buffers, or the host form on the CPU).
    type QWeight: QuantWeight;

    /// Puts a dense float tensor of the loader on `device` (the bulk of a BF16 checkpoint):
    /// burn's `from_data` by default; the CubeCL backends go through `qerl_kernels::upload`
    /// (staged on CUDA inside an upload session).
    fn float_upload(
        name: &str,
        data: TensorData,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, NnError> {
        let _ = name;
        Ok(Self::float_from_data(data, device))
    }

    /// Puts a host-quantized weight on `device`.
    fn qweight_upload(
        name: &str,
        weight: &QuantizedWeight,
        device: &Self::Device,
    ) -> Result<Self::QWeight, NnError>;

    /// The dense `[n, k]` matrix (for merging LoRA into an export copy, and for tests; the
    /// forward and backward passes never call it).
    fn qweight_dequantize(weight: &Self::QWeight, device: &Self::Device) -> FloatTensor<Self>;

    /// `y[M, N] = x[M, K] · deq(W)ᵀ (+ bias[N]) (+ s · (x · Aᵀ) · Bᵀ)`.
    fn qlinear(
        x: FloatTensor<Self>,
        weight: &Self::QWeight,
        bias: Option<FloatTensor<Self>>,
        lora: Option<LoraPrims<Self>>,
    ) -> FloatTensor<Self>;

    /// `dx[M, K] = dy[M, N] · deq(W)`.
    fn qlinear_dx(dy: FloatTensor<Self>, weight: &Self::QWeight) -> FloatTensor<Self>;

    /// Noisy RMSNorm of `x [M, D]` with weight `w [D]` and optional noise `z [D]`:
    /// returns `y [M, D]` and `rstd [M]` (f32), `1 / sqrt(mean(x²) + eps)` per row.
    fn noisy_rms_norm(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        z: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Causal attention over `q [b, h, s, d]`, `k`, `v [b, kv, s, d]` with per-row visible keys
    /// `ranges` ([`crate::attention`]): `(out [b, h, s, d], lse [b, h, s] f32)`. The default
    /// runs burn ops in f32; CubeCL backends run the fused kernel.
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        ranges: &[(usize, usize)],
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::attention::forward_prim::<Self>(q, k, v, ranges, scale)
    }

    /// Backward of [`attention_forward`](Self::attention_forward) from its output, `lse` and
    /// the upstream `d_out`: `(dq, dk, dv)`, shaped as `q`, `k`, `v`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        ranges: &[(usize, usize)],
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::attention::backward_prim::<Self>(q, k, v, out, lse, d_out, ranges, scale)
    }

    /// The output of [`attention_forward`](Self::attention_forward); `Autodiff<B>` records the
    /// fused backward ([`crate::causal_attention`]).
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        ranges: &[(usize, usize)],
        scale: f32,
    ) -> FloatTensor<Self> {
        Self::attention_forward(q, k, v, ranges, scale).0
    }

    /// Device memory this backend's allocator holds on `device`, as `(bytes in use by live
    /// buffers, bytes reserved from the driver)`; `None` where there is no pool of its own (the
    /// CPU).
    fn memory_usage(_device: &Self::Device) -> Option<(u64, u64)> {
        None
    }

    /// Backward of [`noisy_rms_norm`](Self::noisy_rms_norm): `(dx [M, D], dw [D])`; `dw` is also
    /// the gradient of the noise.
    fn noisy_rms_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        z: Option<FloatTensor<Self>>,
        rstd: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `C[m, n] = alpha · op(a) · op(b)` for two matrices of one float type, `op` transposing
    /// `a` where `a_t` (stored `[k, m]`) and `b` where `b_t` (stored `[n, k]`): burn's matmul
    /// by default. The CubeCL backends run bf16 and f16 on cuBLAS where it loads
    /// (`qerl_kernels::blas`), since burn's matmul compiles about a dozen candidate kernels for
    /// every new shape bucket: most of a first training step on a fresh machine.
    fn dense_matmul(
        a: FloatTensor<Self>,
        a_t: bool,
        b: FloatTensor<Self>,
        b_t: bool,
        alpha: f32,
    ) -> FloatTensor<Self> {
        burn_dense_matmul::<Self>(a, a_t, b, b_t, alpha)
    }

    /// The LoRA part of a linear's backward, with `G = dy [M, N]`, `x [M, K]`, `A [r, K]`,
    /// `B [N, r]` and the scale `s`: `[s·(G·B)·A [M, K], s·(G·B)ᵀ·x [r, K], s·Gᵀ·(x·Aᵀ) [N, r]]`
    /// (the terms of `dx`, `dA`, `dB`), each only where `want` says. burn's ops by default; the
    /// CubeCL backends run the five products as one call to cuBLAS where it loads.
    fn lora_backward(
        g: FloatTensor<Self>,
        x: FloatTensor<Self>,
        lora: LoraPrims<Self>,
        want: [bool; 3],
    ) -> [Option<FloatTensor<Self>>; 3] {
        burn_lora_backward::<Self>(g, x, lora, want)
    }

    /// RoPE of `x [batch·seq, heads·d]` with the tables `cos`, `sin` `[batch·seq, d]`, the
    /// heads moved to the front: `[batch, heads, seq, d]` ([`crate::rope_heads`]). burn's ops
    /// by default; the CubeCL backends run one kernel (`qerl_kernels::rope`).
    fn rope_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: crate::RopeShape,
    ) -> FloatTensor<Self> {
        crate::rope::burn_forward::<Self>(x, cos, sin, shape)
    }

    /// Backward of [`rope_heads`](Self::rope_heads): `dy [batch, heads, seq, d]` ->
    /// `dx [batch·seq, heads·d]`.
    fn rope_heads_backward(
        dy: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: crate::RopeShape,
    ) -> FloatTensor<Self> {
        crate::rope::burn_backward::<Self>(dy, cos, sin, shape)
    }

    /// The SwiGLU gate `h [M, D] = silu(g) ⊙ u` ([`crate::silu_mul`]): burn's ops by default;
    /// the CubeCL backends run one kernel (`qerl_kernels::silu_mul`).
    fn silu_mul(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::activation::burn_forward::<Self>(g, u)
    }

    /// Backward of [`silu_mul`](Self::silu_mul) from its inputs and the upstream `dh`:
    /// `(dg, du)`, each `[M, D]`.
    fn silu_mul_backward(
        g: FloatTensor<Self>,
        u: FloatTensor<Self>,
        dh: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::activation::burn_backward::<Self>(g, u, dh)
    }

    /// Log-probability of `targets [M]` and entropy of the next-token distribution for final
    /// hidden states `hidden [M, K]` through the output projection `weight [V, K]`, computed
    /// `opts.rows(V)` rows at a time: `[M, 2]` f32 (log p, entropy). See
    /// [`crate::lm_head_log_probs`]; the default runs the chunked forward with burn ops,
    /// `Autodiff<B>` adds the backward that recomputes each chunk's logits.
    fn lm_head_log_probs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: crate::LogProbOptions,
    ) -> FloatTensor<Self> {
        crate::lm_head::forward_prim::<Self>(hidden, weight, targets, opts)
    }
}

fn t2<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// [`QerlBackend::dense_matmul`] with burn's ops.
pub(crate) fn burn_dense_matmul<B: Backend>(
    a: FloatTensor<B>,
    a_t: bool,
    b: FloatTensor<B>,
    b_t: bool,
    alpha: f32,
) -> FloatTensor<B> {
    let (a, b) = (t2::<B>(a), t2::<B>(b));
    let a = if a_t { a.transpose() } else { a };
    let b = if b_t { b.transpose() } else { b };
    let c = a.matmul(b);
    let c = if alpha == 1.0 { c } else { c.mul_scalar(alpha) };
    c.into_primitive().tensor()
}

/// [`QerlBackend::lora_backward`] with burn's ops.
pub(crate) fn burn_lora_backward<B: Backend>(
    g: FloatTensor<B>,
    x: FloatTensor<B>,
    lora: LoraPrims<B>,
    want: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    let [want_dx, want_da, want_db] = want;
    let (g, x, a, b) = (t2::<B>(g), t2::<B>(x), t2::<B>(lora.a), t2::<B>(lora.b));
    let scale = lora.scale;
    // s·G·B [M, r], shared by the dx and dA terms.
    let gb = (want_dx || want_da).then(|| g.clone().matmul(b).mul_scalar(scale));
    let dx = want_dx.then(|| gb.clone().unwrap().matmul(a.clone()));
    let da = want_da.then(|| gb.clone().unwrap().transpose().matmul(x.clone()));
    let db = want_db.then(|| {
        let t = x.matmul(a.transpose());
        g.transpose().matmul(t).mul_scalar(scale)
    });
    [dx, da, db].map(|t| t.map(|t| t.into_primitive().tensor()))
}
