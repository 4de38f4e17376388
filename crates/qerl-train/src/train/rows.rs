//! Rollout generation whose random streams follow the *global* batch.
//!
//! [`qerl_model::generate`] gives row `i` of its batch the generator
//! `Rng::for_sequence(seed, i)`. Under data parallelism a rank generates a slice of the global
//! batch, and its rows must draw the numbers the same rows draw in a single-process run, or
//! a run's samples (hence its adapter) would depend on the number of ranks. [`generate_rows`]
//! is that decode loop with row `i` drawing from `Rng::for_sequence(seed, first_row + i)`:
//! with `first_row = 0` it computes exactly what `generate` computes (same padding, cache,
//! sampling calls; a test checks it bit for bit), so a single-process run is unchanged.
//! Stop strings are not supported here (the trainer uses none).

use anyhow::{ensure, Result};
use burn::tensor::{DType, Int, Tensor};
use qerl_model::generate::SHAPE_MULTIPLE;
use qerl_model::sampling::{sample, Rng};
use qerl_model::{
    CausalLm, Completion, FinishReason, GenerationConfig, Padding, QerlBackend, TokenBatch,
};

/// Completions of `prompts` (each non-empty), rows numbered from `first_row` in the global
/// batch for their random streams.
pub fn generate_rows<B: QerlBackend>(
    model: &CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
    first_row: usize,
) -> Result<Vec<Completion>> {
    ensure!(
        config.stop_strings.is_empty(),
        "rollouts take no stop strings"
    );
    config.sampling.validate()?;
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    let batch = TokenBatch::padded_to_multiple(
        prompts,
        config.pad_token_id,
        Padding::Left,
        SHAPE_MULTIPLE,
    )?;
    let n = batch.batch;
    let mut out: Vec<Completion> = (0..n)
        .map(|_| Completion {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: FinishReason::Length,
        })
        .collect();
    if config.max_new_tokens == 0 {
        return Ok(out);
    }
    let capacity = (batch.len + config.max_new_tokens).div_ceil(SHAPE_MULTIPLE) * SHAPE_MULTIPLE;
    let mut cache = model.new_cache(n, capacity);
    let mut logits = model.prefill(&batch, &mut cache)?;
    let mut rngs: Vec<Rng> = (0..n)
        .map(|i| Rng::for_sequence(config.seed, first_row + i))
        .collect();
    let mut done = vec![false; n];
    for step in 0..config.max_new_tokens {
        // every row draws one number per step, finished or not, as in `generate`
        let uniform: Vec<f32> = rngs.iter_mut().map(Rng::next_open01).collect();
        let s = sample(logits, &config.sampling, &uniform);
        let ids = host_ids(s.ids);
        let lps: Vec<f32> = s
            .logprobs
            .cast(DType::F32)
            .into_data()
            .iter::<f32>()
            .collect();
        for row in 0..n {
            if done[row] {
                continue;
            }
            let c = &mut out[row];
            c.tokens.push(ids[row]);
            c.logprobs.push(lps[row]);
            if config.eos_token_ids.contains(&ids[row]) {
                c.finish = FinishReason::Eos(ids[row]);
                done[row] = true;
            }
        }
        if done.iter().all(|&d| d) || step + 1 == config.max_new_tokens {
            break;
        }
        let next: Vec<u32> = (0..n)
            .map(|r| if done[r] { config.pad_token_id } else { ids[r] })
            .collect();
        logits = model.decode(&next, &mut cache)?;
    }
    Ok(out)
}

fn host_ids<B: QerlBackend>(t: Tensor<B, 1, Int>) -> Vec<u32> {
    t.into_data().iter::<i64>().map(|v| v as u32).collect()
}
