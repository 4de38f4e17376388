//! A run's sizes held to the model's before anything is allocated from them: the KV cache of a
//! rollout holds `data.max_prompt_tokens + rollout.max_completion_tokens` positions per
//! sequence, which must fit the model's context, and a LoRA rank above the hidden size adds
//! nothing but memory. A bad value is refused at start-up naming the key and the model's
//! `config.json`, not minutes later in the allocator. The largest activation of an update
//! micro-batch (`[sequences, tokens, intermediate_size]`) must also stay below 2^31 elements:
//! CubeCL indexes tensors with 32-bit integers, and past that it panics deep inside a launch
//! (seen on an H100, 2026-11-26: a 7B GRPO step of 64 sequences of 16,640 tokens in one
//! micro-batch ended in `called Option::unwrap() on a None value`, not in an out-of-memory
//! error).

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
    let sequences = config.rollout.batch_prompts * config.rollout.group_size;
    check_micro_batch(
        sequences,
        config.optim.grad_accum,
        prompt + config.rollout.max_completion_tokens,
        model.intermediate_size,
    )?;
    anyhow::ensure!(
        config.lora.rank <= model.hidden_size,
        "lora.rank = {} is more than the model's hidden_size = {} (in `{file}`)",
        config.lora.rank,
        model.hidden_size
    );
    Ok(())
}

/// Most elements a tensor may hold: CubeCL's kernels index with 32-bit integers.
pub const MAX_TENSOR_ELEMENTS: usize = (1 << 31) - 1;

/// Fails naming the settings when one update micro-batch (`sequences` split into `grad_accum`
/// parts, each sequence up to `tokens` long) would hold an MLP activation `[.., tokens, width]`
/// of more than [`MAX_TENSOR_ELEMENTS`].
pub fn check_micro_batch(
    sequences: usize,
    grad_accum: usize,
    tokens: usize,
    width: usize,
) -> Result<()> {
    let per_micro = sequences.div_ceil(grad_accum.max(1));
    let elements = per_micro.saturating_mul(tokens).saturating_mul(width);
    let fits = MAX_TENSOR_ELEMENTS / tokens.max(1) / width.max(1);
    anyhow::ensure!(
        elements <= MAX_TENSOR_ELEMENTS,
        "an update micro-batch of {per_micro} sequences of up to {tokens} tokens holds an MLP \
         activation of {elements} elements (intermediate_size = {width}), past the {} that a \
         tensor may hold: raise optim.grad_accum to at least {} (at most {fits} sequences a \
         micro-batch), or lower rollout.batch_prompts, rollout.group_size or \
         rollout.max_completion_tokens",
        MAX_TENSOR_ELEMENTS,
        sequences.div_ceil(fits.max(1)),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_micro_batch;

    #[test]
    fn a_micro_batch_past_32_bit_indexing_is_refused_naming_the_settings() {
        // The H100 case: 7B (intermediate 18,944), 64 sequences of 256 + 16,384 tokens.
        let err = check_micro_batch(64, 1, 16_640, 18_944)
            .unwrap_err()
            .to_string();
        for w in [
            "optim.grad_accum to at least 11",
            "rollout.max_completion_tokens",
        ] {
            assert!(err.contains(w), "`{w}` not in: {err}");
        }
        // The benchmark's 7B settings (grad_accum 4, 256 + 1,024 tokens) fit, as does the
        // split the message asks for.
        check_micro_batch(64, 4, 1_280, 18_944).unwrap();
        check_micro_batch(64, 11, 16_640, 18_944).unwrap();
    }
}
