//! `qerl train --config FILE.toml [--set key=value ...] [--resume DIR] [--device auto|cpu|wgpu|cuda]`.
//!
//! GRPO / DAPO / Dr. GRPO post-training of a frozen (NVFP4 or BF16) model through LoRA (and
//! optionally its RMSNorm weights), with AQN noise in the norms. The loop lives in the
//! `qerl_train` library (`src/train`): see its docs for what is written where.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::ValueEnum;
use qerl_rl::TrainConfig;
use qerl_train::checkpoint::{resolve_checkpoint, CONFIG_FILE};
use qerl_train::{RunOptions, TrainBackend, TrainSetup, Trainer};

/// Where training runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TrainDevice {
    /// CUDA when this build has it and a GPU is present, else the CPU.
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run's TOML config (see configs/); with --resume, default: the checkpoint's own.
    #[arg(long, required_unless_present = "resume")]
    pub config: Option<PathBuf>,
    /// Override a config value, e.g. `--set optim.lr=1e-5` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue a run from a checkpoint directory (or a run directory: its latest checkpoint).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// tokenizer.json when the model directory has none.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = TrainDevice::Auto)]
    pub device: TrainDevice,
    /// Stop after this many steps of this invocation (a checkpoint is written; resume later).
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Feed prompts as plain text instead of the ChatML template.
    #[arg(long)]
    pub no_chat: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn gpu_present() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists() || std::path::Path::new("/dev/nvidia0").exists()
}

pub fn run(args: Args) -> Result<()> {
    let resume = args.resume.as_deref().map(resolve_checkpoint).transpose()?;
    let config_path = match (&args.config, &resume) {
        (Some(c), _) => c.clone(),
        (None, Some(dir)) => dir.join(CONFIG_FILE),
        (None, None) => unreachable!("clap requires --config without --resume"),
    };
    let config = TrainConfig::load(&config_path, &args.set)?;
    let mut setup = TrainSetup::from_config(config, args.tokenizer.as_deref())?;
    setup.chat = !args.no_chat;
    let device = match args.device {
        TrainDevice::Auto if cfg!(feature = "cuda") && gpu_present() => TrainDevice::Cuda,
        TrainDevice::Auto => TrainDevice::Cpu,
        d => d,
    };
    qerl_train::signal::install();
    let options = RunOptions {
        progress: !args.quiet,
        max_steps: args.max_steps,
    };
    eprintln!("training on {device:?}");
    match device {
        TrainDevice::Cpu => {
            go::<burn::backend::Autodiff<qerl_nn::backends::Cpu>>(setup, resume, &options)
        }
        #[cfg(feature = "wgpu")]
        TrainDevice::Wgpu => {
            go::<burn::backend::Autodiff<qerl_nn::backends::Wgpu>>(setup, resume, &options)
        }
        #[cfg(feature = "cuda")]
        TrainDevice::Cuda => {
            go::<burn::backend::Autodiff<qerl_nn::backends::Cuda>>(setup, resume, &options)
        }
        #[allow(unreachable_patterns)]
        other => anyhow::bail!("this build of qerl has no {other:?} support (see --features)"),
    }
}

fn go<B: TrainBackend>(
    setup: TrainSetup,
    resume: Option<PathBuf>,
    options: &RunOptions,
) -> Result<()> {
    let device = B::Device::default();
    let mut trainer = match &resume {
        Some(dir) => {
            let t = Trainer::<B>::resume(setup, dir, &device)?;
            eprintln!("resumed from `{}` at step {}", dir.display(), t.state.step);
            t
        }
        None => Trainer::<B>::new(setup, &device)?,
    };
    let out = qerl_train::run(&mut trainer, options).context("training failed")?;
    if let Some(m) = out.metrics.last() {
        eprintln!(
            "step {}/{}: reward {:.3}, accuracy {:.3}, loss {:+.4}",
            out.steps,
            trainer.config().train.steps,
            m.reward_mean,
            m.accuracy,
            m.loss
        );
    }
    if let Some(c) = &out.checkpoint {
        eprintln!("checkpoint: {}", c.display());
    }
    eprintln!(
        "metrics: {} (plot: {})",
        out.metrics_path.display(),
        out.plot_path.display()
    );
    if out.interrupted {
        eprintln!(
            "interrupted: resume with `qerl train --resume {}`",
            trainer.config().train.output_dir.display()
        );
    }
    Ok(())
}
