//! Batched generation for RL rollouts, and per-position scoring.
//!
//! [`generate`] left-pads a batch of prompts of different lengths, runs them through the model
//! once into a KV cache, then decodes one token per sequence per step, sampling on the device
//! ([`crate::sampling`]). Each sequence stops on its own: at one of `eos_token_ids` (the EOS
//! token is kept as its last token), when its decoded completion contains a stop string (the
//! token that completed it is kept; [`truncate_at_stop`] cuts the text), or after
//! `max_new_tokens`. Finished sequences are fed the pad token until the whole batch is done.

use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use qerl_nn::QerlBackend;

use crate::batch::{Padding, TokenBatch};
use crate::error::{ModelError, Result};
use crate::model::CausalLm;
use crate::sampling::{sample, Rng, SamplingParams};

/// Prompt lengths and cache capacities are rounded up to a multiple of this.
pub const SHAPE_MULTIPLE: usize = 16;

/// What [`generate`] does.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Seed of the per-sequence generators ([`Rng::for_sequence`]).
    pub seed: u64,
    /// Tokens that end a sequence (usually from `generation_config.json`).
    pub eos_token_ids: Vec<u32>,
    /// Texts that end a sequence once its decoded completion contains one (needs a decoder).
    pub stop_strings: Vec<String>,
    /// Left padding and the token fed to finished sequences.
    pub pad_token_id: u32,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 128,
            sampling: SamplingParams::default(),
            seed: 0,
            eos_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            pad_token_id: 0,
        }
    }
}

/// Why a sequence stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced this EOS token.
    Eos(u32),
    /// Its completion contains this stop string.
    Stop(String),
    /// It reached `max_new_tokens`.
    Length,
}

/// One sequence's new tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    /// Log-probability of each token, `log_softmax(logits / T)` before top-k/top-p (see
    /// [`crate::sampling`]).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
}

/// Turns token ids into text (for stop strings).
pub trait Decode {
    fn decode(&self, ids: &[u32]) -> Result<String>;
}

/// The text up to the first stop string it contains.
pub fn truncate_at_stop<'a>(text: &'a str, stop_strings: &[String]) -> &'a str {
    let cut = stop_strings
        .iter()
        .filter_map(|s| text.find(s.as_str()))
        .min();
    &text[..cut.unwrap_or(text.len())]
}

fn host_ids<B: QerlBackend>(t: Tensor<B, 1, Int>) -> Vec<u32> {
    t.into_data().iter::<i64>().map(|v| v as u32).collect()
}

fn host_f32<B: QerlBackend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().iter::<f32>().collect()
}

/// Fails when `max_new_tokens` alone exceeds the model's context (`max_position_embeddings`):
/// the KV cache is allocated for the prompt plus that many positions up front, so a huge value
/// would otherwise end in the allocator. (A prompt past the context still runs, as in
/// transformers; commands that take a user's prompt hold it to [`check_context`].)
pub fn check_new_tokens(model: &crate::ModelConfig, max_new_tokens: usize) -> Result<()> {
    let context = model.max_position_embeddings;
    if max_new_tokens > context {
        return Err(ModelError::Input(format!(
            "max_new_tokens = {max_new_tokens} is more than the model's context: \
             max_position_embeddings = {context} in `{}`",
            model.path.display()
        )));
    }
    Ok(())
}

/// Fails unless the longest prompt plus `max_new_tokens` fits the model's context
/// (`max_position_embeddings`): positions past it are ones the model never saw, and a prompt of
/// a whole file would be minutes of work.
pub fn check_context(
    model: &crate::ModelConfig,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
) -> Result<()> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let context = model.max_position_embeddings;
    if longest > context {
        return Err(ModelError::Input(format!(
            "a prompt of {longest} tokens is longer than the model's context: \
             max_position_embeddings = {context} in `{}`",
            model.path.display()
        )));
    }
    if max_new_tokens > context - longest {
        return Err(ModelError::Input(format!(
            "max_new_tokens = {max_new_tokens} after a prompt of {longest} tokens goes past the \
             model's context: max_position_embeddings = {context} in `{}` leaves {} new tokens",
            model.path.display(),
            context - longest
        )));
    }
    Ok(())
}

/// Generates a completion for every prompt (token ids, each non-empty).
pub fn generate<B: QerlBackend>(
    model: &CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
    decoder: Option<&dyn Decode>,
) -> Result<Vec<Completion>> {
    generate_from_row(model, prompts, config, decoder, 0)
}

/// [`generate`] for rows `first_row..` of a larger batch: row `i` samples from the random
/// stream of row `first_row + i`, so a batch split into parts (one per data-parallel rank)
/// draws exactly the numbers it draws whole.
pub fn generate_from_row<B: QerlBackend>(
    model: &CausalLm<B>,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
    decoder: Option<&dyn Decode>,
    first_row: usize,
) -> Result<Vec<Completion>> {
    config.sampling.validate()?;
    if !config.stop_strings.is_empty() && decoder.is_none() {
        return Err(ModelError::Input(
            "stop strings need a tokenizer to decode with".into(),
        ));
    }
    if config.stop_strings.iter().any(String::is_empty) {
        return Err(ModelError::Input("a stop string is empty".into()));
    }
    check_new_tokens(&model.config, config.max_new_tokens)?;
    // Lengths rounded up so that the kernels see few distinct shapes (each new shape is compiled
    // and autotuned once per process, or once per machine with the autotune cache).
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
    // A stop string of c chars spans at most 4c byte-level tokens; decode a window that wide.
    let window = 4 * config
        .stop_strings
        .iter()
        .map(|s| s.chars().count())
        .max()
        .unwrap_or(0)
        + 4;
    let capacity = (batch.len + config.max_new_tokens).div_ceil(SHAPE_MULTIPLE) * SHAPE_MULTIPLE;
    let mut cache = model.new_cache(n, capacity);
    let mut logits = model.prefill(&batch, &mut cache)?;
    let mut rngs: Vec<Rng> = (0..n)
        .map(|i| Rng::for_sequence(config.seed, first_row + i))
        .collect();
    let mut done = vec![false; n];
    for step in 0..config.max_new_tokens {
        let uniform: Vec<f32> = rngs.iter_mut().map(Rng::next_open01).collect();
        let s = sample(logits, &config.sampling, &uniform);
        let (ids, lps) = (host_ids(s.ids), host_f32(s.logprobs));
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
            } else if let Some(d) = decoder.filter(|_| !config.stop_strings.is_empty()) {
                let tail = d.decode(&c.tokens[c.tokens.len().saturating_sub(window)..])?;
                if let Some(s) = config
                    .stop_strings
                    .iter()
                    .find(|s| tail.contains(s.as_str()))
                {
                    c.finish = FinishReason::Stop(s.clone());
                    done[row] = true;
                }
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

/// One position of a scored text.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionScore {
    /// The token at this position.
    pub token: u32,
    /// `log p(token | previous tokens)`; `None` at position 0.
    pub logprob: Option<f32>,
    /// The `top_k` most likely next tokens after this position, `(id, log-prob)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// Scores a token sequence: at every position the log-probability of the actual token and the
/// `top_k` most likely next tokens (log-softmax of the logits, T = 1, LoRA applied).
pub fn score<B: QerlBackend>(
    model: &CausalLm<B>,
    ids: &[u32],
    top_k: usize,
) -> Result<Vec<PositionScore>> {
    let batch = TokenBatch::single(ids)?;
    let logits = model.forward(&batch)?; // [1, s, v]
    let [_, s, v] = logits.dims();
    let lp = log_softmax(logits.reshape([s, v]).cast(DType::F32), 1);
    let device = lp.device();
    let k = top_k.min(v);
    let top_ids = if k == 0 {
        None
    } else if k < v {
        // sort-based (burn's NdArray backend has no argtopk); one sequence, so cheap enough
        Some(lp.clone().topk_with_indices(k, 1).1)
    } else {
        Some(
            Tensor::<B, 1, Int>::arange(0..v as i64, &device)
                .unsqueeze_dim::<2>(0)
                .repeat_dim(0, s),
        )
    };
    let top = top_ids.map(|idx| {
        (
            host_ids(idx.clone().reshape([s * k])),
            host_f32(lp.clone().gather(1, idx)),
        )
    });
    let next: Vec<i64> = ids[1..].iter().map(|&t| t as i64).collect();
    let actual = if s > 1 {
        let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(next, [s - 1, 1]), &device);
        host_f32(lp.slice([0..s - 1, 0..v]).gather(1, idx))
    } else {
        Vec::new()
    };
    Ok((0..s)
        .map(|i| {
            let mut top: Vec<(u32, f32)> = match &top {
                Some((ids, lps)) => (0..k).map(|j| (ids[i * k + j], lps[i * k + j])).collect(),
                None => Vec::new(),
            };
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            PositionScore {
                token: ids[i],
                logprob: i.checked_sub(1).map(|j| actual[j]),
                top,
            }
        })
        .collect())
}
