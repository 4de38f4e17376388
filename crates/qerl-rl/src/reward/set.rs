//! [`RewardSet`]: weighted rewards, per-sample failure isolation, batch statistics.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::{Reward, RewardError};

struct Weighted {
    reward: Box<dyn Reward>,
    weight: f32,
}

/// A weighted sum of rewards. One of them may be marked as the *accuracy* reward: a sample is
/// correct when that reward's own (unweighted) score is at least 0.5.
///
/// Scoring never fails: an `Err`, a panic or a non-finite value from one reward on one sample
/// scores 0 for that (reward, sample) and is recorded as a [`RewardFailure`].
#[derive(Default)]
pub struct RewardSet {
    rewards: Vec<Weighted>,
    accuracy: Option<usize>,
}

/// One reward that failed on one sample.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardFailure {
    /// Index of the sample in the batch.
    pub sample: usize,
    /// Name of the reward.
    pub reward: String,
    /// The error or panic message.
    pub message: String,
}

/// Scores of one sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleScore {
    /// Weighted sum of the rewards.
    pub total: f32,
    /// Each reward's own score (unweighted), in the set's order; 0 where it failed.
    pub per_reward: Vec<f32>,
    /// Whether the accuracy reward scored it correct (`None` without an accuracy reward).
    pub correct: Option<bool>,
    /// `(reward, message)` for each reward that failed on this sample.
    pub failures: Vec<(String, String)>,
}

/// Scores of a batch of samples.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchScores {
    /// Reward names, in the set's order.
    pub names: Vec<String>,
    /// Weighted total per sample, `[n]`.
    pub totals: Vec<f32>,
    /// Unweighted score per reward per sample, `[rewards][n]`.
    pub per_reward: Vec<Vec<f32>>,
    /// Correctness per sample (empty without an accuracy reward).
    pub correct: Vec<bool>,
    /// Every failure, in sample order.
    pub failures: Vec<RewardFailure>,
}

/// Mean and population standard deviation (0, 0 for an empty slice).
pub(crate) fn mean_std(xs: &[f32]) -> (f32, f32) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean as f32, var.sqrt() as f32)
}

impl BatchScores {
    /// Mean and (population) standard deviation of the totals.
    pub fn total_mean_std(&self) -> (f32, f32) {
        mean_std(&self.totals)
    }

    /// `(name, mean, std)` of each reward's unweighted scores.
    pub fn per_reward_mean_std(&self) -> Vec<(String, f32, f32)> {
        self.names
            .iter()
            .zip(&self.per_reward)
            .map(|(n, s)| {
                let (m, sd) = mean_std(s);
                (n.clone(), m, sd)
            })
            .collect()
    }

    /// Fraction of correct samples (`None` without an accuracy reward or samples).
    pub fn accuracy(&self) -> Option<f32> {
        (!self.correct.is_empty())
            .then(|| self.correct.iter().filter(|&&c| c).count() as f32 / self.correct.len() as f32)
    }

    /// Number of (reward, sample) failures.
    pub fn failure_count(&self) -> usize {
        self.failures.len()
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

impl RewardSet {
    /// An empty set (scores every sample 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a reward with a weight (builder style).
    pub fn with(mut self, reward: impl Reward + 'static, weight: f32) -> Self {
        self.push(Box::new(reward), weight);
        self
    }

    /// Adds a boxed reward with a weight.
    pub fn push(&mut self, reward: Box<dyn Reward>, weight: f32) {
        self.rewards.push(Weighted { reward, weight });
    }

    /// Marks the reward called `name` as the one deciding correctness (accuracy, pass@1).
    pub fn with_accuracy(mut self, name: &str) -> Result<Self, RewardError> {
        let idx = self
            .rewards
            .iter()
            .position(|w| w.reward.name() == name)
            .ok_or_else(|| RewardError::Unknown(format!("{name} (not in this reward set)")))?;
        self.accuracy = Some(idx);
        Ok(self)
    }

    /// Builds a set from `(name, weight)` pairs of built-in rewards ([`super::by_name`]),
    /// with `accuracy` (if any) marked as the accuracy reward.
    pub fn from_names(
        rewards: &[(String, f32)],
        accuracy: Option<&str>,
    ) -> Result<Self, RewardError> {
        let mut set = Self::new();
        for (name, weight) in rewards {
            set.push(super::by_name(name)?, *weight);
        }
        match accuracy {
            Some(a) => set.with_accuracy(a),
            None => Ok(set),
        }
    }

    /// QeRL's GSM8K rewards (`qerl.py`, `get_dataset("gsm8k")`): format 0.2 + correctness 2.0
    /// (their `soft_format_reward_func` returns 0.2, `correctness_reward_func` 2.0), accuracy
    /// from `gsm8k`.
    pub fn gsm8k() -> Self {
        Self::new()
            .with(super::FormatReward::think_answer(), 0.2)
            .with(super::Gsm8kReward::strict(), 2.0)
            .with_accuracy("gsm8k")
            .expect("gsm8k is in the set")
    }

    /// MATH rewards in the same shape as QeRL's BigMath setting (format 0.2 + accuracy 1.0),
    /// accuracy from `math`.
    pub fn math() -> Self {
        Self::new()
            .with(super::FormatReward::think_answer(), 0.2)
            .with(super::Math500Reward::new(), 1.0)
            .with_accuracy("math")
            .expect("math is in the set")
    }

    /// Reward names, in order.
    pub fn names(&self) -> Vec<String> {
        self.rewards
            .iter()
            .map(|w| w.reward.name().to_string())
            .collect()
    }

    /// Weights, in order.
    pub fn weights(&self) -> Vec<f32> {
        self.rewards.iter().map(|w| w.weight).collect()
    }

    /// Number of rewards.
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    /// Whether the set has no reward.
    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }

    /// Scores one sample; never fails (see the type's docs).
    pub fn score(&self, completion: &str, answer: &str) -> SampleScore {
        let mut per_reward = Vec::with_capacity(self.rewards.len());
        let mut failures = Vec::new();
        let mut total = 0.0f32;
        for w in &self.rewards {
            let result = catch_unwind(AssertUnwindSafe(|| w.reward.score(completion, answer)));
            let value = match result {
                Ok(Ok(v)) if v.is_finite() => v,
                Ok(Ok(v)) => {
                    failures.push((w.reward.name().to_string(), format!("non-finite score {v}")));
                    0.0
                }
                Ok(Err(e)) => {
                    failures.push((w.reward.name().to_string(), e.to_string()));
                    0.0
                }
                Err(payload) => {
                    failures.push((w.reward.name().to_string(), panic_message(payload.as_ref())));
                    0.0
                }
            };
            total += w.weight * value;
            per_reward.push(value);
        }
        let correct = self.accuracy.map(|i| per_reward[i] >= 0.5);
        SampleScore {
            total,
            per_reward,
            correct,
            failures,
        }
    }

    /// Scores `completions[i]` against `answers[i]` for every `i`.
    ///
    /// # Panics
    /// When the two slices differ in length (a caller bug, not a data problem).
    pub fn score_batch<C: AsRef<str>, A: AsRef<str>>(
        &self,
        completions: &[C],
        answers: &[A],
    ) -> BatchScores {
        assert_eq!(
            completions.len(),
            answers.len(),
            "score_batch: {} completions but {} answers",
            completions.len(),
            answers.len()
        );
        let mut out = BatchScores {
            names: self.names(),
            per_reward: vec![Vec::with_capacity(completions.len()); self.rewards.len()],
            ..Default::default()
        };
        for (i, (c, a)) in completions.iter().zip(answers).enumerate() {
            let s = self.score(c.as_ref(), a.as_ref());
            out.totals.push(s.total);
            for (col, v) in out.per_reward.iter_mut().zip(&s.per_reward) {
                col.push(*v);
            }
            if let Some(c) = s.correct {
                out.correct.push(c);
            }
            out.failures.extend(
                s.failures
                    .into_iter()
                    .map(|(reward, message)| RewardFailure {
                        sample: i,
                        reward,
                        message,
                    }),
            );
        }
        out
    }
}
