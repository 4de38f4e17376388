//! The built-in rewards: GSM8K, MATH-500 and format.

use regex::Regex;

use super::extract::{extract_answer_tag, gsm8k_reference_answer};
use super::gsm8k::{flexible_number, single_number, strict_candidate, GsmNumber};
use super::math::{extract_math_answer, last_boxed, math_equiv};
use super::{Reward, RewardError};

/// How [`Gsm8kReward`] finds the model's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gsm8kMode {
    /// The content of the last `<answer>…</answer>` if any, else the text after the last `####`,
    /// else the last `\boxed{…}`; a `####` or `\boxed{…}` inside the tag is honoured. The
    /// candidate must hold exactly one number (bold, `$`, commas, units and trailing words
    /// around it are fine: `#### **540**`, `#### 100 dollars`).
    Strict,
    /// The last `\boxed{…}` holding one number, else the first number after the last "the
    /// answer is" / "Answer:", else the strict candidate, else the last number anywhere
    /// (lm-eval's "flexible-extract").
    Flexible,
}

/// GSM8K correctness: 1.0 when the extracted number equals the reference, else 0.0.
///
/// Numbers compare exactly as decimals or fractions after removing commas, `$`, `%`, bold and
/// units: `"$1,000."` is 1000 and `"18.0"` is 18; a number too large for `f64` equals nothing.
/// The reference may be a bare answer (`"18"`) or a full GSM8K solution ending in `#### 18`.
#[derive(Debug, Clone)]
pub struct Gsm8kReward {
    mode: Gsm8kMode,
    name: String,
}

impl Gsm8kReward {
    /// Strict extraction, named `gsm8k`.
    pub fn strict() -> Self {
        Self {
            mode: Gsm8kMode::Strict,
            name: "gsm8k".into(),
        }
    }

    /// Flexible extraction, named `gsm8k_flexible`.
    pub fn flexible() -> Self {
        Self {
            mode: Gsm8kMode::Flexible,
            name: "gsm8k_flexible".into(),
        }
    }

    /// The extraction mode.
    pub fn mode(&self) -> Gsm8kMode {
        self.mode
    }

    /// The answer text this reward reads from a completion, if any: the strict candidate
    /// (before number parsing), or the flexible number.
    pub fn extract(&self, completion: &str) -> Option<String> {
        match self.mode {
            Gsm8kMode::Strict => strict_candidate(completion).map(str::to_string),
            Gsm8kMode::Flexible => flexible_number(completion).map(|(text, _, _)| text),
        }
    }

    /// The number this reward reads from a completion, with its spelling.
    pub fn extract_number(&self, completion: &str) -> Option<(String, GsmNumber)> {
        match self.mode {
            Gsm8kMode::Strict => strict_candidate(completion).and_then(single_number),
            Gsm8kMode::Flexible => flexible_number(completion).map(|(t, n, _)| (t, n)),
        }
    }

    /// The reference number of `answer` (a bare answer or a solution ending in `#### N`).
    pub fn reference_number(&self, answer: &str) -> Result<GsmNumber, RewardError> {
        let bad = |reason: &str| RewardError::BadReference {
            reward: self.name.clone(),
            answer: answer.to_string(),
            reason: reason.to_string(),
        };
        let reference = gsm8k_reference_answer(answer).ok_or_else(|| bad("empty"))?;
        single_number(&reference)
            .map(|(_, n)| n)
            .ok_or_else(|| bad("not a number"))
    }
}

impl Reward for Gsm8kReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, completion: &str, answer: &str) -> Result<f32, RewardError> {
        let reference = self.reference_number(answer)?;
        Ok(match self.extract_number(completion) {
            Some((_, n)) if n.same(&reference) => 1.0,
            _ => 0.0,
        })
    }
}

/// MATH-500 correctness: 1.0 when the completion's final answer (the last `\boxed{…}`, else
/// the last `<answer>…</answer>`, else what follows "the answer is" / "Answer:") is
/// [`math_equiv`] to the reference, else 0.0.
///
/// The reference is the dataset's `answer` field; a full solution containing `\boxed{…}` works
/// too (its last box is used).
#[derive(Debug, Clone, Default)]
pub struct Math500Reward;

impl Math500Reward {
    /// The reward, named `math`.
    pub fn new() -> Self {
        Self
    }

    /// The answer where the format puts it: the last `\boxed{…}`, else the last `<answer>`
    /// tag (the strict verdict of `qerl eval`). Scoring also reads an answer phrase
    /// ([`extract_math_answer`]).
    pub fn extract(completion: &str) -> Option<&str> {
        last_boxed(completion).or_else(|| {
            let tag = extract_answer_tag(completion)?;
            Some(last_boxed(tag).unwrap_or(tag))
        })
    }
}

impl Reward for Math500Reward {
    fn name(&self) -> &str {
        "math"
    }

    fn score(&self, completion: &str, answer: &str) -> Result<f32, RewardError> {
        let reference = last_boxed(answer).unwrap_or(answer).trim();
        if reference.is_empty() {
            return Err(RewardError::BadReference {
                reward: "math".into(),
                answer: answer.to_string(),
                reason: "empty".into(),
            });
        }
        Ok(match extract_math_answer(completion) {
            Some((pred, _)) if math_equiv(pred, reference) => 1.0,
            _ => 0.0,
        })
    }
}

/// 1.0 when the completion contains a match of a regular expression, else 0.0; the reference
/// answer is ignored.
#[derive(Debug, Clone)]
pub struct FormatReward {
    name: String,
    pattern: Regex,
}

impl FormatReward {
    /// A format reward named `name` for `pattern` (Rust `regex` syntax; use `(?s)` for `.` to
    /// cross lines).
    pub fn new(name: &str, pattern: &str) -> Result<Self, RewardError> {
        let pattern = Regex::new(pattern).map_err(|source| RewardError::Pattern {
            name: name.to_string(),
            source,
        })?;
        Ok(Self {
            name: name.to_string(),
            pattern,
        })
    }

    /// QeRL's GSM8K format check (their `soft_format_reward_func`): a `<think>…</think>` block
    /// followed, after optional whitespace, by an `<answer>…</answer>` block. Named `format`.
    pub fn think_answer() -> Self {
        Self::new("format", r"(?s)<think>.*?</think>\s*<answer>.*?</answer>")
            .expect("valid pattern")
    }

    /// A `\boxed{` somewhere in the completion. Named `format_boxed`.
    pub fn boxed() -> Self {
        Self::new("format_boxed", r"\\boxed\s*\{").expect("valid pattern")
    }
}

impl Reward for FormatReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, completion: &str, _answer: &str) -> Result<f32, RewardError> {
        Ok(if self.pattern.is_match(completion) {
            1.0
        } else {
            0.0
        })
    }
}

/// The completion's length in characters over `per_point`, capped at 1; the reference answer
/// is ignored. Not a task reward: a toy one (like TRL's quickstart `reward_len`) that varies on
/// any text, so a timing run on a random model, whose completions no checker accepts, still
/// has groups with reward variance and real gradients. Named `length`.
#[derive(Debug, Clone)]
pub struct LengthReward {
    per_point: usize,
}

impl LengthReward {
    /// Full reward at 1000 characters.
    pub fn new() -> Self {
        Self { per_point: 1000 }
    }
}

impl Default for LengthReward {
    fn default() -> Self {
        Self::new()
    }
}

impl Reward for LengthReward {
    fn name(&self) -> &str {
        "length"
    }

    fn score(&self, completion: &str, _answer: &str) -> Result<f32, RewardError> {
        let chars = completion.chars().count();
        Ok((chars as f32 / self.per_point as f32).min(1.0))
    }
}
