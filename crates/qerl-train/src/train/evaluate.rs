//! Held-out accuracy: K samples per question, judged with strict and flexible answer
//! extraction. Shared by `qerl eval`, `qerl sft` (the model's accuracy after training) and the
//! default demo (before / after RL).

use std::time::Instant;

use anyhow::{Context, Result};
use qerl_model::config::eos_token_ids;
use qerl_model::{
    CausalLm, ChatTemplate, GenerationConfig, GenerationDefaults, QerlBackend, SamplingParams,
    Tokenizer,
};
use qerl_rl::data::{load_jsonl, resolve_dataset, DatasetKind, Example, FieldSpec, Split};
use qerl_rl::eval::{judge, PassAtOne, Verdict};
use qerl_rl::prompt::PromptTemplate;

use crate::rollout::{encode_prompts, sample_groups};

/// How to evaluate.
#[derive(Clone, Debug)]
pub struct EvalSpec {
    /// Which judge reads the answers.
    pub kind: DatasetKind,
    pub template: PromptTemplate,
    /// ChatML (else plain-text prompts).
    pub chat: Option<ChatTemplate>,
    /// Samples per question; pass@1 is their mean correctness.
    pub samples: usize,
    /// 0 for greedy decoding.
    pub temperature: f32,
    pub top_p: f32,
    pub max_new_tokens: usize,
    pub seed: u64,
    /// Questions generated together (each with its K samples).
    pub batch: usize,
}

/// One judged sample.
#[derive(Clone, Debug)]
pub struct SampleRecord {
    /// Index of the question in the evaluated examples.
    pub example: usize,
    pub sample: usize,
    pub text: String,
    pub verdict: Verdict,
    pub tokens: usize,
    pub finish: String,
}

/// What an evaluation found.
#[derive(Clone, Debug, Default)]
pub struct EvalReport {
    pub tally: PassAtOne,
    pub records: Vec<SampleRecord>,
    /// Generated tokens and wall time.
    pub tokens: usize,
    pub seconds: f64,
}

/// Generation settings for `model` from the model directory's defaults (EOS and pad ids).
pub fn generation_config<B: QerlBackend>(
    model: &CausalLm<B>,
    dir: &std::path::Path,
    spec: &EvalSpec,
) -> Result<GenerationConfig> {
    let defaults = GenerationDefaults::from_dir(dir)?;
    Ok(GenerationConfig {
        max_new_tokens: spec.max_new_tokens,
        sampling: SamplingParams {
            temperature: spec.temperature,
            top_p: spec.top_p,
            top_k: 0,
        },
        seed: spec.seed,
        eos_token_ids: eos_token_ids(model.config(), &defaults),
        stop_strings: Vec::new(),
        pad_token_id: defaults
            .pad_token_id
            .or(model.config().pad_token_id)
            .unwrap_or(0),
    })
}

/// Evaluates `model` (loaded from `dir`) on `examples`. `progress` is called after each batch
/// with the number of questions done.
pub fn evaluate<B: QerlBackend>(
    model: &CausalLm<B>,
    tokenizer: &Tokenizer,
    dir: &std::path::Path,
    examples: &[Example],
    spec: &EvalSpec,
    mut progress: impl FnMut(usize),
) -> Result<EvalReport> {
    let questions: Vec<String> = examples.iter().map(|e| e.question.clone()).collect();
    let prompts = encode_prompts(&questions, &spec.template, spec.chat.as_ref(), tokenizer, 0)?;
    let base = generation_config(model, dir, spec)?;
    let k = spec.samples.max(1);
    let mut report = EvalReport::default();
    let start = Instant::now();
    let idx: Vec<usize> = (0..examples.len()).collect();
    for (chunk_no, chunk) in idx.chunks(spec.batch.max(1)).enumerate() {
        let batch: Vec<(usize, Vec<u32>)> =
            chunk.iter().map(|&i| (i, prompts[i].clone())).collect();
        let gen = GenerationConfig {
            seed: spec.seed.wrapping_add(chunk_no as u64 * 1_000_003),
            ..base.clone()
        };
        for g in sample_groups(model, &batch, k, &gen, tokenizer)? {
            let e = &examples[g.example];
            let verdicts: Vec<Verdict> = g
                .texts
                .iter()
                .map(|t| judge(spec.kind, t, &e.answer))
                .collect();
            for (s, (v, (text, c))) in verdicts
                .iter()
                .zip(g.texts.iter().zip(&g.completions))
                .enumerate()
            {
                report.tokens += c.tokens.len();
                report.records.push(SampleRecord {
                    example: g.example,
                    sample: s,
                    text: text.clone(),
                    verdict: v.clone(),
                    tokens: c.tokens.len(),
                    finish: format!("{:?}", c.finish),
                });
            }
            report.tally.add_question(&verdicts);
        }
        progress(report.tally.questions);
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

/// The held-out questions of `dataset` (`gsm8k`, `math500`: their test splits; or a JSONL
/// file), the first `limit` of them (0: all), and the judge that reads their answers.
pub fn held_out(dataset: &str, limit: usize) -> Result<(DatasetKind, Vec<Example>)> {
    let (kind, file, spec) = resolve_dataset(dataset, Split::Test, &FieldSpec::math500())?;
    let (kind, spec) = match kind {
        DatasetKind::Jsonl => jsonl_layout(&file)?,
        k => (k, spec),
    };
    let mut examples = load_jsonl(&file, &spec)?;
    if limit > 0 {
        examples.truncate(limit);
    }
    anyhow::ensure!(!examples.is_empty(), "`{}` has no examples", file.display());
    Ok((kind, examples))
}

/// The layout of a JSONL file, from its first line: the question in `problem` (MATH-style) or
/// `question`; an `answer` holding a GSM8K solution (`... #### N`, e.g. models/tiny-math's
/// data) is judged as GSM8K, any other answer as a final answer.
fn jsonl_layout(file: &std::path::Path) -> Result<(DatasetKind, FieldSpec)> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read `{}`", file.display()))?;
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("{}");
    let v: serde_json::Value = serde_json::from_str(first)
        .with_context(|| format!("`{}`: the first line is not JSON", file.display()))?;
    let question = if v.get("problem").is_some() {
        "problem"
    } else {
        "question"
    };
    let gsm8k = v
        .get("answer")
        .and_then(|a| a.as_str())
        .is_some_and(|a| a.contains("#### "));
    let spec = FieldSpec {
        question: question.into(),
        answer: "answer".into(),
        answer_format: if gsm8k {
            qerl_rl::data::AnswerFormat::Gsm8kSolution
        } else {
            qerl_rl::data::AnswerFormat::Plain
        },
        id: None,
    };
    Ok((
        if gsm8k {
            DatasetKind::Gsm8k
        } else {
            DatasetKind::Jsonl
        },
        spec,
    ))
}
