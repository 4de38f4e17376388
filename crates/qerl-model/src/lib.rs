//! Qwen2 and Llama decoders for QeRL, on the `qerl-nn` modules.
//!
//! * [`ModelConfig`]: `config.json` (transformers 4 and 5 layouts), errors naming file and key.
//! * [`load`] / [`load_with_adapter`]: a [`CausalLm`] from a Hugging Face directory, dense
//!   (BF16/F16/F32, single or sharded safetensors) or quantized as `qerl quantize` writes it
//!   (compressed-tensors NVFP4), with the decoder linears as `Nvfp4Linear` in the chosen
//!   [`Precision`] and optional LoRA ([`LoraSpec`] or a PEFT [`Adapter`]). Embeddings and
//!   lm_head stay dense.
//! * [`CausalLm::forward`]: logits `[batch, seq, vocab]` of a padded [`TokenBatch`] (the
//!   training pass, generic over the backend so it runs under `Autodiff<B>`);
//!   [`CausalLm::hidden_states_checkpointed`] + [`LayerCheckpoints`]: the same pass with
//!   activation checkpointing per decoder layer;
//!   [`CausalLm::prefill`] / [`CausalLm::decode`]: the KV-cached incremental path.
//! * [`CausalLm::token_log_probs`]: log-probabilities (and entropies) of chosen tokens from the
//!   final hidden states ([`CausalLm::hidden_states`]), the lm_head applied in chunks of rows
//!   so that no `[tokens, vocab]` logits exist in the forward or the backward.
//! * [`generate`]: batched generation with on-device sampling ([`sampling`]), per-sequence EOS
//!   and stop strings, seeds, returned token ids and log-probs; [`score`]: per-position top-k.
//! * [`Tokenizer`] and the ChatML [`ChatTemplate`].
//!
//! Shapes in the docs are `[batch, seq, ...]`; token ids are `u32` on the host.

mod adapter;
mod adapter_check;
mod adapter_norms;
mod attention;
pub mod batch;
mod checkpoint;
pub mod config;
mod error;
pub mod export;
pub mod generate;
mod load;
mod load_host;
mod logprobs;
mod model;
pub mod random;
pub mod rope;
pub mod sampling;
pub mod tokenizer;

pub use adapter::{Adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
pub use adapter_norms::LEGACY_NORMS_FILE;
pub use attention::{attention_path, set_attention_path, Attention, AttentionPath};
pub use batch::{Padding, TokenBatch};
pub use checkpoint::LayerCheckpoints;
pub use config::{Architecture, GenerationDefaults, ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use generate::{
    check_context, check_new_tokens, generate, generate_from_row, score, Completion, Decode,
    FinishReason, GenerationConfig, PositionScore,
};
pub use load::{
    load, load_with_adapter, load_with_stats, load_with_upload, LoadOptions, LoadStats, LoraSpec,
};
pub use model::{CausalLm, DecoderLayer, KvCache, Mlp};
pub use qerl_nn::{Entropy, LogProbOptions, LoraConfig, Precision, QerlBackend};
pub use sampling::SamplingParams;
pub use tokenizer::{ChatTemplate, Message, Tokenizer};
