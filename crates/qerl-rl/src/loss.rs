//! The clipped policy-gradient loss of GRPO / DAPO / Dr. GRPO on burn tensors.
//!
//! Per token `t` of completion `i`, with `r = exp(logp_new - logp_old)` and advantage `A_i`:
//!
//! ```text
//! l_{i,t} = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i) * w_{i,t} + beta * KL_{i,t}
//! KL_{i,t} = exp(ref - new) - (ref - new) - 1            (k3 estimator, >= 0, unbiased)
//! ```
//!
//! `w` are optional truncated importance-sampling weights ([`truncated_is_weights`]) that
//! correct for the rollout engine's probabilities differing from the training forward's (NVFP4
//! kernels, AQN noise in rollouts only). The loss is the masked aggregate of `l`
//! ([`LossAggregation`]). `logp_old` is kept fixed over the `mu` updates of one rollout batch, so
//! from the second update on `r != 1` and clipping really acts.

use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAggregation {
    /// GRPO: mean over each sequence's tokens, then mean over sequences (long and short
    /// completions weigh the same per sequence).
    SequenceMean,
    /// DAPO: sum over every token of the batch / number of tokens (every token weighs the same).
    TokenMean,
    /// Dr. GRPO: sum over every token / (`batch * max_len`) with `max_len` a constant (the
    /// maximum completion length), removing the length bias of a per-sample normaliser.
    ConstantNormalizer { max_len: usize },
}

/// Parameters of the policy loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossConfig {
    /// Lower clip range: ratios below `1 - eps_low` are clipped (0.2).
    pub eps_low: f32,
    /// Upper clip range: ratios above `1 + eps_high` are clipped (0.2 GRPO, 0.28 DAPO).
    pub eps_high: f32,
    /// KL coefficient (0 disables the KL term; a reference is then not needed).
    pub beta: f32,
    pub aggregation: LossAggregation,
}

impl PolicyLossConfig {
    /// GRPO: eps 0.2 both sides, `beta` 0.04 (QeRL scripts' GRPO branch), sequence mean.
    pub fn grpo() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            beta: 0.04,
            aggregation: LossAggregation::SequenceMean,
        }
    }

    /// DAPO: clip-higher (0.2 / 0.28), no KL, token mean.
    pub fn dapo() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.28,
            beta: 0.0,
            aggregation: LossAggregation::TokenMean,
        }
    }

    /// Dr. GRPO: eps 0.2, no KL, constant normaliser `max_len`.
    pub fn dr_grpo(max_len: usize) -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            beta: 0.0,
            aggregation: LossAggregation::ConstantNormalizer { max_len },
        }
    }
}

/// Normaliser of the whole batch when a batch is split into micro-batches for gradient
/// accumulation: with it, the micro-batch losses **sum** to the full-batch loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GlobalNormalizer {
    /// Sequences in the whole batch.
    pub sequences: usize,
    /// Unmasked tokens in the whole batch.
    pub tokens: f32,
}

/// The tensors of one (micro-)batch. All `[batch, T]` except `advantages` `[batch]`.
#[derive(Debug, Clone)]
pub struct PolicyLossInputs<B: Backend> {
    /// Log-probabilities of the sampled tokens under the current policy (with gradient).
    pub logp_new: Tensor<B, 2>,
    /// Log-probabilities under the policy that sampled the batch, before this batch's updates
    /// (no gradient).
    pub logp_old: Tensor<B, 2>,
    /// Log-probabilities under the reference policy (needed when `beta != 0`).
    pub logp_ref: Option<Tensor<B, 2>>,
    pub advantages: Tensor<B, 1>,
    /// 1.0 on completion tokens that count, 0.0 on padding and masked completions.
    pub mask: Tensor<B, 2>,
    /// Truncated importance-sampling weights (no gradient), see [`truncated_is_weights`].
    pub is_weights: Option<Tensor<B, 2>>,
}

/// Statistics of one loss evaluation, as plain numbers (masked means over counted tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyLossStats {
    /// The loss value.
    pub loss: f32,
    /// Tokens with `A < 0` and `r < 1 - eps_low` (the clipped branch is taken).
    pub clip_frac_low: f32,
    /// Tokens with `A > 0` and `r > 1 + eps_high`.
    pub clip_frac_high: f32,
    /// Mean k3 KL to the reference (0 without a reference).
    pub mean_kl: f32,
    /// Mean probability ratio.
    pub mean_ratio: f32,
    /// Mean importance-sampling weight (1 without weights).
    pub mean_is_weight: f32,
    /// Number of counted tokens.
    pub tokens: f32,
}

/// The loss (shape `[1]`, differentiable w.r.t. `logp_new`) and its statistics.
#[derive(Debug, Clone)]
pub struct PolicyLossOutput<B: Backend> {
    pub loss: Tensor<B, 1>,
    pub stats: PolicyLossStats,
}

/// An input of the wrong shape.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("policy loss: `{input}` has shape {found:?}, expected {expected:?}")]
pub struct LossShapeError {
    pub input: &'static str,
    pub found: Vec<usize>,
    pub expected: Vec<usize>,
}

fn check_shape(
    input: &'static str,
    found: Vec<usize>,
    expected: &[usize],
) -> Result<(), LossShapeError> {
    if found == expected {
        Ok(())
    } else {
        Err(LossShapeError {
            input,
            found,
            expected: expected.to_vec(),
        })
    }
}

/// Tensor values on the host as f32 (any float dtype).
pub(crate) fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// `min(exp(logp_train - logp_rollout), cap)`, detached: truncated importance sampling between
/// the probabilities the rollout engine sampled with and the training forward's, for the same
/// policy weights. `cap` (`C`, e.g. 2.0) bounds the variance.
pub fn truncated_is_weights<B: Backend>(
    logp_train: Tensor<B, 2>,
    logp_rollout: Tensor<B, 2>,
    cap: f32,
) -> Tensor<B, 2> {
    let dtype = logp_train.dtype();
    (logp_train - logp_rollout.cast(dtype))
        .detach()
        .exp()
        .clamp_max(cap)
}

/// The policy loss of one (micro-)batch; `global` replaces the batch's own normaliser when the
/// batch is a micro-batch of a larger one.
pub fn policy_loss<B: Backend>(
    inputs: PolicyLossInputs<B>,
    config: &PolicyLossConfig,
    global: Option<GlobalNormalizer>,
) -> Result<PolicyLossOutput<B>, LossShapeError> {
    let PolicyLossInputs {
        logp_new,
        logp_old,
        logp_ref,
        advantages,
        mask,
        is_weights,
    } = inputs;
    let [b, t] = logp_new.dims();
    check_shape("logp_old", logp_old.dims().to_vec(), &[b, t])?;
    check_shape("mask", mask.dims().to_vec(), &[b, t])?;
    check_shape("advantages", advantages.dims().to_vec(), &[b])?;
    if let Some(r) = &logp_ref {
        check_shape("logp_ref", r.dims().to_vec(), &[b, t])?;
    }
    if let Some(w) = &is_weights {
        check_shape("is_weights", w.dims().to_vec(), &[b, t])?;
    }

    // Everything in `logp_new`'s dtype: burn's CubeCL backends do not promote mixed dtypes
    // (an f32 tensor minus a bf16 one reads the bf16 buffer as f32), so an f32 log-prob
    // against bf16 inputs made with the backend's default float type gives garbage.
    let dtype = logp_new.dtype();
    let (logp_old, mask, advantages) = (
        logp_old.cast(dtype),
        mask.cast(dtype),
        advantages.cast(dtype),
    );
    let logp_ref = logp_ref.map(|r| r.cast(dtype));
    let is_weights = is_weights.map(|w| w.cast(dtype));
    let adv = advantages.unsqueeze_dim::<2>(1).expand([b, t]);
    let ratio = (logp_new.clone() - logp_old.detach()).exp();
    let clipped = ratio
        .clone()
        .clamp(1.0 - config.eps_low, 1.0 + config.eps_high);
    let surrogate = (ratio.clone() * adv.clone()).min_pair(clipped * adv.clone());
    let mut per_token = surrogate.neg();
    if let Some(w) = &is_weights {
        per_token = per_token * w.clone().detach();
    }
    let kl = logp_ref.map(|r| {
        let d = r.detach() - logp_new;
        (d.clone().exp() - d).sub_scalar(1.0)
    });
    if let (Some(kl), true) = (&kl, config.beta != 0.0) {
        per_token = per_token + kl.clone().mul_scalar(config.beta);
    }

    let masked = per_token * mask.clone();
    let loss = match config.aggregation {
        LossAggregation::SequenceMean => {
            let seq_len = mask.clone().sum_dim(1).clamp_min(1.0);
            let seq_mean = masked.sum_dim(1) / seq_len;
            let n = global.map_or(b, |g| g.sequences).max(1);
            seq_mean.sum().div_scalar(n as f32)
        }
        LossAggregation::TokenMean => match global {
            Some(g) => masked.sum().div_scalar(g.tokens.max(1.0)),
            None => masked.sum() / mask.clone().sum().clamp_min(1.0),
        },
        LossAggregation::ConstantNormalizer { max_len } => {
            let n = global.map_or(b, |g| g.sequences).max(1);
            masked.sum().div_scalar((n * max_len.max(1)) as f32)
        }
    };

    // Statistics on the host: [batch, T] values are small next to the logits.
    let mask_h = host(mask);
    let ratio_h = host(ratio.detach());
    let adv_h = host(adv);
    let kl_h = kl.map(|k| host(k.detach()));
    let w_h = is_weights.map(host);
    let tokens: f32 = mask_h.iter().sum();
    let denom = tokens.max(1.0);
    let (mut low, mut high, mut kl_sum, mut ratio_sum, mut w_sum) =
        (0.0f32, 0.0f32, 0.0f32, 0.0f32, 0.0f32);
    for i in 0..mask_h.len() {
        let m = mask_h[i];
        if m == 0.0 {
            continue;
        }
        let (r, a) = (ratio_h[i], adv_h[i]);
        if a < 0.0 && r < 1.0 - config.eps_low {
            low += m;
        }
        if a > 0.0 && r > 1.0 + config.eps_high {
            high += m;
        }
        ratio_sum += m * r;
        kl_sum += kl_h.as_ref().map_or(0.0, |k| m * k[i]);
        w_sum += w_h.as_ref().map_or(m, |w| m * w[i]);
    }
    let loss_value = host(loss.clone().detach())[0];
    let stats = PolicyLossStats {
        loss: loss_value,
        clip_frac_low: low / denom,
        clip_frac_high: high / denom,
        mean_kl: kl_sum / denom,
        mean_ratio: if tokens > 0.0 { ratio_sum / denom } else { 1.0 },
        mean_is_weight: if tokens > 0.0 { w_sum / denom } else { 1.0 },
        tokens,
    };
    Ok(PolicyLossOutput { loss, stats })
}
