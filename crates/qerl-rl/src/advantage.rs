//! Group advantages and the DAPO reward-side tricks.
//!
//! Rewards come in groups of `G` completions of the same prompt, laid out group after group:
//! `rewards[g * G + i]` is completion `i` of prompt `g`.
//!
//! * [`group_advantages`]: GRPO `A = (r - mean_g) / (std_g + eps)` or Dr. GRPO `A = r - mean_g`.
//! * [`DynamicBatch`]: DAPO dynamic sampling, which drops groups whose rewards are all equal
//!   (zero advantage, zero gradient) and keeps sampling until the batch is full.
//! * [`overlong_penalty`]: DAPO soft overlong punishment.
//! * [`completion_mask`]: the `[batch, T]` loss mask, optionally masking truncated completions.

use serde::{Deserialize, Serialize};

/// Errors of the advantage helpers.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AdvantageError {
    #[error("group size must be at least 1")]
    ZeroGroupSize,
    #[error("{len} rewards do not split into groups of {group_size}")]
    Ragged { len: usize, group_size: usize },
}

/// How rewards become advantages.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AdvantageKind {
    /// `(r - mean) / (std + eps)`, std the unbiased (n-1) sample standard deviation of the group,
    /// as TRL's `GRPOTrainer` (which QeRL uses) computes it with `torch.std`; `eps` 1e-4 there.
    Grpo { eps: f32 },
    /// `r - mean` (Dr. GRPO, arXiv 2503.20783: no std normalisation).
    DrGrpo,
}

impl Default for AdvantageKind {
    fn default() -> Self {
        AdvantageKind::Grpo { eps: 1e-4 }
    }
}

fn check(len: usize, group_size: usize) -> Result<(), AdvantageError> {
    if group_size == 0 {
        return Err(AdvantageError::ZeroGroupSize);
    }
    if len % group_size != 0 {
        return Err(AdvantageError::Ragged { len, group_size });
    }
    Ok(())
}

/// Mean and unbiased standard deviation of each group (`std` = 0 for a group of one).
pub fn group_stats(rewards: &[f32], group_size: usize) -> Result<Vec<(f32, f32)>, AdvantageError> {
    check(rewards.len(), group_size)?;
    Ok(rewards
        .chunks(group_size)
        .map(|g| {
            let n = g.len() as f64;
            let mean = g.iter().map(|&r| r as f64).sum::<f64>() / n;
            let var = if g.len() > 1 {
                g.iter().map(|&r| (r as f64 - mean).powi(2)).sum::<f64>() / (n - 1.0)
            } else {
                0.0
            };
            (mean as f32, var.sqrt() as f32)
        })
        .collect())
}

/// Per-completion advantages `[n]` from rewards `[n]` (`n = groups * group_size`).
pub fn group_advantages(
    rewards: &[f32],
    group_size: usize,
    kind: AdvantageKind,
) -> Result<Vec<f32>, AdvantageError> {
    let stats = group_stats(rewards, group_size)?;
    Ok(rewards
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            let (mean, std) = stats[i / group_size];
            match kind {
                AdvantageKind::Grpo { eps } => (r - mean) / (std + eps),
                AdvantageKind::DrGrpo => r - mean,
            }
        })
        .collect())
}

/// Whether all rewards of a group are equal (within 1e-6): such a group has zero advantage
/// everywhere and contributes no policy gradient.
pub fn is_flat_group(group: &[f32]) -> bool {
    group.windows(2).all(|w| (w[0] - w[1]).abs() <= 1e-6)
}

/// Fraction of groups whose rewards are all equal (a metric, and what dynamic sampling drops).
pub fn zero_std_fraction(rewards: &[f32], group_size: usize) -> Result<f32, AdvantageError> {
    check(rewards.len(), group_size)?;
    let groups = rewards.len() / group_size;
    if groups == 0 {
        return Ok(0.0);
    }
    let flat = rewards
        .chunks(group_size)
        .filter(|g| is_flat_group(g))
        .count();
    Ok(flat as f32 / groups as f32)
}

/// Indices of the groups to keep (rewards not all equal) and the number dropped.
pub fn filter_groups(
    rewards: &[f32],
    group_size: usize,
) -> Result<(Vec<usize>, usize), AdvantageError> {
    check(rewards.len(), group_size)?;
    let mut keep = Vec::new();
    let mut dropped = 0;
    for (g, chunk) in rewards.chunks(group_size).enumerate() {
        if is_flat_group(chunk) {
            dropped += 1;
        } else {
            keep.push(g);
        }
    }
    Ok((keep, dropped))
}

/// Counters of a [`DynamicBatch`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamicSamplingStats {
    /// Groups offered (sampled).
    pub offered: usize,
    /// Groups kept.
    pub kept: usize,
    /// Groups dropped because their rewards were all equal.
    pub dropped_flat: usize,
    /// Kept groups beyond the target, discarded when the batch was taken.
    pub overflow: usize,
    /// Sampling rounds ([`DynamicBatch::offer_round`] calls).
    pub rounds: usize,
}

/// DAPO dynamic sampling: collects groups with informative (not all equal) rewards until
/// `target_groups` are in, across as many rollout rounds as it takes.
///
/// `T` is whatever the caller keeps per group (token ids, old log-probs, ...). Typical loop:
/// `while !batch.is_full() && batch.stats().rounds < max_rounds { batch.offer_round(sample()) }`,
/// then `batch.take()`. When the round limit is hit first, `take` returns the partial batch.
#[derive(Debug, Clone)]
pub struct DynamicBatch<T> {
    group_size: usize,
    target_groups: usize,
    groups: Vec<(T, Vec<f32>)>,
    stats: DynamicSamplingStats,
}

impl<T> DynamicBatch<T> {
    /// An empty batch that wants `target_groups` groups of `group_size` rewards.
    pub fn new(group_size: usize, target_groups: usize) -> Self {
        Self {
            group_size,
            target_groups,
            groups: Vec::with_capacity(target_groups),
            stats: DynamicSamplingStats::default(),
        }
    }

    /// Offers one group; returns whether it was kept. Groups of the wrong size are a caller bug.
    ///
    /// # Panics
    /// When `rewards.len() != group_size`.
    pub fn offer(&mut self, payload: T, rewards: Vec<f32>) -> bool {
        assert_eq!(
            rewards.len(),
            self.group_size,
            "DynamicBatch: group of the wrong size"
        );
        self.stats.offered += 1;
        if is_flat_group(&rewards) {
            self.stats.dropped_flat += 1;
            return false;
        }
        self.stats.kept += 1;
        if self.groups.len() >= self.target_groups {
            self.stats.overflow += 1;
            return true;
        }
        self.groups.push((payload, rewards));
        true
    }

    /// Offers every group of one rollout round; returns how many were kept.
    pub fn offer_round(&mut self, groups: impl IntoIterator<Item = (T, Vec<f32>)>) -> usize {
        self.stats.rounds += 1;
        groups
            .into_iter()
            .map(|(p, r)| self.offer(p, r) as usize)
            .sum()
    }

    /// Whether `target_groups` groups are in.
    pub fn is_full(&self) -> bool {
        self.groups.len() >= self.target_groups
    }

    /// Groups collected so far.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether no group was kept yet.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The counters.
    pub fn stats(&self) -> DynamicSamplingStats {
        self.stats
    }

    /// The collected groups (at most `target_groups`, in arrival order) and the counters.
    pub fn take(self) -> (Vec<(T, Vec<f32>)>, DynamicSamplingStats) {
        (self.groups, self.stats)
    }
}

/// DAPO soft overlong punishment (DAPO paper, arXiv 2503.14476, Eq. 13), added to the reward:
///
/// ```text
///   0                                    if len <= max_len - cache
///   ((max_len - cache) - len) / cache    if max_len - cache < len <= max_len   (0 .. -1, linear)
///  -1                                    if len > max_len
/// ```
///
/// `max_len` is `L_max` (the maximum completion length), `cache` is `L_cache` (the buffer).
/// With `cache = 0` only lengths beyond `max_len` are punished.
pub fn overlong_penalty(len: usize, max_len: usize, cache: usize) -> f32 {
    let cache = cache.min(max_len);
    let soft_start = max_len - cache;
    if len <= soft_start {
        0.0
    } else if len <= max_len {
        -((len - soft_start) as f32) / cache as f32
    } else {
        -1.0
    }
}

/// Adds [`overlong_penalty`] to each reward in place (`lengths[i]` = completion tokens of
/// sample `i`).
pub fn apply_overlong_shaping(
    rewards: &mut [f32],
    lengths: &[usize],
    max_len: usize,
    cache: usize,
) {
    assert_eq!(rewards.len(), lengths.len(), "one length per reward");
    for (r, &l) in rewards.iter_mut().zip(lengths) {
        *r += overlong_penalty(l, max_len, cache);
    }
}

/// The loss mask `[batch * max_len]` (row-major `[batch, max_len]`): 1.0 on the first
/// `lengths[i]` positions of row `i`, 0.0 after. With `mask_truncated`, rows whose completion
/// was cut at the length limit (`truncated[i]`, no EOS) are all 0, so they neither push nor
/// pull the policy (DAPO, "overlong filtering"); they still count in group statistics.
pub fn completion_mask(
    lengths: &[usize],
    truncated: &[bool],
    max_len: usize,
    mask_truncated: bool,
) -> Vec<f32> {
    assert_eq!(
        lengths.len(),
        truncated.len(),
        "one truncation flag per completion"
    );
    let mut mask = vec![0.0f32; lengths.len() * max_len];
    for (i, (&len, &cut)) in lengths.iter().zip(truncated).enumerate() {
        if mask_truncated && cut {
            continue;
        }
        mask[i * max_len..i * max_len + len.min(max_len)].fill(1.0);
    }
    mask
}
