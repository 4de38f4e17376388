//! Which generator runs rollouts and `qerl generate`: the rollout engine (`qerl-engine`) where
//! the model lives on a CubeCL backend and the sampling is one it implements, the burn model's
//! own loop otherwise (the CPU, top-k/top-p sampling) and as the reference.
//!
//! `QERL_ENGINE=0` forces the burn path, `QERL_ENGINE=1` also uses the engine on wgpu; by
//! default the engine runs on CUDA only.

use std::any::Any;

use anyhow::Result;
use qerl_model::{CausalLm, Completion, Decode, GenerationConfig, QerlBackend};

/// Whether the engine serves a model on this backend, per `QERL_ENGINE`.
fn wanted(backend_is_cuda: bool) -> bool {
    match std::env::var("QERL_ENGINE").ok().as_deref() {
        Some("0") => false,
        Some("1") => true,
        _ => backend_is_cuda,
    }
}

/// [`qerl_model::generate_from_row`], on the engine where it applies (see the module doc).
pub fn generate_rows<B: QerlBackend>(
    model: &CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
    decoder: Option<&dyn Decode>,
    first_row: usize,
) -> Result<Vec<Completion>> {
    if qerl_engine::from_model::supports(config) && !prompts.is_empty() {
        let any: &dyn Any = model;
        #[cfg(feature = "cuda")]
        if let Some(m) = any.downcast_ref::<CausalLm<qerl_nn::backends::Cuda>>() {
            if wanted(true) {
                return Ok(qerl_engine::from_model::generate(
                    m, prompts, config, decoder, first_row,
                )?);
            }
        }
        #[cfg(feature = "wgpu")]
        if let Some(m) = any.downcast_ref::<CausalLm<qerl_nn::backends::Wgpu>>() {
            if wanted(false) {
                return Ok(qerl_engine::from_model::generate(
                    m, prompts, config, decoder, first_row,
                )?);
            }
        }
        let _ = any;
    }
    Ok(qerl_model::generate_from_row(
        model, prompts, config, decoder, first_row,
    )?)
}
