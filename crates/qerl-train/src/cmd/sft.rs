//! `qerl sft --out DIR [shape, data and optimisation flags] [--device auto|cpu|wgpu|cuda]`.
//!
//! Makes a small math model from nothing: synthetic GSM8K-style problems
//! ([`qerl_rl::synth`]), a byte-level BPE trained on them, a Qwen2 model with random weights,
//! supervised training of every weight on the worked solutions (f32), then a Hugging Face
//! checkpoint in DIR and its held-out accuracy. DIR ends up with:
//!
//! | file | what |
//! | --- | --- |
//! | config.json, model.safetensors | the model (bf16 by default) |
//! | tokenizer.json, tokenizer_config.json, generation_config.json | ChatML tokenizer, EOS `<|im_end|>` |
//! | data/train.jsonl, data/test.jsonl | RL prompts (train split) and the held-out set (test split), GSM8K layout |
//! | sft_log.jsonl | loss, gradient norm, learning rate per step |
//! | sft_eval.json | held-out accuracy, greedy and sampled (T 0.6, top-p 0.95), and how the model was made |

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use indicatif::{ProgressBar, ProgressStyle};
use qerl_model::export::{save_pretrained, ExportDtype};
use qerl_model::{load, ChatTemplate, LoadOptions, Precision, QerlBackend, Tokenizer};
use qerl_rl::data::{DatasetKind, Example, Split};
use qerl_rl::prompt::PromptTemplate;
use qerl_rl::synth::{generate, SynthConfig, SynthProblem};
use qerl_train::evaluate::{evaluate, EvalSpec};
use qerl_train::sft::{encode_examples, init_model_dir, train, ModelShape, SftLog, SftOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Output model directory (created; existing files in it are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Use this tokenizer.json instead of training one.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Vocabulary of the trained BPE (bytes and special tokens included).
    #[arg(long, default_value_t = 512)]
    pub vocab_size: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 768)]
    pub intermediate: usize,
    /// Distinct training problems (train split) for supervised training.
    #[arg(long, default_value_t = 50_000)]
    pub problems: usize,
    /// Problems written to data/train.jsonl for RL (train split, another seed).
    #[arg(long, default_value_t = 5_000)]
    pub rl_problems: usize,
    /// Problems written to data/test.jsonl (test split: never trained on).
    #[arg(long, default_value_t = 500)]
    pub test_problems: usize,
    #[arg(long, default_value_t = 3000)]
    pub steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 64, value_parser = super::positive)]
    pub batch: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Wall-clock budget of the training loop (seconds): the step count is cut to what fits
    /// and the learning-rate schedule fitted to it.
    #[arg(long)]
    pub time_budget: Option<f64>,
    /// Difficulty: fewest and most arithmetic steps, largest operand of + and -, largest
    /// factor of * and /.
    #[arg(long, default_value_t = 1)]
    pub min_ops: usize,
    #[arg(long, default_value_t = 4)]
    pub max_ops: usize,
    #[arg(long, default_value_t = 20)]
    pub max_operand: u32,
    #[arg(long, default_value_t = 5)]
    pub max_factor: u32,
    /// Fraction of the supervised solutions written as the final line alone (`#### N`, no
    /// working): the model learns two ways to answer, and RL has a choice to make between them.
    #[arg(long, default_value_t = 0.0)]
    pub shortcut_fraction: f64,
    /// Held-out questions evaluated at the end (0: none).
    #[arg(long, default_value_t = 200)]
    pub eval_limit: usize,
    /// Longest completion when evaluating.
    #[arg(long, default_value_t = 160)]
    pub eval_max_new_tokens: usize,
    #[arg(long, value_enum, default_value_t = SaveDtype::Bf16)]
    pub save_dtype: SaveDtype,
    #[arg(long, value_enum, default_value_t = SftDevice::Auto)]
    pub device: SftDevice,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SaveDtype {
    Bf16,
    F32,
}

/// Where training runs (always in f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SftDevice {
    /// CUDA when this build has it and a GPU is present, else the CPU.
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

impl Args {
    fn synth(&self) -> SynthConfig {
        SynthConfig {
            min_steps: self.min_ops,
            max_steps: self.max_ops,
            max_operand: self.max_operand,
            max_factor: self.max_factor,
            ..SynthConfig::default()
        }
    }

    fn shape(&self) -> ModelShape {
        ModelShape {
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            intermediate: self.intermediate,
            max_positions: 1024,
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let device = match args.device {
        SftDevice::Auto if cfg!(feature = "cuda") && super::gpu_present() => SftDevice::Cuda,
        SftDevice::Auto => SftDevice::Cpu,
        d => d,
    };
    eprintln!("supervised training on {device:?} (f32)");
    match device {
        SftDevice::Cpu => run_on::<burn::backend::Autodiff<qerl_nn::backends::Cpu>>(
            &args,
            &Default::default(),
            "cpu",
        ),
        #[cfg(feature = "wgpu")]
        SftDevice::Wgpu => run_on::<burn::backend::Autodiff<qerl_nn::backends::Wgpu>>(
            &args,
            &qerl_kernels::runtime::wgpu_device()?,
            "wgpu",
        ),
        #[cfg(feature = "cuda")]
        SftDevice::Cuda => run_on::<burn::backend::Autodiff<qerl_nn::backends::CudaF32>>(
            &args,
            &Default::default(),
            "cuda",
        ),
        #[allow(unreachable_patterns)]
        other => anyhow::bail!("this build of qerl has no {other:?} support (see --features)"),
    }
}

fn write_jsonl(path: &Path, problems: &[SynthProblem]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path)
            .with_context(|| format!("cannot create `{}`", path.display()))?,
    );
    let named = || format!("cannot write `{}`", path.display());
    for p in problems {
        writeln!(f, "{}", json!({"question": p.question, "answer": p.answer}))
            .with_context(named)?;
    }
    f.flush().with_context(named)?;
    Ok(())
}

fn examples(problems: &[SynthProblem]) -> Vec<Example> {
    problems
        .iter()
        .enumerate()
        .map(|(i, p)| Example {
            id: i.to_string(),
            question: p.question.clone(),
            answer: p.result.to_string(),
            solution: p.answer.clone(),
        })
        .collect()
}

fn run_on<B>(args: &Args, device: &B::Device, device_name: &str) -> Result<()>
where
    B: AutodiffBackend + QerlBackend,
    B::InnerBackend: QerlBackend,
{
    let t0 = Instant::now();
    let out = &args.out;
    let data_dir = out.join("data");
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("cannot create `{}`", data_dir.display()))?;
    let synth = args.synth();
    let sft_problems = generate(Split::Train, args.problems, args.seed, &synth);
    let rl_problems = generate(Split::Train, args.rl_problems, args.seed + 1, &synth);
    let test_problems = generate(Split::Test, args.test_problems, args.seed + 2, &synth);
    write_jsonl(&data_dir.join("train.jsonl"), &rl_problems)?;
    write_jsonl(&data_dir.join("test.jsonl"), &test_problems)?;
    eprintln!(
        "{} SFT problems, {} RL prompts, {} held-out (seed {})",
        sft_problems.len(),
        rl_problems.len(),
        test_problems.len(),
        args.seed
    );

    // Tokenizer, then a random model.
    let tok_path = out.join("tokenizer.json");
    match &args.tokenizer {
        Some(t) => {
            std::fs::copy(t, &tok_path)
                .with_context(|| format!("cannot copy `{}`", t.display()))?;
        }
        None => {
            let chat = ChatTemplate::default();
            let texts: Vec<String> = sft_problems
                .iter()
                .map(|p| {
                    let m = [
                        qerl_model::Message::new("user", &p.question),
                        qerl_model::Message::new("assistant", &p.answer),
                    ];
                    chat.render(&m, false)
                })
                .collect();
            qerl_train::bpe::train_bpe(&texts, args.vocab_size, &tok_path)?;
        }
    }
    let shape = args.shape();
    init_model_dir(out, &shape, &tok_path, args.seed)?;
    let tokenizer = Tokenizer::from_file(&tok_path)?;
    let vocab = tokenizer.vocab_size();
    eprintln!(
        "model: {} layers, hidden {}, {} heads ({} kv), intermediate {}, vocab {vocab}: {:.2}M parameters",
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.intermediate,
        shape.parameters(vocab) as f64 / 1e6
    );
    let options = LoadOptions {
        precision: Some(Precision::Bf16),
        lora: None,
        trainable_norms: true,
    };
    let mut model = load::<B>(out, &options, device)?;
    model.set_base_trainable()?;

    // Supervised training.
    let eos = tokenizer
        .token_to_id("<|im_end|>")
        .context("the tokenizer has no <|im_end|>")?;
    let pad = tokenizer.token_to_id("<|endoftext|>").unwrap_or(0);
    let pairs = supervised_pairs(&sft_problems, args.shortcut_fraction, args.seed)?;
    let template = PromptTemplate::bare();
    let chat = ChatTemplate::for_model(out)?;
    let data = encode_examples(&pairs, &tokenizer, &chat, &template, eos)?;
    let opt = SftOptions {
        steps: args.steps,
        batch: args.batch,
        lr: args.lr,
        warmup_steps: args.warmup,
        weight_decay: args.weight_decay,
        grad_clip: 1.0,
        seed: args.seed,
        time_budget_s: args.time_budget,
    };
    let log_path = out.join("sft_log.jsonl");
    let mut log = std::io::BufWriter::new(
        std::fs::File::create(&log_path)
            .with_context(|| format!("cannot create `{}`", log_path.display()))?,
    );
    let pb = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.steps as u64)
    };
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    let (mut tokens, mut last_loss, mut steps_done) = (0usize, f32::NAN, 0usize);
    let t_train = Instant::now();
    qerl_train::signal::install();
    let model = train(
        model,
        &data,
        &opt,
        pad,
        |l: &SftLog| {
            tokens += l.tokens;
            last_loss = l.loss;
            steps_done = l.step + 1;
            pb.set_length(l.total_steps as u64);
            let _ = writeln!(log, "{}", serde_json::to_string(l).expect("JSON"));
            pb.set_position(l.step as u64 + 1);
            pb.set_message(format!(
                "loss {:.4} |g| {:.2} lr {:.1e}",
                l.loss, l.grad_norm, l.lr
            ));
        },
        qerl_train::signal::requested,
    )?;
    pb.finish_and_clear();
    log.flush()
        .with_context(|| format!("cannot write `{}`", log_path.display()))?;
    let train_secs = t_train.elapsed().as_secs_f64();
    eprintln!(
        "trained {steps_done} steps in {train_secs:.0}s ({:.0} completion tokens/s), final loss {last_loss:.4}",
        tokens as f64 / train_secs.max(1e-9)
    );
    let dtype = match args.save_dtype {
        SaveDtype::Bf16 => ExportDtype::Bf16,
        SaveDtype::F32 => ExportDtype::F32,
    };
    save_pretrained(&model.valid(), out, dtype)?;
    drop(model);

    // Held-out accuracy of the saved checkpoint, as users load it.
    let mut results = Vec::new();
    if args.eval_limit > 0 {
        let inner_device = device.clone();
        let saved = load::<B::InnerBackend>(out, &LoadOptions::default(), &inner_device)?;
        let test = examples(&test_problems[..args.eval_limit.min(test_problems.len())]);
        for (name, temperature, samples) in [("greedy", 0.0, 1), ("t0.6", 0.6, 4)] {
            let spec = EvalSpec {
                kind: DatasetKind::Gsm8k,
                template: template.clone(),
                chat: Some(chat.clone()),
                samples,
                temperature,
                top_p: 0.95,
                max_new_tokens: args.eval_max_new_tokens,
                seed: args.seed,
                batch: 64,
            };
            let r = evaluate(&saved, &tokenizer, out, &test, &spec, |_| {})?;
            let texts: Vec<&str> = r.records.iter().map(|x| x.text.as_str()).collect();
            let shortcut = qerl_rl::synth::shortcut_share(&texts);
            eprintln!(
                "held-out accuracy, {name}: {:.1}% strict ({} questions x {samples}), {:.1}% of the answers without working",
                100.0 * r.tally.strict(),
                r.tally.questions,
                100.0 * shortcut
            );
            results.push(json!({
                "decoding": name, "temperature": temperature, "top_p": 0.95,
                "samples_per_question": samples, "questions": r.tally.questions,
                "strict": r.tally.strict(), "flexible": r.tally.flexible(),
                "shortcut": shortcut,
            }));
        }
    }
    let summary = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "device": device_name,
        "parameters": shape.parameters(vocab),
        "steps": steps_done, "batch": opt.batch, "lr": opt.lr,
        "train_seconds": train_secs, "total_seconds": t0.elapsed().as_secs_f64(),
        "completion_tokens": tokens, "final_loss": last_loss,
        "synth": synth, "shortcut_fraction": args.shortcut_fraction, "seed": args.seed,
        "eval": results,
    });
    qerl_model::export::write_atomic(
        &out.join("sft_eval.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    eprintln!("model: {}", out.display());
    Ok(())
}

/// The (question, written solution) pairs of supervised training: the worked solution, or with
/// probability `shortcut` (drawn per problem from `seed`) only its final `#### N` line.
fn supervised_pairs(
    problems: &[SynthProblem],
    shortcut: f64,
    seed: u64,
) -> Result<Vec<(String, String)>> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&shortcut),
        "--shortcut-fraction must lie in [0, 1], got {shortcut}"
    );
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5407_c0de);
    Ok(problems
        .iter()
        .map(|p| {
            let answer = if rng.random_bool(shortcut) {
                p.shortcut_answer()
            } else {
                p.answer.clone()
            };
            (p.question.clone(), answer)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use qerl_rl::synth::is_shortcut;

    #[test]
    fn supervised_pairs_write_the_asked_share_of_shortcuts() {
        let problems = generate(Split::Train, 400, 3, &SynthConfig::default());
        let share = |f: f64| {
            let pairs = supervised_pairs(&problems, f, 7).unwrap();
            for ((q, a), p) in pairs.iter().zip(&problems) {
                assert_eq!(q, &p.question);
                assert!(a == &p.answer || a == &p.shortcut_answer(), "{a}");
            }
            pairs.iter().filter(|(_, a)| is_shortcut(a)).count() as f64 / pairs.len() as f64
        };
        assert_eq!(share(0.0), 0.0);
        assert_eq!(share(1.0), 1.0);
        let half = share(0.5);
        assert!((0.4..0.6).contains(&half), "{half}");
        // reproducible from the seed
        assert_eq!(
            supervised_pairs(&problems, 0.5, 7).unwrap(),
            supervised_pairs(&problems, 0.5, 7).unwrap()
        );
        assert!(supervised_pairs(&problems, 1.5, 7).is_err());
        assert!(supervised_pairs(&problems, f64::NAN, 7).is_err());
    }
}
