//! Verifiable rewards.
//!
//! A [`Reward`] scores one completion against one reference answer. The built-in checkers return
//! 1.0 (right / well-formed) or 0.0; scale lives in the weights of a [`RewardSet`], which sums
//! the weighted scores and turns any error or panic of one reward on one sample into a score of
//! 0 for that sample, counted in [`BatchScores::failures`], so a malformed sample never stops a
//! run.
//!
//! Checkers:
//! * [`Gsm8kReward`]: strict (`<answer>…</answer>`, `#### N` or a final `\boxed{N}`) or
//!   flexible (boxed, "the answer is", marker, last number); the answer must hold exactly one
//!   number, which compares exactly (see [`gsm8k`]).
//! * [`Math500Reward`]: last `\boxed{…}`, `<answer>` content or "the answer is …", parsed
//!   into an expression ([`latex`]) and compared structurally and numerically: fractions in
//!   any spelling, roots, `\pi`, powers, implicit products, units, percent, thousands
//!   separators, bases, intervals, tuples, sets, matrices, equations, choice letters.
//! * [`FormatReward`]: a regular expression the completion must contain, e.g. QeRL's
//!   `<think>…</think> <answer>…</answer>` layout.
//! * [`LengthReward`]: a toy reward (characters / 1000) for timing runs on random models.
//!
//! [`explain`] says what a reward extracted and why it matched or not. `docs/rewards.md`
//! lists what the graders accept.

mod checkers;
mod explain;
mod extract;
pub mod gsm8k;
pub mod latex;
mod math;
mod normalize;
mod set;

pub use checkers::{FormatReward, Gsm8kMode, Gsm8kReward, LengthReward, Math500Reward};
pub use explain::{explain, Explanation};
pub use extract::{
    extract_answer_tag, extract_hash_answer, gsm8k_reference_answer, last_number,
    normalize_number_text, numbers_equal, parse_number,
};
pub use math::{
    answer_after_phrase, extract_math_answer, grade_math, last_boxed, math_equiv,
    parse_math_number, AnswerSource, MathGrade,
};
pub use normalize::normalize_math_answer;
pub use set::{BatchScores, RewardFailure, RewardSet, SampleScore};

/// Why a reward could not score a sample. A [`RewardSet`] turns these into a score of 0.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The reference answer could not be understood (empty, not a number for GSM8K, ...).
    #[error("reward `{reward}`: bad reference answer {answer:?}: {reason}")]
    BadReference {
        reward: String,
        answer: String,
        reason: String,
    },
    /// A reward name that [`by_name`] does not know.
    #[error(
        "unknown reward `{0}` (known: gsm8k, gsm8k_flexible, math, format, format_boxed, length)"
    )]
    Unknown(String),
    /// A [`FormatReward`] pattern that does not compile.
    #[error("reward `{name}`: bad regular expression: {source}")]
    Pattern {
        name: String,
        #[source]
        source: regex::Error,
    },
    /// Any other failure of a custom reward.
    #[error("reward `{reward}`: {message}")]
    Other { reward: String, message: String },
}

/// A verifiable reward: a score for one completion given the reference answer.
///
/// `answer` is what the dataset loader put in [`crate::data::Example::answer`] (the final answer,
/// e.g. `"18"` for GSM8K or `"\frac{1}{2}"` for MATH-500). Implementations must be cheap and
/// thread-safe; return `Err` (or even panic) on inputs they cannot handle: [`RewardSet`] scores
/// such a sample 0 and counts it.
pub trait Reward: Send + Sync {
    /// Name used in metrics (`reward/<name>`) and in configs.
    fn name(&self) -> &str;
    /// Score of `completion` against the reference `answer`.
    fn score(&self, completion: &str, answer: &str) -> Result<f32, RewardError>;
}

/// A built-in reward by its config name:
///
/// | name | reward |
/// | --- | --- |
/// | `gsm8k` | [`Gsm8kReward::strict`] |
/// | `gsm8k_flexible` | [`Gsm8kReward::flexible`] |
/// | `math` (or `math500`) | [`Math500Reward`] |
/// | `format` | [`FormatReward::think_answer`] |
/// | `format_boxed` | [`FormatReward::boxed`] |
/// | `length` | [`LengthReward`] (a toy, for timing runs on random models) |
pub fn by_name(name: &str) -> Result<Box<dyn Reward>, RewardError> {
    Ok(match name {
        "gsm8k" | "gsm8k_strict" => Box::new(Gsm8kReward::strict()),
        "gsm8k_flexible" => Box::new(Gsm8kReward::flexible()),
        "math" | "math500" => Box::new(Math500Reward::new()),
        "format" | "format_think_answer" => Box::new(FormatReward::think_answer()),
        "format_boxed" => Box::new(FormatReward::boxed()),
        "length" => Box::new(LengthReward::new()),
        other => return Err(RewardError::Unknown(other.to_string())),
    })
}
