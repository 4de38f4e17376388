//! `qerl reward --dataset gsm8k|math500 --completions FILE.jsonl [--output FILE]`: re-scores
//! completions (lines with `completion` or `text`, and `answer` or an `id` of the dataset,
//! e.g. the output of `qerl eval`) with the dataset's training rewards and its strict /
//! flexible verdicts, and writes one JSONL line of rewards per input line.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use qerl_rl::data::{load_jsonl, resolve_dataset, DatasetKind, FieldSpec, Split};
use qerl_rl::eval::judge;
use qerl_rl::reward::RewardSet;
use qerl_train::output_path::ensure_not_an_input;
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// gsm8k or math500: which rewards and which reference answers (looked up by `id`).
    #[arg(long)]
    pub dataset: String,
    #[arg(long)]
    pub completions: PathBuf,
    /// Output JSONL (default: <completions>.rewards.jsonl).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Also print, for every completion and reward, what was extracted, how both sides were
    /// read and why they matched or not.
    #[arg(long)]
    pub explain: bool,
}

pub fn run(args: Args) -> Result<()> {
    let (kind, file, spec) = resolve_dataset(&args.dataset, Split::Test, &FieldSpec::math500())?;
    let rewards = match kind {
        DatasetKind::Gsm8k => RewardSet::gsm8k(),
        _ => RewardSet::math(),
    };
    let mut by_id: Option<HashMap<String, String>> = None;
    let out_path = args
        .output
        .clone()
        .unwrap_or_else(|| args.completions.with_extension("rewards.jsonl"));
    ensure_not_an_input(
        &out_path,
        "--output",
        &[("--completions", &args.completions), ("--dataset", &file)],
    )?;
    let input = std::fs::File::open(&args.completions)
        .with_context(|| format!("cannot read `{}`", args.completions.display()))?;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&out_path)
            .with_context(|| format!("cannot create `{}`", out_path.display()))?,
    );
    let (mut n, mut total, mut correct, mut strict, mut flexible, mut failures) =
        (0usize, 0f64, 0usize, 0usize, 0usize, 0usize);
    for (i, line) in std::io::BufReader::new(input).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read `{}`", args.completions.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not JSON", args.completions.display(), i + 1))?;
        let text = v
            .get("completion")
            .or_else(|| v.get("text"))
            .and_then(Value::as_str)
            .with_context(|| {
                format!(
                    "{}:{}: no `completion` or `text`",
                    args.completions.display(),
                    i + 1
                )
            })?;
        let id = v
            .get("id")
            .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string));
        let answer = match v.get("answer").and_then(Value::as_str) {
            Some(a) => a.to_string(),
            None => {
                let map = match &mut by_id {
                    Some(m) => m,
                    None => by_id.insert(
                        load_jsonl(&file, &spec)?
                            .into_iter()
                            .map(|e| (e.id, e.answer))
                            .collect(),
                    ),
                };
                let id = id.clone().with_context(|| {
                    format!(
                        "{}:{}: no `answer` and no `id`",
                        args.completions.display(),
                        i + 1
                    )
                })?;
                map.get(&id)
                    .cloned()
                    .with_context(|| format!("id {id} is not in `{}`", file.display()))?
            }
        };
        let s = rewards.score(text, &answer);
        if args.explain {
            for name in rewards.names() {
                // Rewards without an explanation of their own (format rewards) are skipped.
                if let Ok(e) = qerl_rl::reward::explain(&name, text, &answer) {
                    println!(
                        "line {} (id {}):\n{e}\n",
                        i + 1,
                        id.as_deref().unwrap_or("-")
                    );
                }
            }
        }
        let verdict = judge(kind, text, &answer);
        let per: serde_json::Map<String, Value> = rewards
            .names()
            .into_iter()
            .zip(&s.per_reward)
            .map(|(k, v)| (k, json!(v)))
            .collect();
        let fails: Vec<Value> = s
            .failures
            .iter()
            .map(|(r, m)| json!({"reward": r, "message": m}))
            .collect();
        writeln!(
            out,
            "{}",
            json!({
                "line": i + 1, "id": id, "reward": s.total, "rewards": per, "correct": s.correct,
                "strict": verdict.strict, "flexible": verdict.flexible, "failures": fails,
            })
        )
        .with_context(|| format!("cannot write `{}`", out_path.display()))?;
        n += 1;
        total += s.total as f64;
        correct += (s.correct == Some(true)) as usize;
        strict += verdict.strict as usize;
        flexible += verdict.flexible as usize;
        failures += s.failures.len();
    }
    out.flush()
        .with_context(|| format!("cannot write `{}`", out_path.display()))?;
    let d = n.max(1) as f64;
    println!("| completions | mean reward | accuracy | strict | flexible | reward failures |");
    println!("| --- | --- | --- | --- | --- | --- |");
    println!(
        "| {n} | {:.4} | {:.2}% | {:.2}% | {:.2}% | {failures} |",
        total / d,
        100.0 * correct as f64 / d,
        100.0 * strict as f64 / d,
        100.0 * flexible as f64 / d
    );
    eprintln!("rewards: {}", out_path.display());
    Ok(())
}
