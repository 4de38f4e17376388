//! The tables of [`super::TrainConfig`] after `[data]`: rollout, loss, optimizer, AQN, rewards,
//! run and eval settings, with their defaults.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::LossKind;
use crate::advantage::AdvantageKind;
use crate::aqn::{AqnSchedule, SigmaSchedule};
use crate::loss::{LossAggregation, PolicyLossConfig};
use crate::optim_schedule::LrDecay;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// `G`: completions sampled per prompt.
    pub group_size: usize,
    /// Prompts per optimizer step (so `batch_prompts * group_size` completions).
    pub batch_prompts: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub max_completion_tokens: usize,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            group_size: 8,
            batch_prompts: 1,
            temperature: 1.0,
            top_p: 1.0,
            max_completion_tokens: 2048,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossConfig {
    pub kind: LossKind,
    pub eps_low: f32,
    /// Default 0.2 (`grpo`, `dr_grpo`) or 0.28 (`dapo`).
    pub eps_high: Option<f32>,
    /// KL coefficient. Default 0.04 (`grpo`) or 0 (`dapo`, `dr_grpo`).
    pub beta: Option<f32>,
    /// GRPO advantage normaliser: `(r - mean) / (std + std_eps)`.
    pub std_eps: f32,
    /// `mu`: policy updates per rollout batch (old log-probs kept across them).
    pub mu: usize,
    /// Drop groups with all-equal rewards and sample more. Default on for `dapo`.
    pub dynamic_sampling: Option<bool>,
    /// Rollout rounds allowed to fill one batch when dynamic sampling.
    pub max_sampling_rounds: usize,
    /// `L_cache` of DAPO overlong shaping, in tokens (0 = off). Default for `dapo`: a fifth of
    /// `rollout.max_completion_tokens` (DAPO: 4096 of 20480); off otherwise.
    pub overlong_buffer: Option<usize>,
    /// Exclude completions cut at the length limit from the loss. Default on for `dapo`.
    pub mask_truncated: Option<bool>,
    /// Cap `C` of truncated importance sampling between rollout and training log-probs
    /// (absent = no correction).
    pub tis_cap: Option<f32>,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            kind: LossKind::Grpo,
            eps_low: 0.2,
            eps_high: None,
            beta: None,
            std_eps: 1e-4,
            mu: 1,
            dynamic_sampling: None,
            max_sampling_rounds: 4,
            overlong_buffer: None,
            mask_truncated: None,
            tis_cap: None,
        }
    }
}

impl LossConfig {
    pub fn eps_high(&self) -> f32 {
        self.eps_high.unwrap_or(if self.kind == LossKind::Dapo {
            0.28
        } else {
            0.2
        })
    }

    pub fn beta(&self) -> f32 {
        self.beta.unwrap_or(if self.kind == LossKind::Grpo {
            0.04
        } else {
            0.0
        })
    }

    pub fn dynamic_sampling(&self) -> bool {
        self.dynamic_sampling.unwrap_or(self.kind == LossKind::Dapo)
    }

    pub fn mask_truncated(&self) -> bool {
        self.mask_truncated.unwrap_or(self.kind == LossKind::Dapo)
    }

    /// `L_cache` for a given `L_max` (0 = no overlong shaping).
    pub fn overlong_buffer(&self, max_completion_tokens: usize) -> usize {
        self.overlong_buffer
            .unwrap_or(if self.kind == LossKind::Dapo {
                max_completion_tokens / 5
            } else {
                0
            })
    }

    pub fn advantage_kind(&self) -> AdvantageKind {
        match self.kind {
            LossKind::DrGrpo => AdvantageKind::DrGrpo,
            _ => AdvantageKind::Grpo { eps: self.std_eps },
        }
    }

    /// The [`PolicyLossConfig`] for completions of at most `max_completion_tokens`.
    pub fn policy_loss(&self, max_completion_tokens: usize) -> PolicyLossConfig {
        PolicyLossConfig {
            eps_low: self.eps_low,
            eps_high: self.eps_high(),
            beta: self.beta(),
            aggregation: match self.kind {
                LossKind::Grpo => LossAggregation::SequenceMean,
                LossKind::Dapo => LossAggregation::TokenMean,
                LossKind::DrGrpo => LossAggregation::ConstantNormalizer {
                    max_len: max_completion_tokens,
                },
            },
        }
    }
}

/// AdamW, learning-rate schedule, clipping, accumulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    pub lr: f64,
    /// Warmup as a fraction of `train.steps` (rounded up).
    pub warmup_ratio: f64,
    pub lr_decay: LrDecay,
    pub min_lr_ratio: f64,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub epsilon: f32,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip: f32,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Completion tokens per chunk of the update's lm_head + log-softmax (the `[tokens, vocab]`
    /// logits are never made whole); 0 chooses it from a 2 GiB budget (320 tokens at Qwen2.5's
    /// 152k vocabulary).
    pub logprob_chunk_tokens: usize,
    /// Activation checkpointing per decoder layer in the update: keep each layer's input and
    /// recompute the layer in the backward (one more forward; the activations of one layer
    /// alive at a time instead of all of them).
    pub activation_checkpointing: bool,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-5,
            warmup_ratio: 0.1,
            lr_decay: LrDecay::Cosine,
            min_lr_ratio: 0.0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            grad_clip: 0.2,
            grad_accum: 1,
            logprob_chunk_tokens: 0,
            activation_checkpointing: true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AqnConfig {
    pub schedule: SigmaSchedule,
    pub sigma_start: f32,
    pub sigma_end: f32,
    /// `K`: number of stages, the first noise-free.
    pub num_stages: usize,
    /// Noise in rollouts only (the paper); `false` also perturbs the training forward.
    pub rollouts_only: bool,
}

impl Default for AqnConfig {
    fn default() -> Self {
        let s = AqnSchedule::default();
        Self {
            schedule: s.kind,
            sigma_start: s.sigma_start,
            sigma_end: s.sigma_end,
            num_stages: s.num_stages,
            rollouts_only: true,
        }
    }
}

impl AqnConfig {
    pub fn schedule(&self) -> AqnSchedule {
        AqnSchedule {
            kind: self.schedule,
            sigma_start: self.sigma_start,
            sigma_end: self.sigma_end,
            num_stages: self.num_stages,
        }
    }
}

/// One weighted reward of [`crate::reward::by_name`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    pub name: String,
    #[serde(default = "one")]
    pub weight: f32,
    /// This reward decides accuracy (at most one; default: the dataset's correctness reward).
    #[serde(default)]
    pub accuracy: bool,
}

fn one() -> f32 {
    1.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Optimizer steps (each: one rollout batch, `loss.mu` updates).
    pub steps: usize,
    pub seed: u64,
    pub output_dir: PathBuf,
    /// Evaluate every N steps (0 = only at the end).
    pub eval_interval: usize,
    /// Save LoRA (and norms) every N steps (0 = only at the end).
    pub ckpt_interval: usize,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            steps: 500,
            seed: 2025,
            output_dir: PathBuf::from("runs/qerl"),
            eval_interval: 0,
            ckpt_interval: 50,
        }
    }
}

/// Evaluation during training and the defaults of `qerl eval`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// `gsm8k`, `math500` or a `.jsonl` path (test split of built-ins).
    pub dataset: String,
    /// First N questions only (0 = all).
    pub limit: usize,
    /// K samples per question; pass@1 is the mean over them.
    pub samples: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub max_completion_tokens: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            dataset: "gsm8k".into(),
            limit: 0,
            samples: 1,
            temperature: 0.6,
            top_p: 0.95,
            max_completion_tokens: 2048,
        }
    }
}
