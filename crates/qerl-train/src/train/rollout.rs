//! Rollouts: prompts in, G scored completions per prompt out.

use anyhow::{Context, Result};
use qerl_model::{
    CausalLm, ChatTemplate, Completion, FinishReason, GenerationConfig, Message, QerlBackend,
    Tokenizer,
};
use qerl_rl::prompt::PromptTemplate;
use qerl_rl::reward::{BatchScores, RewardSet};

/// Token ids of every question's chat prompt, the first `max_tokens` dropped from the left
/// when longer (the end holds the question and the assistant header).
pub fn encode_prompts(
    questions: &[String],
    template: &PromptTemplate,
    chat: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    max_tokens: usize,
) -> Result<Vec<Vec<u32>>> {
    questions
        .iter()
        .map(|q| {
            let messages: Vec<Message> = template
                .render(q)
                .iter()
                .map(|m| Message::new(&m.role, &m.content))
                .collect();
            let mut ids = match chat {
                Some(c) => c.encode(tokenizer, &messages, true)?,
                None => {
                    let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                    tokenizer.encode(&text.join("\n\n"), true)?
                }
            };
            if max_tokens > 0 && ids.len() > max_tokens {
                ids.drain(..ids.len() - max_tokens);
            }
            anyhow::ensure!(!ids.is_empty(), "the prompt of {q:?} encodes to no tokens");
            Ok(ids)
        })
        .collect()
}

/// One prompt's group of completions, scored.
#[derive(Clone, Debug)]
pub struct Group {
    /// Index of the example.
    pub example: usize,
    pub prompt: Vec<u32>,
    pub completions: Vec<Completion>,
    pub texts: Vec<String>,
    /// Reward totals after overlong shaping: what the advantages are computed from.
    pub rewards: Vec<f32>,
}

impl Group {
    pub fn truncated(&self) -> Vec<bool> {
        self.completions
            .iter()
            .map(|c| c.finish == FinishReason::Length)
            .collect()
    }
}

/// Generates `group_size` completions for each prompt in one batch and decodes them.
pub fn sample_groups<B: QerlBackend>(
    model: &CausalLm<B>,
    prompts: &[(usize, Vec<u32>)],
    group_size: usize,
    config: &GenerationConfig,
    tokenizer: &Tokenizer,
) -> Result<Vec<Group>> {
    let batch: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|(_, p)| std::iter::repeat_n(p.clone(), group_size))
        .collect();
    let out = crate::engine_rollout::generate_rows(model, &batch, config, Some(tokenizer), 0)
        .context("rollout generation")?;
    groups_of(out, prompts, group_size, config, tokenizer)
}

/// [`sample_groups`] for a slice of a global batch whose first row is `first_row`: each row
/// draws the random numbers of its global row ([`qerl_model::generate_from_row`]), so the samples
/// do not depend on how the batch is split across ranks. No stop strings.
pub fn sample_groups_at<B: QerlBackend>(
    model: &CausalLm<B>,
    prompts: &[(usize, Vec<u32>)],
    group_size: usize,
    config: &GenerationConfig,
    tokenizer: &Tokenizer,
    first_row: usize,
) -> Result<Vec<Group>> {
    let batch: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|(_, p)| std::iter::repeat_n(p.clone(), group_size))
        .collect();
    // a data-parallel rank may have no prompts this round
    let out = if batch.is_empty() {
        Vec::new()
    } else {
        crate::engine_rollout::generate_rows(model, &batch, config, None, first_row)
            .context("rollout generation")?
    };
    groups_of(out, prompts, group_size, config, tokenizer)
}

fn groups_of(
    mut out: Vec<Completion>,
    prompts: &[(usize, Vec<u32>)],
    group_size: usize,
    config: &GenerationConfig,
    tokenizer: &Tokenizer,
) -> Result<Vec<Group>> {
    let mut groups = Vec::with_capacity(prompts.len());
    for (example, prompt) in prompts {
        let completions: Vec<Completion> = out.drain(..group_size).collect();
        let texts = completions
            .iter()
            .map(|c| decode_completion(tokenizer, c, &config.stop_strings))
            .collect::<Result<Vec<_>>>()?;
        groups.push(Group {
            example: *example,
            prompt: prompt.clone(),
            completions,
            texts,
            rewards: Vec::new(),
        });
    }
    Ok(groups)
}

/// The completion's text without special tokens, cut at the first stop string.
pub fn decode_completion(tok: &Tokenizer, c: &Completion, stop: &[String]) -> Result<String> {
    let text = tok.decode_ids(&c.tokens, true)?;
    Ok(qerl_model::generate::truncate_at_stop(&text, stop).to_string())
}

/// Scores every group's texts against its example's answer; sets `group.rewards` to the
/// totals plus the overlong penalty (when `overlong_buffer > 0`). Returns the raw scores of
/// all samples, groups in order.
pub fn score_groups(
    groups: &mut [Group],
    answers: &[String],
    rewards: &RewardSet,
    max_completion_tokens: usize,
    overlong_buffer: usize,
) -> BatchScores {
    let texts: Vec<&str> = groups
        .iter()
        .flat_map(|g| g.texts.iter().map(String::as_str))
        .collect();
    let refs: Vec<&str> = groups
        .iter()
        .flat_map(|g| std::iter::repeat_n(answers[g.example].as_str(), g.texts.len()))
        .collect();
    let scores = rewards.score_batch(&texts, &refs);
    let mut offset = 0;
    for g in groups.iter_mut() {
        let n = g.texts.len();
        g.rewards = scores.totals[offset..offset + n].to_vec();
        if overlong_buffer > 0 {
            let lengths: Vec<usize> = g.completions.iter().map(|c| c.tokens.len()).collect();
            qerl_rl::advantage::apply_overlong_shaping(
                &mut g.rewards,
                &lengths,
                max_completion_tokens,
                overlong_buffer,
            );
        }
        offset += n;
    }
    scores
}

/// Concatenates the scores of several rounds (sample indices of failures shifted).
pub fn merge_scores(parts: Vec<BatchScores>) -> BatchScores {
    let mut out = BatchScores::default();
    for p in parts {
        if out.names.is_empty() {
            out.names = p.names.clone();
            out.per_reward = vec![Vec::new(); p.per_reward.len()];
        }
        let shift = out.totals.len();
        out.totals.extend(p.totals);
        for (col, v) in out.per_reward.iter_mut().zip(p.per_reward) {
            col.extend(v);
        }
        out.correct.extend(p.correct);
        out.failures.extend(p.failures.into_iter().map(|mut f| {
            f.sample += shift;
            f
        }));
    }
    out
}
