//! CubeCL kernels for qerl, generic over the runtime (CUDA, wgpu) and the float type.
//!
//! * [`dequant`]: packed 4-bit weight + scales -> dense `[N, K]`.
//! * [`gemm`]: W4A16 `Y[M,N] = X[M,K] · deq(W)[N,K]^T (+ bias) (+ s·(X·Aᵀ)·Bᵀ)`, the LoRA term
//!   applied in the epilogue (for M <= 8, or 16 without tensor cores, on devices with warp operations, a memory-bound
//!   decode kernel, `gemv`, on CUDA for bf16 E2M1 weights on `mma` tensor cores, `gemv_mma`;
//!   split-K where the output alone would not fill the device); and the
//!   backward product `dX[M,K] = dY[M,N] · deq(W)[N,K]`. Above the decode kernel's rows the
//!   [`gemm::Strategy`] decides: by default the `mma` kernel for decode batches, the tensor-core
//!   kernel, and dequantize + cuBLAS ([`dense`] operands, the CUDA-only `cublas` module, queued
//!   on cubecl's own stream where CUPTI finds it: `cubecl_stream`) from
//!   [`gemm::cublas_min_m`] rows; or one of them alone, or CubeCL's autotuner (`QERL_GEMM`).
//! * [`attention`]: fused causal attention with per-row key ranges (padding) and grouped-query
//!   heads, forward (saving the log-sum-exp per query) and backward, flash-attention style.
//! * [`rms_norm`]: fused noisy RMSNorm `y = x / sqrt(mean(x²) + eps) ⊙ (w + z)`, forward and backward.
//! * [`rope`]: rotary position embedding fused with the move of the heads to the front
//!   (`[tokens, heads·d]` -> `[batch, heads, seq, d]`), forward and backward.
//! * [`silu_mul`]: the SwiGLU gate `h = silu(g) ⊙ u`, forward and backward, one element-wise
//!   kernel each.
//!
//! * `lora_down_mma` (CUDA builds): a decode batch's LoRA down-projections `T = X·Aᵀ` on
//!   tensor cores, K cut over many cubes.
//! * `norm_cluster` (CUDA builds): a decode batch's residual add + RMSNorm spread over a
//!   thread-block cluster, with the LoRA down-projections of the products that read it.
//!
//! Kernels cubecl cannot express (`wgmma`, register-level bit tricks) are hand-written CUDA,
//! compiled and launched on cubecl's own stream through the CUDA-only `cuda_source` module.
//!
//! Every kernel accumulates in f32 whatever the activation type `F` (f32/f16 on wgpu, bf16 on
//! CUDA). Weights live on the device as a [`DeviceWeight`]: 4-bit codes packed eight to a `u32`
//! (element `k` of a word at bits `4k..4k+4`), and per-block scales, looked up through small
//! tables so that one kernel serves NVFP4, MXFP4 and NF4. wgpu cannot take `u8` kernel
//! arguments, hence the `u32` words.

pub mod attention;
pub mod blas;
#[cfg(feature = "cuda")]
mod cubecl_stream;
#[cfg(feature = "cuda")]
mod cublas;
#[cfg(feature = "cuda")]
mod cuda_source;
pub mod dense;
pub mod dequant;
mod device;
pub mod gemm;
mod gemm_mma;
mod gemm_tc;
mod gemv;
#[cfg(feature = "cuda")]
mod gemv_mma;
#[cfg(feature = "cuda")]
pub mod graph;
#[cfg(feature = "cuda")]
pub mod lora_down_mma;
#[cfg(feature = "cuda")]
pub mod norm_cluster;
pub mod rms_norm;
pub mod rope;
pub mod silu_mul;
mod splitk;
mod tune;
pub mod upload;
#[cfg(feature = "cuda")]
mod upload_cuda;
#[cfg(feature = "wgpu")]
mod wgpu_probe;
mod workspace_arena;

pub use device::{DeviceWeight, KernelError};

/// Runtimes compiled into this build.
pub mod runtime {
    #[cfg(feature = "wgpu")]
    pub use crate::wgpu_probe::{
        wgpu_device, wgpu_device_or_exit, NoWgpuAdapter, LAVAPIPE_PACKAGE,
    };
    #[cfg(feature = "cuda")]
    pub use cubecl::cuda::{CudaDevice, CudaRuntime};
    #[cfg(feature = "wgpu")]
    pub use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
}
