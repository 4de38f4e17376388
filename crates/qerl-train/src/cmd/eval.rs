//! `qerl eval --model DIR [--adapter DIR] --dataset gsm8k|math500|FILE.jsonl [--limit N]
//! [--samples K]`: pass@1 as the mean over K samples per question (temperature 0.6, top-p
//! 0.95 by default), with strict and flexible answer extraction; one JSONL line per sample
//! and a summary table.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use qerl_model::{ChatTemplate, QerlBackend};
use qerl_rl::data::DatasetKind;
use qerl_rl::data::{resolve_dataset, FieldSpec, Split};
use qerl_rl::prompt::PromptTemplate;
use qerl_train::evaluate::{evaluate, held_out, EvalSpec};
use qerl_train::output_path::ensure_not_an_input;
use serde_json::json;

use super::generate::{load, with_backend, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// gsm8k, math500 (built-in test splits) or a JSONL file with `question` and `answer`.
    #[arg(long)]
    pub dataset: String,
    /// Evaluate the first N questions (0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Samples per question (pass@1 is their mean correctness).
    #[arg(long, default_value_t = 1, value_parser = super::positive)]
    pub samples: usize,
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Questions generated together (each with its K samples).
    #[arg(long, default_value_t = 4, value_parser = super::positive)]
    pub batch: usize,
    /// Per-sample output (default: eval-<dataset>.jsonl).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Plain-text prompts instead of the ChatML template.
    #[arg(long)]
    pub no_chat: bool,
    /// The prompt: `auto` (think-answer for GSM8K, boxed otherwise), `bare` (the question
    /// alone, e.g. for models/tiny-math), `think-answer` or `boxed`.
    #[arg(long, value_enum, default_value_t = PromptArg::Auto)]
    pub prompt: PromptArg,
}

/// The `--prompt` choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptArg {
    Auto,
    Bare,
    ThinkAnswer,
    Boxed,
}

pub fn run(args: Args) -> Result<()> {
    // before the model is loaded; checked again on the final path before it is created
    if let Some(out) = &args.output {
        let (_, dataset_file, _) =
            resolve_dataset(&args.dataset, Split::Test, &FieldSpec::math500())?;
        ensure_not_an_input(out, "--output", &[("--dataset", &dataset_file)])?;
    }
    with_backend!(args.model.device, B => run_on::<B>(&args, &Default::default()))
}

fn run_on<B: QerlBackend>(args: &Args, device: &B::Device) -> Result<()> {
    let (kind, examples) = held_out(&args.dataset, args.limit)?;
    let loaded = load::<B>(&args.model, device)?;
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let dir = &args.model.model;
    let template = match (args.prompt, kind) {
        (PromptArg::Bare, _) => PromptTemplate::bare(),
        (PromptArg::ThinkAnswer, _) | (PromptArg::Auto, DatasetKind::Gsm8k) => {
            PromptTemplate::think_answer()
        }
        (PromptArg::Boxed, _) | (PromptArg::Auto, _) => PromptTemplate::boxed(),
    };
    let spec = EvalSpec {
        kind,
        template,
        chat: (!args.no_chat)
            .then(|| ChatTemplate::for_model(dir))
            .transpose()?,
        samples: args.samples,
        temperature: args.temperature,
        top_p: args.top_p,
        max_new_tokens: args.max_new_tokens,
        seed: args.seed,
        batch: args.batch,
    };
    let out_path = output_path(args, kind);
    let (_, dataset_file, _) = resolve_dataset(&args.dataset, Split::Test, &FieldSpec::math500())?;
    ensure_not_an_input(&out_path, "--output", &[("--dataset", &dataset_file)])?;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&out_path)
            .with_context(|| format!("cannot create `{}`", out_path.display()))?,
    );
    let n = examples.len();
    let report = evaluate(model, tok, dir, &examples, &spec, |done| {
        eprint!("\r{done}/{n} questions")
    })?;
    eprintln!();
    for r in &report.records {
        let (e, v) = (&examples[r.example], &r.verdict);
        let line = json!({
            "id": e.id, "question": e.question, "answer": e.answer, "sample": r.sample,
            "completion": r.text, "strict": v.strict, "flexible": v.flexible,
            "strict_answer": v.strict_answer, "flexible_answer": v.flexible_answer,
            "tokens": r.tokens, "finish": r.finish,
        });
        writeln!(out, "{line}")
            .with_context(|| format!("cannot write `{}`", out_path.display()))?;
    }
    out.flush()
        .with_context(|| format!("cannot write `{}`", out_path.display()))?;
    let (tally, tokens, k) = (&report.tally, report.tokens, spec.samples);
    let secs = report.seconds;
    println!("| dataset | model | adapter | questions | samples/q | pass@1 strict | pass@1 flexible | pass@{k} strict |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} | {} | {} | {} | {k} | {:.2}% | {:.2}% | {:.2}% |",
        args.dataset,
        dir.display(),
        args.model
            .adapter
            .as_ref()
            .map_or("-".into(), |a| a.display().to_string()),
        tally.questions,
        100.0 * tally.strict(),
        100.0 * tally.flexible(),
        100.0 * tally.pass_at_k_strict()
    );
    eprintln!(
        "{tokens} tokens in {secs:.1}s; per-sample output: {}",
        out_path.display()
    );
    Ok(())
}

pub fn kind_name(kind: DatasetKind) -> &'static str {
    match kind {
        DatasetKind::Gsm8k => "gsm8k",
        DatasetKind::Math500 => "math500",
        DatasetKind::Jsonl => "jsonl",
    }
}

/// The per-sample output file: --output, else `eval-<dataset>.jsonl`.
fn output_path(args: &Args, kind: DatasetKind) -> PathBuf {
    args.output
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("eval-{}.jsonl", kind_name(kind))))
}
