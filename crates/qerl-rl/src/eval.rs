//! Evaluation scoring: strict and flexible verdicts per sample and pass@1 over K samples.
//!
//! `qerl eval` samples K completions per question (temperature 0.6, top-p 0.95 by default, the
//! paper's evaluation setting) and reports pass@1 as the mean correctness over all K samples of
//! all questions, once with strict extraction (the answer where the format says it must be) and
//! once with flexible extraction (anywhere reasonable), so format failures and reasoning
//! failures can be told apart.

use serde::{Deserialize, Serialize};

use crate::data::DatasetKind;
use crate::reward::{
    extract_answer_tag, last_boxed, last_number, math_equiv, Gsm8kReward, Math500Reward, Reward,
};

/// The verdicts on one completion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub strict: bool,
    pub flexible: bool,
    /// What strict extraction read (`None`: nothing where the format requires it).
    pub strict_answer: Option<String>,
    /// What flexible extraction read.
    pub flexible_answer: Option<String>,
}

/// Judges one completion against a reference answer of a dataset kind.
///
/// * GSM8K: strict = [`Gsm8kReward::strict`] (`<answer>` / `####`), flexible = last number.
/// * MATH-500 and JSONL: strict = the last `\boxed{}` or `<answer>` content
///   ([`Math500Reward`]); flexible = that, else the last number of the text, compared with
///   [`math_equiv`].
///
/// A reference the checker cannot read makes both verdicts false.
pub fn judge(kind: DatasetKind, completion: &str, answer: &str) -> Verdict {
    match kind {
        DatasetKind::Gsm8k => {
            let (s, f) = (Gsm8kReward::strict(), Gsm8kReward::flexible());
            Verdict {
                strict: s.score(completion, answer).unwrap_or(0.0) >= 0.5,
                flexible: f.score(completion, answer).unwrap_or(0.0) >= 0.5,
                strict_answer: s.extract(completion),
                flexible_answer: f.extract(completion),
            }
        }
        DatasetKind::Math500 | DatasetKind::Jsonl => {
            let reference = last_boxed(answer).unwrap_or(answer);
            let strict_answer = Math500Reward::extract(completion).map(str::to_string);
            let flexible_answer = strict_answer.clone().or_else(|| {
                extract_answer_tag(completion)
                    .map(str::to_string)
                    .or_else(|| last_number(completion))
            });
            let ok = |a: &Option<String>| a.as_deref().is_some_and(|a| math_equiv(a, reference));
            Verdict {
                strict: ok(&strict_answer),
                flexible: ok(&flexible_answer),
                strict_answer,
                flexible_answer,
            }
        }
    }
}

/// Running pass@1 tallies over questions with K samples each.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PassAtOne {
    /// Questions seen.
    pub questions: usize,
    /// Samples seen.
    pub samples: usize,
    pub strict_correct: usize,
    pub flexible_correct: usize,
    /// Questions with at least one strictly correct sample (pass@K, strict).
    pub any_strict: usize,
}

impl PassAtOne {
    /// Adds one question's verdicts (its K samples).
    pub fn add_question(&mut self, verdicts: &[Verdict]) {
        self.questions += 1;
        self.samples += verdicts.len();
        let s = verdicts.iter().filter(|v| v.strict).count();
        self.strict_correct += s;
        self.flexible_correct += verdicts.iter().filter(|v| v.flexible).count();
        self.any_strict += (s > 0) as usize;
    }

    /// pass@1 with strict extraction: mean correctness over all samples.
    pub fn strict(&self) -> f64 {
        self.strict_correct as f64 / self.samples.max(1) as f64
    }

    /// pass@1 with flexible extraction.
    pub fn flexible(&self) -> f64 {
        self.flexible_correct as f64 / self.samples.max(1) as f64
    }

    /// Fraction of questions with at least one strictly correct sample.
    pub fn pass_at_k_strict(&self) -> f64 {
        self.any_strict as f64 / self.questions.max(1) as f64
    }
}
