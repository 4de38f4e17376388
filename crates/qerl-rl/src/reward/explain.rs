//! `--explain`: what a reward read from a completion and why it matched the reference or not.

use std::fmt;

use super::gsm8k::{flexible_number, strict_candidate};
use super::math::{extract_math_answer, grade_math, last_boxed};
use super::{by_name, Gsm8kMode, Gsm8kReward, RewardError};

/// One grading decision, spelled out.
#[derive(Debug, Clone, PartialEq)]
pub struct Explanation {
    /// The reward's name.
    pub reward: String,
    /// The answer text read from the completion (`None`: no answer found).
    pub extracted: Option<String>,
    /// Where it was found (`boxed`, `answer tag`, `####`, `phrase`, `last number`, ...).
    pub source: String,
    /// The answer as the grader understood it (a parsed expression or a number).
    pub parsed: String,
    /// The reference as the grader understood it.
    pub reference: String,
    /// The score the reward gives.
    pub score: f32,
    /// Why it matched or not.
    pub reason: String,
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "reward:    {} = {}", self.reward, self.score)?;
        match &self.extracted {
            Some(e) => writeln!(f, "extracted: {e:?} ({})", self.source)?,
            None => writeln!(f, "extracted: nothing ({})", self.source)?,
        }
        writeln!(f, "parsed:    {}", self.parsed)?;
        writeln!(f, "reference: {}", self.reference)?;
        write!(f, "why:       {}", self.reason)
    }
}

/// Explains the score of the built-in reward called `reward` (see [`by_name`]).
pub fn explain(reward: &str, completion: &str, answer: &str) -> Result<Explanation, RewardError> {
    let r = by_name(reward)?;
    let name = r.name().to_string();
    let score = r.score(completion, answer);
    let mut out = match name.as_str() {
        "gsm8k" => explain_gsm8k(&Gsm8kReward::strict(), completion, answer),
        "gsm8k_flexible" => explain_gsm8k(&Gsm8kReward::flexible(), completion, answer),
        "math" => explain_math(completion, answer),
        _ => Explanation {
            reward: name.clone(),
            extracted: None,
            source: "whole completion".into(),
            parsed: String::new(),
            reference: answer.to_string(),
            score: 0.0,
            reason: "not an answer checker".into(),
        },
    };
    match score {
        Ok(s) => out.score = s,
        Err(e) => {
            out.score = 0.0;
            out.reason = e.to_string();
        }
    }
    out.reward = name;
    Ok(out)
}

fn explain_gsm8k(r: &Gsm8kReward, completion: &str, answer: &str) -> Explanation {
    let reference = match r.reference_number(answer) {
        Ok(n) => format!("{}", n.value()),
        Err(e) => e.to_string(),
    };
    let (extracted, source) = match r.mode() {
        Gsm8kMode::Strict => (
            strict_candidate(completion).map(str::to_string),
            "<answer> tag, #### line or \\boxed{}".to_string(),
        ),
        Gsm8kMode::Flexible => match flexible_number(completion) {
            Some((t, _, src)) => (Some(t), format!("{src:?}")),
            None => (None, "no number".to_string()),
        },
    };
    let number = r.extract_number(completion);
    let parsed = match &number {
        Some((_, n)) => format!("{}", n.value()),
        None if extracted.is_some() => "not exactly one number".into(),
        None => "-".into(),
    };
    let reason = match (&number, r.reference_number(answer)) {
        (Some((_, n)), Ok(g)) if n.same(&g) => "equal numbers",
        (Some(_), Ok(_)) => "different numbers",
        (None, _) => "no single number where the answer should be",
        (_, Err(_)) => "unreadable reference",
    };
    Explanation {
        reward: String::new(),
        extracted,
        source,
        parsed,
        reference,
        score: 0.0,
        reason: reason.into(),
    }
}

fn explain_math(completion: &str, answer: &str) -> Explanation {
    let reference_text = last_boxed(answer).unwrap_or(answer).trim();
    let Some((pred, source)) = extract_math_answer(completion) else {
        return Explanation {
            reward: String::new(),
            extracted: None,
            source: "no \\boxed{}, <answer> tag or answer phrase".into(),
            parsed: "-".into(),
            reference: reference_text.to_string(),
            score: 0.0,
            reason: "no answer".into(),
        };
    };
    let g = grade_math(pred, reference_text);
    let show = |r: &Result<_, super::latex::ParseError>| match r {
        Ok(e) => format!("{e}"),
        Err(err) => format!("unparsable ({err})"),
    };
    Explanation {
        reward: String::new(),
        extracted: Some(pred.to_string()),
        source: format!("{source:?}"),
        parsed: show(&g.pred),
        reference: format!("{reference_text} → {}", show(&g.reference)),
        score: 0.0,
        reason: g.reason.to_string(),
    }
}
