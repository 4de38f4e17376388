//! The rollout engine: batched generation for Qwen2/Llama decoders on the frozen 4-bit
//! weights, built for RL rollouts (many samples of few prompts, uneven lengths).
//!
//! * [`shape`]: what the engine needs of a model (and Qwen2.5 presets for the benchmark).
//! * [`weights`]: the device weights it reads, shared with the training model, or random.
//! * [`kernels`]: fused CubeCL kernels (add + RMSNorm, with the LoRA down-projections at a few
//!   rows, RoPE + KV write, GQA attention over the cache, SiLU·mul, dense products for the
//!   lm_head and LoRA, device sampling).
//! * `forward`: one pass over a flat batch of `(token, slot, position)` rows, which serves
//!   prefill and decode alike.
//! * [`from_model`]: the engine over a loaded or training burn model (weights shared), with
//!   `qerl_model::generate`'s contract.
//! * [`bench`]: the rollout benchmark on random weights of a preset shape.
//! * [`reference`]: a host f64 decoder and random models on both sides, for the checks.
//! * [`engine`]: the [`Engine`]: KV cache arena, prompt sharing across samples, continuous
//!   batching, asynchronous finished flags.
//!
//! Everything is generic over the CubeCL runtime and the float type: bf16 on CUDA, f32/f16 on
//! wgpu for the tests.

pub mod bench;
pub mod engine;
mod forward;
pub mod from_model;
pub mod kernels;
mod products;
pub mod reference;
pub mod shape;
mod step_graphs;
pub mod weights;

pub use engine::{Completion, Engine, EngineConfig, GenerateStats, Request, Sampling};
pub use kernels::sample::Truncation;
pub use shape::ModelShape;
pub use weights::{EngineWeights, Frozen, Layer, Linear, LoraWeights, RandomPrecision};

use thiserror::Error;

/// What can go wrong building or running the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("model shape: {0}")]
    Shape(String),
    #[error("engine configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Request(String),
    #[error(transparent)]
    Kernel(#[from] qerl_kernels::KernelError),
    #[error("device: {0}")]
    Device(String),
}

/// Runtimes compiled into this build.
pub mod runtime {
    pub use qerl_kernels::runtime::*;
}
