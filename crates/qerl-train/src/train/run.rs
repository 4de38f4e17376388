//! The step loop of `qerl train`: metrics to `output_dir/metrics.jsonl` and a progress bar
//! each step, held-out accuracy every `eval_interval` steps (`output_dir/eval.jsonl`),
//! checkpoints every `ckpt_interval` steps and at the end, `metrics.png` when the run ends, and
//! a clean stop (checkpoint, then exit) on Ctrl-C or when a time budget is spent.
//!
//! Under data parallelism every rank runs this loop; rank 0 alone writes (metrics, plot,
//! checkpoints, progress bar). The metrics are already reduced over ranks by the trainer, and
//! a stop seen by any rank (Ctrl-C) stops all of them at the same step.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::AutodiffModule;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use qerl_model::ChatTemplate;
use qerl_rl::data::{DatasetKind, Example};
use qerl_rl::metrics::{plot_run, read_jsonl, MetricsWriter, StepMetrics};

use crate::evaluate::{evaluate, held_out, EvalSpec};
use crate::noise::set_noise;
use crate::trainer::{TrainBackend, Trainer};

/// Options of [`run`].
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Draw a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// Stop after this many steps of this invocation (the run stays resumable); `None`: run
    /// to `train.steps`.
    pub max_steps: Option<usize>,
    /// Stop at the first step boundary after this many seconds of this invocation (with a
    /// checkpoint, like Ctrl-C); `None`: no limit.
    pub time_budget: Option<f64>,
}

/// How [`run`] ended.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// Steps done in all (the trainer's step counter).
    pub steps: usize,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// Whether Ctrl-C stopped the run early.
    pub interrupted: bool,
    /// Whether the time budget stopped the run early.
    pub out_of_time: bool,
    pub metrics_path: PathBuf,
    pub plot_path: PathBuf,
    /// This invocation's metrics.
    pub metrics: Vec<StepMetrics>,
}

/// The metrics file of a run, keeping only records of steps before `step` (a resumed run
/// rewrites what a crash after the last checkpoint left behind).
fn open_metrics(path: &std::path::Path, step: usize) -> Result<MetricsWriter> {
    if path.exists() {
        let keep: Vec<StepMetrics> = if step == 0 {
            Vec::new()
        } else {
            read_jsonl(path)?
                .into_iter()
                .filter(|m| m.step < step)
                .collect()
        };
        std::fs::remove_file(path)
            .with_context(|| format!("cannot replace `{}`", path.display()))?;
        let mut w = MetricsWriter::append(path)?;
        for m in &keep {
            w.write(m)?;
        }
        return Ok(w);
    }
    Ok(MetricsWriter::append(path)?)
}

/// Held-out accuracy during training (`train.eval_interval`): the `eval` section's questions,
/// prompted like the training prompts, judged by the dataset's judge.
struct HeldOut {
    kind: DatasetKind,
    examples: Vec<Example>,
    spec: EvalSpec,
    path: PathBuf,
}

impl HeldOut {
    fn new<B: TrainBackend>(trainer: &Trainer<B>, out: &Path) -> Result<Self> {
        let c = trainer.config();
        let (kind, examples) = held_out(&c.eval.dataset, c.eval.limit)
            .with_context(|| format!("eval.dataset = {:?}", c.eval.dataset))?;
        let spec = EvalSpec {
            kind,
            template: c.data.prompt.clone(),
            chat: trainer
                .setup
                .chat
                .then(|| ChatTemplate::for_model(&c.model.dir))
                .transpose()?,
            samples: c.eval.samples.max(1),
            temperature: c.eval.temperature,
            top_p: c.eval.top_p,
            max_new_tokens: c.eval.max_completion_tokens,
            seed: c.train.seed,
            batch: 64,
        };
        let path = out.join("eval.jsonl");
        if trainer.state.step == 0 && path.exists() {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot replace `{}`", path.display()))?;
        }
        Ok(HeldOut {
            kind,
            examples,
            spec,
            path,
        })
    }

    /// Evaluates the policy as it is now (LoRA on, no noise) and appends one line to
    /// `eval.jsonl`; returns pass@1 (strict).
    fn run<B: TrainBackend>(&self, trainer: &Trainer<B>) -> Result<f64> {
        let mut model = trainer.model().valid();
        set_noise(&mut model, None);
        let c = trainer.config();
        let r = evaluate(
            &model,
            &trainer.setup.tokenizer,
            &c.model.dir,
            &self.examples,
            &self.spec,
            |_| {},
        )?;
        let line = serde_json::json!({
            "step": trainer.state.step,
            "dataset": c.eval.dataset,
            "judge": format!("{:?}", self.kind),
            "questions": r.tally.questions,
            "samples": self.spec.samples,
            "temperature": (f64::from(self.spec.temperature) * 1e6).round() / 1e6,
            "accuracy": r.tally.strict(),
            "accuracy_flexible": r.tally.flexible(),
            "tokens": r.tokens,
            "seconds": r.seconds,
        });
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("cannot write `{}`", self.path.display()))?;
        writeln!(f, "{line}").with_context(|| format!("cannot write `{}`", self.path.display()))?;
        Ok(r.tally.strict())
    }
}

fn bar(total: usize, done: usize, show: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(
        Some(total as u64),
        if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    pb.set_position(done as u64);
    pb
}

/// Runs the trainer to `train.steps` (or until Ctrl-C / `max_steps`).
pub fn run<B: TrainBackend>(trainer: &mut Trainer<B>, options: &RunOptions) -> Result<RunOutcome> {
    let c = trainer.config().clone();
    let main = trainer.is_main();
    let out = &c.train.output_dir;
    let metrics_path = out.join("metrics.jsonl");
    let plot_path = out.join("metrics.png");
    let mut writer = None;
    if main {
        std::fs::create_dir_all(out)
            .with_context(|| format!("cannot create `{}`", out.display()))?;
        writer = Some(open_metrics(&metrics_path, trainer.state.step)?);
        if trainer.state.step == 0 {
            let path = out.join("config.toml");
            std::fs::write(&path, c.to_toml())
                .with_context(|| format!("cannot write `{}`", path.display()))?;
        }
    }
    let total = c.train.steps;
    let pb = bar(total, trainer.state.step, options.progress && main);
    let mut outcome = RunOutcome {
        steps: trainer.state.step,
        checkpoint: None,
        interrupted: false,
        out_of_time: false,
        metrics_path: metrics_path.clone(),
        plot_path: plot_path.clone(),
        metrics: Vec::new(),
    };
    let every = c.train.eval_interval;
    let held = if every > 0 && main {
        Some(HeldOut::new(trainer, out)?)
    } else {
        None
    };
    let evaluate_now = |trainer: &Trainer<B>, pb: &ProgressBar| -> Result<()> {
        if let Some(h) = &held {
            let acc = h.run(trainer)?;
            pb.println(format!(
                "step {}: held-out accuracy {:.1}% ({} questions)",
                trainer.state.step,
                100.0 * acc,
                h.examples.len()
            ));
        }
        Ok(())
    };
    if trainer.state.step == 0 {
        evaluate_now(trainer, &pb)?;
    }
    let started = Instant::now();
    let mut saved_at = None;
    let mut evaluated_at = Some(trainer.state.step);
    let mut done_here = 0;
    while trainer.state.step < total {
        if crate::dist::any(trainer.communicator(), crate::signal::requested())? {
            outcome.interrupted = true;
            break;
        }
        // every rank must agree to stop, or one would wait forever in the next collective
        let spent = options
            .time_budget
            .is_some_and(|s| started.elapsed().as_secs_f64() > s);
        if done_here > 0 && crate::dist::any(trainer.communicator(), spent)? {
            outcome.out_of_time = true;
            break;
        }
        if options.max_steps.is_some_and(|n| done_here >= n) {
            break;
        }
        let device = trainer.model().device();
        let m = crate::out_of_memory::guard(
            &format!("training step {}", trainer.state.step + 1),
            || {
                <B as qerl_model::QerlBackend>::memory_usage(&device).map(|(used, reserved)| {
                    format!(
                        "{:.1} GB in use, {:.1} GB reserved by the allocator",
                        used as f64 / 1e9,
                        reserved as f64 / 1e9
                    )
                })
            },
            || trainer.train_step(),
        )?;
        done_here += 1;
        if let Some(w) = writer.as_mut() {
            w.write(&m)?;
        }
        pb.set_position(trainer.state.step as u64);
        pb.set_message(format!(
            "reward {:.3} acc {:.2} loss {:+.4} kl {:.4} |g| {:.3} len {:.1} sigma {:.1e}",
            m.reward_mean, m.accuracy, m.loss, m.kl, m.grad_norm, m.completion_len_mean, m.sigma
        ));
        if m.reward_failures > 0 && main {
            pb.println(format!(
                "step {}: {} reward failures (scored 0)",
                m.step, m.reward_failures
            ));
        }
        outcome.metrics.push(m);
        let step = trainer.state.step;
        if c.train.ckpt_interval > 0 && step.is_multiple_of(c.train.ckpt_interval) && main {
            outcome.checkpoint = Some(trainer.save_checkpoint()?);
            saved_at = Some(step);
        }
        if every > 0 && (step.is_multiple_of(every) || step == total) {
            evaluate_now(trainer, &pb)?;
            evaluated_at = Some(step);
        }
    }
    if saved_at != Some(trainer.state.step) && (trainer.state.step > 0) && main {
        outcome.checkpoint = Some(trainer.save_checkpoint()?);
    }
    if every > 0 && evaluated_at != Some(trainer.state.step) {
        evaluate_now(trainer, &pb)?;
    }
    pb.finish_and_clear();
    outcome.steps = trainer.state.step;
    if main {
        let all = read_jsonl(&metrics_path)?;
        plot_run(&all, &plot_path)?;
    }
    Ok(outcome)
}
