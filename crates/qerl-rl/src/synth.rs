//! Synthetic GSM8K-style word problems: the corpus of the small model the project trains itself.
//!
//! A problem follows one quantity through one to four arithmetic steps (add, subtract, multiply,
//! divide exactly), each told as a sentence; the solution writes one line per step in GSM8K's
//! style (`5 + 3 = <<5+3=8>>8`) and ends with `#### N`, so the GSM8K reward and loader read it
//! as they read the real dataset.
//!
//! Splits are disjoint by construction, whatever the seeds: a problem belongs to the test split
//! when a hash of its question text falls in the test bucket, and generation for one split skips
//! problems of the other.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::data::Split;

/// Difficulty knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SynthConfig {
    /// Fewest and most arithmetic steps per problem.
    pub min_steps: usize,
    pub max_steps: usize,
    /// Largest starting quantity and largest operand of + and −.
    pub max_operand: u32,
    /// Largest factor of × and divisor of ÷.
    pub max_factor: u32,
    /// Whether × and ÷ steps appear.
    pub multiplicative: bool,
    /// One problem in `test_every` belongs to the test split.
    pub test_every: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            min_steps: 1,
            max_steps: 4,
            max_operand: 20,
            max_factor: 5,
            multiplicative: true,
            test_every: 10,
        }
    }
}

/// A generated problem, in the GSM8K JSONL layout (`question`, `answer` = solution + `#### N`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SynthProblem {
    pub question: String,
    pub answer: String,
    /// The final number (also after `####` in `answer`).
    pub result: u64,
    /// Arithmetic steps.
    pub steps: usize,
}

const NAMES: [&str; 12] = [
    "Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kiri",
    "Lena",
];
const ITEMS: [&str; 12] = [
    "apples", "marbles", "stickers", "books", "shells", "coins", "pencils", "cards", "stamps",
    "cookies", "beads", "tickets",
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
}

/// One step's sentence, its solution line and the new quantity; `None` if `op` does not apply
/// (a result below zero, or a division with a remainder).
fn step(op: Op, name: &str, item: &str, cur: u64, b: u64) -> Option<(String, String, u64)> {
    let (sentence, next, sym) = match op {
        Op::Add => (format!("Then {name} gets {b} more {item}."), cur + b, '+'),
        Op::Sub if b <= cur => (format!("Then {name} gives away {b} {item}."), cur - b, '-'),
        Op::Mul => (
            format!("Then the number of {item} {name} has grows {b} times."),
            cur * b,
            '*',
        ),
        Op::Div if b > 1 && cur % b == 0 => (
            format!("Then {name} shares the {item} equally with friends in {b} groups and keeps one group."),
            cur / b,
            '/',
        ),
        _ => return None,
    };
    let line = format!("{cur} {sym} {b} = <<{cur}{sym}{b}={next}>>{next}");
    Some((sentence, line, next))
}

impl SynthProblem {
    /// The solution without its working: the final `#### N` line alone.
    pub fn shortcut_answer(&self) -> String {
        format!("#### {}", self.result)
    }
}

/// Whether a completion answers without working: it starts with the final `####` line.
pub fn is_shortcut(completion: &str) -> bool {
    completion.trim_start().starts_with("####")
}

/// Fraction of `completions` that answer without working ([`is_shortcut`]); 0 for none.
pub fn shortcut_share(completions: &[&str]) -> f64 {
    let n = completions.iter().filter(|c| is_shortcut(c)).count();
    n as f64 / completions.len().max(1) as f64
}

/// Draws one problem (either split).
pub fn draw(rng: &mut impl Rng, cfg: &SynthConfig) -> SynthProblem {
    let name = NAMES[rng.random_range(0..NAMES.len())];
    let item = ITEMS[rng.random_range(0..ITEMS.len())];
    let steps = rng.random_range(cfg.min_steps.max(1)..=cfg.max_steps.max(cfg.min_steps.max(1)));
    let start = rng.random_range(1..=cfg.max_operand.max(1)) as u64;
    let mut cur = start;
    let mut sentences = vec![format!("{name} has {start} {item}.")];
    let mut lines = Vec::new();
    while lines.len() < steps {
        let op = match rng.random_range(0..if cfg.multiplicative { 4 } else { 2 }) {
            0 => Op::Add,
            1 => Op::Sub,
            2 => Op::Mul,
            _ => Op::Div,
        };
        let b = match op {
            Op::Add | Op::Sub => rng.random_range(1..=cfg.max_operand.max(1)) as u64,
            Op::Mul | Op::Div => rng.random_range(2..=cfg.max_factor.max(2)) as u64,
        };
        if let Some((sentence, line, next)) = step(op, name, item, cur, b) {
            sentences.push(sentence);
            lines.push(line);
            cur = next;
        }
    }
    sentences.push(format!("How many {item} does {name} have now?"));
    SynthProblem {
        question: sentences.join(" "),
        answer: format!("{}\n#### {cur}", lines.join("\n")),
        result: cur,
        steps,
    }
}

/// FNV-1a of the question: the split a problem belongs to.
fn split_of(question: &str, cfg: &SynthConfig) -> Split {
    let h = question.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    if h % cfg.test_every.max(2) == 0 {
        Split::Test
    } else {
        Split::Train
    }
}

/// `n` distinct problems of `split`, drawn with `seed`.
pub fn generate(split: Split, n: usize, seed: u64, cfg: &SynthConfig) -> Vec<SynthProblem> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(n);
    let mut tries = 0usize;
    while out.len() < n && tries < 1000 * n.max(1) {
        tries += 1;
        let p = draw(&mut rng, cfg);
        if split_of(&p.question, cfg) == split && seen.insert(p.question.clone()) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::{Gsm8kReward, Reward};

    #[test]
    fn solutions_compute_the_answer_and_score_with_the_gsm8k_reward() {
        let cfg = SynthConfig::default();
        let reward = Gsm8kReward::strict();
        for p in generate(Split::Train, 200, 1, &cfg) {
            // Replaying the solution lines gives the stated result.
            let last = p.answer.lines().rev().nth(1).unwrap();
            let value: u64 = last
                .rsplit("=")
                .next()
                .unwrap()
                .rsplit(">>")
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(value, p.result, "{}", p.answer);
            assert!(p.answer.ends_with(&format!("#### {}", p.result)));
            assert_eq!(p.answer.lines().count(), p.steps + 1);
            let s = reward.score(&p.answer, &p.result.to_string()).unwrap();
            assert_eq!(s, 1.0, "{}", p.answer);
        }
    }

    #[test]
    fn shortcut_answers_score_and_are_recognised() {
        let reward = Gsm8kReward::strict();
        let p = &generate(Split::Train, 1, 7, &SynthConfig::default())[0];
        let short = p.shortcut_answer();
        assert_eq!(reward.score(&short, &p.result.to_string()).unwrap(), 1.0);
        assert!(is_shortcut(&short) && is_shortcut(&format!(" \n{short}")));
        assert!(!is_shortcut(&p.answer));
        assert_eq!(shortcut_share(&[&short, &p.answer, &p.answer, &short]), 0.5);
        assert_eq!(shortcut_share(&[]), 0.0);
    }

    #[test]
    fn splits_are_disjoint_and_seeds_reproduce() {
        let cfg = SynthConfig::default();
        let train = generate(Split::Train, 500, 3, &cfg);
        let test = generate(Split::Test, 100, 4, &cfg);
        assert_eq!((train.len(), test.len()), (500, 100));
        let train_q: std::collections::HashSet<_> = train.iter().map(|p| &p.question).collect();
        assert!(test.iter().all(|p| !train_q.contains(&p.question)));
        assert_eq!(generate(Split::Train, 50, 3, &cfg), train[..50].to_vec());
        assert_ne!(generate(Split::Train, 50, 5, &cfg), train[..50].to_vec());
    }

    #[test]
    fn difficulty_knobs_bound_the_steps() {
        let cfg = SynthConfig {
            min_steps: 2,
            max_steps: 2,
            multiplicative: false,
            ..Default::default()
        };
        for p in generate(Split::Test, 50, 9, &cfg) {
            assert_eq!(p.steps, 2);
            assert!(
                !p.answer.contains('*') && !p.answer.contains('/'),
                "{}",
                p.answer
            );
        }
    }
}
