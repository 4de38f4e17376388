//! `qerl` with no subcommand (what `cargo run --release -p qerl-train` runs): the whole QeRL
//! loop on the embedded model, on whatever machine this is.
//!
//! 1. Quantizes `models/tiny-math` (a small Qwen2 the project trained itself, see its README)
//!    to NVFP4 into `runs/demo/tiny-math-nvfp4`.
//! 2. Measures its held-out accuracy (models/tiny-math/data/test.jsonl, greedy).
//! 3. Trains LoRA adapters with GRPO and AQN on the frozen NVFP4 weights
//!    (`configs/tiny-math.toml`; CUDA when present, else the CPU).
//! 4. Measures the accuracy again with the saved adapter loaded back, and prints a
//!    before / after table and the paths of the plot, the metrics and the adapter.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use qerl_format::checkpoint::quantize_checkpoint;
use qerl_format::QuantFormat;
use qerl_model::{load, load_with_adapter, Adapter, ChatTemplate, LoadOptions, Tokenizer};
use qerl_rl::data::{load_jsonl, DatasetKind, FieldSpec};
use qerl_rl::TrainConfig;
use qerl_train::evaluate::{evaluate, EvalSpec};
use qerl_train::{RunOptions, TrainBackend, TrainSetup, Trainer};

#[derive(clap::Args, Debug, Default)]
pub struct Args {
    /// The demo's config (default: configs/tiny-math.toml of this repository).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config value, e.g. `--set train.steps=40` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Force the CPU even when a GPU is present.
    #[arg(long)]
    pub cpu: bool,
    /// Stop training after this many seconds (at a step boundary; the adapter of the last
    /// step is evaluated), e.g. to fit a time slot.
    #[arg(long)]
    pub time_budget: Option<f64>,
}

/// Where the demo's config puts the NVFP4 copy of the model (relative to the repository root).
const DEFAULT_QUANTIZED: &str = "runs/demo/tiny-math-nvfp4";
/// File that marks a quantized copy as the demo's own, to replace on every run.
const DEMO_MARK: &str = ".qerl-demo";

/// The repository root: the current directory when it holds `models/tiny-math`, else the
/// checkout this binary was built from.
fn repo_root() -> PathBuf {
    let here = PathBuf::from(".");
    if here.join("models/tiny-math/config.json").is_file() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Resolves a config path relative to the repository root.
fn under(root: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        root.join(p)
    }
}

pub fn run(args: Args) -> Result<()> {
    let root = repo_root();
    let model_src = root.join("models/tiny-math");
    anyhow::ensure!(
        model_src.join("config.json").is_file(),
        "the embedded model is missing: `{}` has no config.json",
        model_src.display()
    );
    let config_path = args
        .config
        .clone()
        .unwrap_or_else(|| root.join("configs/tiny-math.toml"));
    let mut config = TrainConfig::load(&config_path, &args.set)?;
    config.model.dir = under(&root, &config.model.dir);
    config.data.path = config.data.path.as_deref().map(|p| under(&root, p));
    config.train.output_dir = under(&root, &config.train.output_dir);
    let test_file = under(&root, Path::new(&config.eval.dataset));
    config.eval.dataset = test_file.display().to_string();

    // 1. NVFP4 weights, quantized afresh every run (well under a second) into a directory the
    // demo owns (its default one, or one it marked), so a copy left by an older checkout of the
    // model is never trained in its place. A directory of the user's is used as it is; a config
    // whose model is models/tiny-math itself (`--set model.precision="bf16"` with that dir)
    // trains it unquantized.
    let q_dir = config.model.dir.clone();
    let is_source = match (q_dir.canonicalize(), model_src.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let owned = q_dir == root.join(DEFAULT_QUANTIZED) || q_dir.join(DEMO_MARK).is_file();
    if !is_source && owned && q_dir.exists() {
        std::fs::remove_dir_all(&q_dir)
            .with_context(|| format!("cannot replace `{}`", q_dir.display()))?;
    }
    if !is_source && !q_dir.exists() {
        eprintln!(
            "quantizing {} to NVFP4 -> {}",
            model_src.display(),
            q_dir.display()
        );
        let report = quantize_checkpoint(&model_src, &q_dir, QuantFormat::Nvfp4, &mut |_| {})?;
        std::fs::write(
            q_dir.join(DEMO_MARK),
            "written by `qerl` (the demo); replaced every run\n",
        )
        .with_context(|| format!("cannot write into `{}`", q_dir.display()))?;
        eprintln!(
            "{} linears quantized, {:.1} MB -> {:.1} MB",
            report.layers.len(),
            report.input_bytes as f64 / 1e6,
            report.output_bytes as f64 / 1e6
        );
    }
    let gpu = !args.cpu && cfg!(feature = "cuda") && super::gpu_present();
    eprintln!("device: {}", if gpu { "CUDA" } else { "CPU" });
    if gpu {
        #[cfg(feature = "cuda")]
        return go::<burn::backend::Autodiff<qerl_nn::backends::Cuda>>(
            config,
            &test_file,
            args.time_budget,
        );
    }
    go::<burn::backend::Autodiff<qerl_nn::backends::Cpu>>(config, &test_file, args.time_budget)
}

/// Held-out accuracy of the NVFP4 model, with or without an adapter.
struct HeldOut {
    /// Strict accuracy.
    accuracy: f64,
    questions: usize,
    /// Fraction of the answers that show their working (the model knows two ways to answer;
    /// see models/tiny-math/README.md).
    worked: f64,
}

/// Greedy held-out accuracy (strict) of the NVFP4 model, with or without an adapter.
fn accuracy<B: qerl_model::QerlBackend>(
    config: &TrainConfig,
    test_file: &Path,
    adapter: Option<&Path>,
) -> Result<HeldOut> {
    let dir = &config.model.dir;
    let tokenizer = Tokenizer::for_model(dir, None)?;
    let mut examples = load_jsonl(test_file, &FieldSpec::gsm8k())?;
    if config.eval.limit > 0 {
        examples.truncate(config.eval.limit);
    }
    let device = B::Device::default();
    let options = LoadOptions::default();
    let model = match adapter {
        Some(a) => load_with_adapter::<B>(dir, &options, Some(&Adapter::open(a)?), &device)?,
        None => load::<B>(dir, &options, &device)?,
    };
    let spec = EvalSpec {
        kind: DatasetKind::Gsm8k,
        template: config.data.prompt.clone(),
        chat: Some(ChatTemplate::for_model(dir)?),
        samples: config.eval.samples.max(1),
        temperature: config.eval.temperature,
        top_p: config.eval.top_p,
        max_new_tokens: config.eval.max_completion_tokens,
        seed: config.train.seed,
        batch: 64,
    };
    let r = evaluate(&model, &tokenizer, dir, &examples, &spec, |_| {})?;
    let texts: Vec<&str> = r.records.iter().map(|x| x.text.as_str()).collect();
    Ok(HeldOut {
        accuracy: r.tally.strict(),
        questions: r.tally.questions,
        worked: 1.0 - qerl_rl::synth::shortcut_share(&texts),
    })
}

fn go<B: TrainBackend>(config: TrainConfig, test_file: &Path, budget: Option<f64>) -> Result<()> {
    let start = std::time::Instant::now();
    let before = accuracy::<B::InnerBackend>(&config, test_file, None)
        .context("evaluating the NVFP4 model before training")?;
    eprintln!(
        "held-out accuracy before RL: {:.1}% ({} questions)",
        100.0 * before.accuracy,
        before.questions
    );
    let setup = TrainSetup::from_config(config.clone(), None)?;
    let mut trainer = Trainer::<B>::new(setup, &B::Device::default())?;
    qerl_train::signal::install();
    let out = qerl_train::run(
        &mut trainer,
        &RunOptions {
            progress: true,
            max_steps: None,
            time_budget: budget,
        },
    )?;
    if out.out_of_time {
        eprintln!(
            "time budget spent: stopped after step {} of {}",
            out.steps, config.train.steps
        );
    }
    let adapter = out
        .checkpoint
        .clone()
        .context("the run wrote no checkpoint")?;
    let after = accuracy::<B::InnerBackend>(&config, test_file, Some(&adapter))
        .context("evaluating the trained adapter")?;
    let m = &out.metrics;
    let first = m.first().map_or(f32::NAN, |x| x.reward_mean);
    let last = m.last().map_or(f32::NAN, |x| x.reward_mean);
    println!();
    let aqn = match config.aqn.schedule {
        qerl_rl::aqn::SigmaSchedule::None => "no AQN".to_string(),
        s => format!("AQN ({s:?})").to_lowercase().replace("aqn", "AQN"),
    };
    let precision = format!("{:?}", config.model.precision).to_uppercase();
    let loss = format!("{:?}", config.loss.kind).to_uppercase();
    println!(
        "| tiny-math, {precision} + LoRA, {loss}, {aqn} | held-out accuracy ({}, greedy) | answers showing their working | train reward |",
        before.questions
    );
    println!("| --- | ---: | ---: | ---: |");
    for (name, h, reward) in [
        (
            "before RL".to_string(),
            &before,
            format!("{first:.3} (step 0)"),
        ),
        (
            format!("after {} steps", out.steps),
            &after,
            format!("{last:.3} (last step)"),
        ),
    ] {
        println!(
            "| {name} | {:.1}% | {:.1}% | {reward} |",
            100.0 * h.accuracy,
            100.0 * h.worked
        );
    }
    println!();
    println!("time: {:.0} s", start.elapsed().as_secs_f64());
    println!("plot:    {}", out.plot_path.display());
    println!("metrics: {}", out.metrics_path.display());
    println!("adapter: {}", adapter.display());
    Ok(())
}
