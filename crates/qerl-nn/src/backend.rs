//! The backend extension the modules run on.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::TensorData;
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
