//! Pieces the trainer's integration tests share: the repository root, a learnable reward and
//! prompt-only examples.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use qerl_rl::data::Example;
use qerl_rl::reward::{Reward, RewardError};

/// The repository root (fixtures and configs live there).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Pays the fraction of the completion's characters that are ASCII digits: a task a tiny
/// random model can learn (push up the logits of a class of tokens) with a graded signal, so
/// groups are rarely flat.
pub struct Digits;

impl Reward for Digits {
    fn name(&self) -> &str {
        "digits"
    }
    fn score(&self, completion: &str, _answer: &str) -> Result<f32, RewardError> {
        let n = completion.chars().count().max(1);
        Ok(completion.chars().filter(char::is_ascii_digit).count() as f32 / n as f32)
    }
}

/// One example per question (id = its index), with the answer `answer(index)`.
pub fn examples(questions: &[&str], answer: impl Fn(usize) -> &'static str) -> Vec<Example> {
    questions
        .iter()
        .enumerate()
        .map(|(i, q)| Example {
            id: i.to_string(),
            question: q.to_string(),
            answer: answer(i).into(),
            solution: String::new(),
        })
        .collect()
}
