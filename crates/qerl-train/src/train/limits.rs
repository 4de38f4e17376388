//! A run's sizes held to the model's before anything is allocated from them: the KV cache of a
//! rollout holds `data.max_prompt_tokens + rollout.max_completion_tokens` positions per
//! sequence, which must fit the model's context, and a LoRA rank above the hidden size adds
//! nothing but memory. A bad value is refused at start-up naming the key and the model's
//! `config.json`, not minutes later in the allocator.

use anyhow::Result;
use qerl_model::ModelConfig;
use qerl_rl::TrainConfig;

/// Fails naming the key when a size of `config` does not fit the model `model`.
pub fn check_against_model(config: &TrainConfig, model: &ModelConfig) -> Result<()> {
    let context = model.max_position_embeddings;
    let file = model.path.display();
    let prompt = config.data.max_prompt_tokens;
    anyhow::ensure!(
        prompt < context,
        "data.max_prompt_tokens = {prompt} leaves no room in the model's context \
         (max_position_embeddings = {context} in `{file}`)"
    );
    for (key, completion) in [
        (
            "rollout.max_completion_tokens",
            config.rollout.max_completion_tokens,
        ),
        (
            "eval.max_completion_tokens",
            config.eval.max_completion_tokens,
        ),
    ] {
        anyhow::ensure!(
            completion <= context - prompt,
            "{key} = {completion} after data.max_prompt_tokens = {prompt} goes past the model's \
             context (max_position_embeddings = {context} in `{file}`): at most {}",
            context - prompt
        );
    }
    anyhow::ensure!(
        config.lora.rank <= model.hidden_size,
        "lora.rank = {} is more than the model's hidden_size = {} (in `{file}`)",
        config.lora.rank,
        model.hidden_size
    );
    Ok(())
}
