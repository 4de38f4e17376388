//! The `[model]` and `[lora]` sections of a run config as the loader's [`LoadOptions`]: one
//! mapping, so that the trainer and the tests that stand in for it load the same model.

use qerl_model::{LoadOptions, LoraSpec};
use qerl_rl::config::{LoraConfig, ModelConfig, Precision};

/// The loader's precision for the config's: the config crate does not depend on the model
/// crate, so each keeps its own enum.
pub fn precision(p: Precision) -> qerl_model::Precision {
    match p {
        Precision::Nvfp4 => qerl_model::Precision::Nvfp4,
        Precision::Bf16 => qerl_model::Precision::Bf16,
        Precision::Mxfp4 => qerl_model::Precision::Mxfp4,
        Precision::Nf4 => qerl_model::Precision::Nf4,
    }
}

/// The model quantised to `model.precision`, with fresh adapters on `lora.targets` and
/// trainable norms where `lora.train_norms`.
pub fn load_options(model: &ModelConfig, lora: &LoraConfig) -> LoadOptions {
    LoadOptions {
        precision: Some(precision(model.precision)),
        lora: Some(LoraSpec {
            config: qerl_nn::LoraConfig {
                rank: lora.rank,
                alpha: lora.alpha,
            },
            targets: lora.targets.clone(),
        }),
        trainable_norms: lora.train_norms,
    }
}
