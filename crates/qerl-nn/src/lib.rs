//! Burn modules for QeRL: what a Burn user imports to put frozen 4-bit weights, LoRA and
//! adaptive quantization noise into a model.
//!
//! * [`Nvfp4Linear`]: a linear layer whose frozen weight is stored in NVFP4 (or MXFP4, NF4, or
//!   kept dense for the BF16 baseline, chosen by [`Precision`]), with an optional LoRA adapter.
//!   Under autodiff its backward returns `dX` through the transposed 4-bit kernel and the LoRA
//!   gradients; the weight never gets a gradient and is never expanded to a dense copy.
//! * [`NoisyRmsNorm`]: RMSNorm whose weight may be trained, plus a per-channel noise vector the
//!   caller sets for the next forwards (AQN).
//! * [`lm_head_log_probs`]: log-probabilities and entropies of chosen tokens through the
//!   lm_head in chunks of rows, the backward recomputing each chunk: no `[tokens, vocab]`
//!   logits in either pass.
//! * [`causal_attention`]: causal self-attention with padding and grouped-query heads as one
//!   fused op (flash-attention style on CubeCL backends): no `[seq, seq]` tensors kept for the
//!   backward.
//! * [`rope_heads`]: rotary position embedding of a q/k product's output with its heads moved to
//!   the front, one op each way (one kernel on CubeCL backends).
//! * [`silu_mul`]: the MLP's SwiGLU gate `silu(g) ⊙ u` as one op each way (one kernel on
//!   CubeCL backends) instead of burn's chain of f32 element-wise kernels.
//!
//! All run on any backend implementing [`QerlBackend`]: CubeCL backends (wgpu, CUDA) use the
//! kernels of `qerl-kernels`; the NdArray CPU backend uses a host reference path; `Autodiff<B>`
//! adds the custom backward passes.

mod activation;
pub mod attention;
mod backend;
mod backend_autodiff;
mod backend_cpu;
mod backend_cube;
mod linear;
pub mod lm_head;
mod norm;
pub mod rope;

pub use activation::silu_mul;
pub use attention::{causal_attention, causal_mask, key_ranges, KeyRanges};
pub use backend::{LoraPrims, QerlBackend, QuantWeight};
pub use linear::{Lora, LoraConfig, Nvfp4Linear};
pub use lm_head::{lm_head_log_probs, Entropy, LogProbOptions};
pub use norm::NoisyRmsNorm;
/// Host-to-device copies of weights (staged on CUDA inside an upload session).
pub use qerl_kernels::{upload, KernelError};
pub use rope::{rope_heads, RopeShape};

use thiserror::Error;

/// Backends qerl is tested on.
pub mod backends {
    /// CPU reference backend.
    pub type Cpu = burn::backend::NdArray<f32>;
    /// wgpu (Vulkan, Metal, DX12; lavapipe on a CPU) with the qerl kernels, f32 activations.
    #[cfg(feature = "wgpu")]
    pub type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
    /// The wgpu device, after checking that an adapter exists (one error naming the missing
    /// driver instead of a panic inside cubecl).
    #[cfg(feature = "wgpu")]
    pub use qerl_kernels::runtime::{wgpu_device, wgpu_device_or_exit, NoWgpuAdapter};
    /// CUDA with the qerl kernels, bf16 activations.
    #[cfg(feature = "cuda")]
    pub type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, half::bf16, i32, u8>;
    /// CUDA with f32 activations: full-parameter training (`qerl sft`) keeps its weights in f32.
    #[cfg(feature = "cuda")]
    pub type CudaF32 = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

    /// Device memory that cubecl's allocator holds on CUDA device 0, as `(bytes in use by live
    /// buffers, bytes reserved from the driver)`; the CUDA context itself (a few hundred MB a
    /// process) is outside both. `None` when the runtime cannot say.
    #[cfg(feature = "cuda")]
    pub fn cuda_memory() -> Option<(u64, u64)> {
        use cubecl::Runtime;
        let client = cubecl::cuda::CudaRuntime::client(&Default::default());
        let m = client.memory_usage().ok()?;
        Some((m.bytes_in_use, m.bytes_reserved))
    }
}

/// How a linear layer stores its frozen weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Dense, in the backend's float type (bf16 on CUDA): the LoRA baseline.
    Bf16,
    /// NVFP4 (E2M1 + FP8 scale per 16 + FP32 tensor scale): QeRL.
    #[default]
    Nvfp4,
    /// MXFP4 (E2M1 + E8M0 scale per 32).
    Mxfp4,
    /// NF4 (bitsandbytes, absmax per 64): QLoRA.
    Nf4,
}

impl Precision {
    /// The 4-bit format, or `None` for the dense baseline.
    pub fn format(self) -> Option<qerl_format::QuantFormat> {
        use qerl_format::QuantFormat;
        match self {
            Precision::Bf16 => None,
            Precision::Nvfp4 => Some(QuantFormat::Nvfp4),
            Precision::Mxfp4 => Some(QuantFormat::Mxfp4),
            Precision::Nf4 => Some(QuantFormat::Nf4),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Bf16 => "bf16",
            Precision::Nvfp4 => "nvfp4",
            Precision::Mxfp4 => "mxfp4",
            Precision::Nf4 => "nf4",
        })
    }
}

impl std::str::FromStr for Precision {
    type Err = NnError;
    fn from_str(s: &str) -> Result<Self, NnError> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Precision::Bf16),
            "nvfp4" => Ok(Precision::Nvfp4),
            "mxfp4" => Ok(Precision::Mxfp4),
            "nf4" => Ok(Precision::Nf4),
            other => Err(NnError::Config(format!(
                "unknown precision `{other}` (expected bf16, nvfp4, mxfp4 or nf4)"
            ))),
        }
    }
}

/// Errors building or running a module.
#[derive(Debug, Error)]
pub enum NnError {
    /// A weight that cannot be quantized (shape, NaN).
    #[error(transparent)]
    Format(#[from] qerl_format::FormatError),
    /// A weight the kernels cannot run (e.g. input dimension not a multiple of 16).
    #[error("`{name}`: {source}")]
    Kernel {
        name: String,
        source: qerl_kernels::KernelError,
    },
    /// Buffers that do not match the declared shapes.
    #[error("`{name}`: {what}")]
    Shape { name: String, what: String },
    #[error("{0}")]
    Config(String),
}
